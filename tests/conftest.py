import os
from pathlib import Path

import pytest

from hybridlm.threads import configure_threads

# a pinned count: tests are repeatable, and no thread governor changes it under a test
configure_threads(max(1, min(2, os.cpu_count() or 1)))

import torch  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state, so runs are repeatable."""
    torch.manual_seed(0)


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, the originals of the packaged data sets (`hybridlm.data.builtin`), or
    skip: a fresh clone has no ../shared. Tests read the packaged copies; only the checksum
    comparison with the originals needs this."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip("../shared/data is not present")
    return path


@pytest.fixture
def one_thread():
    """One intra-op thread for batch-1 decoding and tiny training runs: extra threads only add
    synchronisation there, and on a machine where another process holds a core two threads make
    these tests tens of times slower. Results are also independent of the core count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
