"""Named options of the library that the command line offers as `choices=` and in help texts.

They live in this torch-free module so that building the argument parser (`hybridlm --help`, a
mistyped flag) imports no torch; the modules that implement them import them from here.
"""

from __future__ import annotations

# storage precisions of the Mamba SSM state cache (model/state_precision.py)
SSM_PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "fp16-sr", "int16-block")

# post-training quantisation recipes of `hybridlm quantize` (train/stages/quantize.py)
PTQ_RECIPES: tuple[str, ...] = ("fp8", "nvfp4", "autoquant")

# how an engine stores the attention KV cache (vLLM's `kv_cache_dtype`; precision/kv_cache.py):
# "auto" = the format the checkpoint declares, else the activation dtype
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "nvfp4")

# Not quantised by default: the LM head (as ModelOpt's default config) and the MTP drafter (kept
# in BF16 in Nemotron 3 Super, so speculative acceptance is not traded for memory).
PTQ_DEFAULT_EXCLUDE: tuple[str, ...] = ("lm_head", "mtp.*", "mtp_depths.*")

# log levels of the HTTP servers (infer/server.py: `hybridlm serve`, `hybridlm env-serve`)
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")

# torch dtypes a model is evaluated in (eval/harness.py)
EVAL_DTYPES: tuple[str, ...] = ("bfloat16", "float32", "float64")
