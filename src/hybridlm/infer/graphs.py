"""Decode steps over a `SlotCache`, captured as CUDA graphs: one graph per (rows bucket,
columns bucket, tokens per row), replayed with new inputs.

Shape legend: n rows in use, b rows of the bucket, L tokens per row, V vocabulary, D width.

On a GPU a decode step of a small model is bound by kernel launches, not by memory: every
layer issues tens of small kernels. A captured graph replays all of them with one launch.
The step runs over the static buffers of a `model.slots.SlotCache`, so its tensors never move:
the token ids are copied into the graph's input buffer, the graph writes the keys, values and
states in place and leaves the logits and hidden states in its output buffers. Rows in use are
padded to a row bucket (1, 2, 4, 8, ... up to the cache's rows) and the columns attended over to
a column bucket (256, 512, ... up to the cache's columns), so a few graphs serve every batch
and length. A speculative verification (L = draft length + 1 per row, `history=True`) has its
own graphs, and so has the per-row rewind after it.

The first call of a bucket runs eagerly (it is a real step, and it warms up cuBLAS and the
Triton kernels), then captures the graph without running it; later calls replay. With
`capture=False` (CPU, or `cuda_graphs=False` in the engine) every call runs eagerly through
the same code: what the CPU tests check against the dynamic cache.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from ..model.cache import AS_GIVEN, HybridCache
from ..model.moe import Experts, run_local
from ..model.slots import STATIC_SSM_PRECISIONS, SlotCache
from ..ops import fused
from ..precision.kv_cache import FP8KV

log = logging.getLogger("hybridlm.graphs")

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_COLUMNS = 256


def graph_safe_codecs(codecs: dict) -> bool:
    """Whether every KV codec encodes and decodes without host syncs or host tensors (stored as
    given, or FP8 under a static scale); NVFP4's checks read values back."""
    return all(isinstance(c, (type(AS_GIVEN), FP8KV)) for pair in codecs.values() for c in pair)


def decode_graphs(
    model: torch.nn.Module,
    rows: int,
    columns: int,
    *,
    ssm_precision: str = "fp32",
    kv_codecs: dict | None = None,
    cuda_graphs: bool | None = None,
    reuse: tuple | None = None,
    verify: bool = False,
) -> DecodeGraphs | None:
    """The static decode path of `rows` x `columns` for a decoder (`Engine`, `generate`), or
    None for the growing `HybridCache`. `cuda_graphs=None`: on for a CUDA model when the cache
    formats allow it (fp16-sr SSM states and NVFP4 KV caches do not) and the slots take at most
    half of the free GPU memory; True: required (on the CPU: the same slot steps run eagerly,
    what the tests use); False: off. `reuse` (a key of the cache formats): keep the slots and
    their graphs with the model (weakly; the `KEEP_PER_MODEL` most recent sets) and hand them
    out again to the next call with the same key and shape, so repeated `generate` calls do
    not capture again. `verify`: speculative verification will run (its per-position state
    buffers count in the memory check)."""
    kv_codecs = kv_codecs or {}
    device = model.embeddings.weight.device
    on_cuda = device.type == "cuda"
    why_not = None
    if ssm_precision not in STATIC_SSM_PRECISIONS:
        why_not = f"SSM states stored in {ssm_precision}"
    elif on_cuda and not graph_safe_codecs(kv_codecs):
        why_not = "an NVFP4 KV cache"
    elif on_cuda:
        why_not = capture_blocker(model)
    if cuda_graphs is False or (cuda_graphs is None and (not on_cuda or why_not)):
        return None
    if why_not is not None:
        raise ValueError(f"cuda_graphs: the static decode cache does not support {why_not}")
    need = SlotCache.planned_nbytes(model, rows, columns, verify=verify)
    if cuda_graphs is None and need > torch.cuda.mem_get_info(device)[0] // 2:
        log.info("decoding without CUDA graphs: %d x %d slots need %.1f GiB", rows, columns,
                 need / 2**30)  # fmt: skip
        return None
    # what the captured kernels depend on besides the shapes: the decode step functions
    # (`HybridLM.compile_decode`), whether the Triton kernels are on, and where the weights
    # are (a reloaded or cast model has new weight buffers)
    fns = tuple(getattr(m, "decode_fn", None) for m in model.modules())
    params = list(model.parameters())
    weights = tuple((p.data_ptr(), p.dtype) for p in params)
    key = (reuse, rows, columns, ssm_precision, on_cuda, fns, fused.usable(*params), weights)
    kept = _KEPT.setdefault(model, {}) if reuse is not None else {}
    graphs = kept.pop(key, None)
    if graphs is not None:
        graphs.slots.keep([])  # every slot free again
    else:
        slots = SlotCache(model, rows, columns, ssm_precision=ssm_precision, kv_codecs=kv_codecs)
        graphs = DecodeGraphs(model, slots, capture=on_cuda)
    if reuse is not None:
        kept[key] = graphs  # the most recent last
        while len(kept) > KEEP_PER_MODEL:
            kept.pop(next(iter(kept)))
    return graphs


KEEP_PER_MODEL = 4
# model -> {key: DecodeGraphs}, the most recently used last
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def capture_blocker(model: torch.nn.Module) -> str | None:
    """Why a decode step of `model` cannot be captured, or None: modules converted from
    outside (quantised linears, PTQ experts) may read values back to the host, and so does the
    routed experts' dispatch without the Triton kernels (it hands the per-expert counts to the
    host)."""
    for m in model.modules():
        if not type(m).__module__.startswith(("torch.nn", "hybridlm.model")):
            return f"a converted module ({type(m).__name__}) in the model"
    for m in model.modules():
        if isinstance(m, Experts) and not (
            m.dispatch is run_local and fused.usable(m.up_proj, m.down_proj)
        ):
            return "routed experts without the Triton kernels (HYBRIDLM_FUSED=0 or no triton)"
    return None


def cache_forward(
    model: torch.nn.Module,
    ids_BL: torch.Tensor,
    cache: HybridCache | SlotCache,
    *,
    history: bool = False,
    return_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, hidden) of `ids_BL` continuing `cache`; `history` keeps the Mamba states after
    every position of this call (`record_history`), for a per-row rewind."""
    cache.record_history(history)
    try:
        out = model(ids_BL, cache=cache, return_hidden=return_hidden)
    finally:
        cache.record_history(False)
    return out.logits, out.hidden


def _bucket(n: int, choices: list[int]) -> int:
    return next(c for c in choices if c >= n)


class DecodeGraphs:
    """Captured decode steps of `model` over `slots` (see the module)."""

    def __init__(self, model: torch.nn.Module, slots: SlotCache, *, capture: bool) -> None:
        if capture and slots.device.type != "cuda":
            raise ValueError("CUDA graphs capture CUDA tensors; this model is on the CPU")
        # weakly: graphs kept with a model (`decode_graphs(reuse=...)`) must not keep it alive
        self._model = weakref.ref(model)
        self.slots, self.capture = slots, capture
        R, S = slots.rows, slots.columns
        self.row_buckets = sorted({*(r for r in ROW_BUCKETS if r < R), R})
        cols, c = [], MIN_COLUMNS
        while c < S:
            cols.append(c)
            c *= 2
        self.col_buckets = [*cols, S]
        self._graphs: dict[tuple, tuple] = {}  # key -> (graph, static inputs, static outputs)
        self._pool = None
        self.stats = {"captured": 0, "replayed": 0, "eager": 0}

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of these decode graphs was freed")
        return model

    # ------------------------------------------------------------------ calls
    @torch.no_grad()
    def forward(
        self, ids_nL: torch.Tensor, *, history: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One call of L tokens for each of the first n slots (the rows in use): returns
        (logits [n, L, V], hidden [n, L, D]), copies the caller may keep. `history`: record
        the Mamba states after every position, for `rewind`."""
        sl = self.slots
        n, L = ids_nL.shape
        b, s = self.bucket(n, L)
        ids = ids_nL if b == n else torch.cat([ids_nL, ids_nL.new_zeros(b - n, L)])
        key = ("step", b, s, L, history)

        def step(ids_bL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return cache_forward(self.model, ids_bL, sl, history=history)

        logits, hidden = self.run(key, (b, s), step, (ids.to(sl.device),))
        for r in range(n):
            sl.host_len[r] += L
        self._last = key
        return logits[:n].clone(), hidden[:n].clone()

    @torch.no_grad()
    def rewind(self, keep: list[int]) -> None:
        """After `forward(..., history=True)`: keep the first keep[r] (1..L) tokens of row r."""
        key = self._last
        _, b, s, L, history = key
        if not history:
            raise ValueError("rewind follows a forward made with history=True")
        if len(keep) > b or any(not 1 <= k <= L for k in keep):
            raise ValueError(f"keep one count in 1..{L} per row, got {keep}")
        sl = self.slots
        keep_b = torch.tensor(keep + [L] * (b - len(keep)), device=sl.device)

        def rewind(keep_b: torch.Tensor) -> tuple[torch.Tensor, ...]:
            sl.rewind(keep_b, L)
            return ()

        self.run(("rewind", b, L), (b, s), rewind, (keep_b,))
        for r, k in enumerate(keep):
            sl.host_len[r] += k - L

    # ------------------------------------------------------------------ capture and replay
    def bucket(self, n: int, L: int) -> tuple[int, int]:
        """The (rows, columns) bucket of a call of L tokens for each of the first n slots."""
        sl = self.slots
        if n > sl.rows:
            raise ValueError(f"{n} rows do not fit a SlotCache of {sl.rows}")
        need = max(sl.host_len[:n]) + L
        if need > sl.columns:
            raise ValueError(f"a row reaches {need} positions; the SlotCache holds {sl.columns}")
        return _bucket(n, self.row_buckets), _bucket(need, self.col_buckets)

    def run(
        self,
        key: tuple,
        bucket: tuple[int, int],
        fn: Callable,
        inputs: tuple,
        *,
        capture: bool = True,
    ) -> tuple:
        """`fn(*inputs)` over the slots' `bucket`: replayed when a graph of `key` exists, else
        run eagerly and (`capture`, on CUDA) captured for the next calls. `fn` must only read
        `inputs` and the slots (its outputs are the graph's buffers, overwritten by the next
        replay). `capture=False`: a call with host work inside (sampling with a generator),
        always run eagerly."""
        self.slots.bucket = bucket
        entry = self._graphs.get(key) if capture else None
        if entry is not None:
            graph, static_in, static_out = entry
            for buf, x in zip(static_in, inputs, strict=True):
                buf.copy_(x)
            graph.replay()
            self.stats["replayed"] += 1
            return static_out
        out = fn(*inputs)  # the real step, eagerly; it also warms the kernels up
        self.stats["eager"] += 1
        if self.capture and capture:
            self._capture(key, fn, inputs)
        return out

    def _capture(self, key: tuple, fn: Callable, inputs: tuple) -> None:
        """Record `fn` on static copies of `inputs` (capture runs nothing: no state changes).
        A capture that fails (an operation that cannot be recorded) leaves these graphs eager
        from then on, with a warning: the step it belongs to already ran."""
        static_in = tuple(x.clone() for x in inputs)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                static_out = fn(*static_in)
        except Exception as err:
            log.warning("CUDA graph capture failed, decoding eagerly: %s: %s",
                        type(err).__name__, err)  # fmt: skip
            self.capture = False
            torch.cuda.synchronize()
            return
        self._pool = graph.pool()
        self._graphs[key] = (graph, static_in, static_out)
        self.stats["captured"] += 1
