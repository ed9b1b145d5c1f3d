"""`python -m hybridlm.cli ...` (and `torchrun ... -m hybridlm.cli pretrain`): `hybridlm ...`."""

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
