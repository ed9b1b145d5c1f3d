"""Per-layer inference state of a hybrid model: KV for attention, conv + SSM state for Mamba.

Shape legend: B batch, K kv heads, S cached length (KV) or conv taps - 1 (conv), E head dim,
X conv channels, H heads, P head dim, N state size.
A `HybridCache` holds one state per block (None for stateless MLP / MoE blocks) and the number
of tokens already seen, which is the position offset of the next forward call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .state_precision import StoredState, check_precision


class KVState:
    """Keys and values of one attention layer in a preallocated buffer that doubles when full;
    `update` appends and returns views of the valid prefix, `truncate` rolls back."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity0 = capacity
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.length = 0

    def update(
        self, k_BKLE: torch.Tensor, v_BKLE: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        L = k_BKLE.shape[2]
        need = self.length + L
        if self._k is None or need > self._k.shape[2]:
            cap = max(self.capacity0, need, 2 * (0 if self._k is None else self._k.shape[2]))
            k_new = k_BKLE.new_empty(*k_BKLE.shape[:2], cap, k_BKLE.shape[3])
            v_new = v_BKLE.new_empty(*v_BKLE.shape[:2], cap, v_BKLE.shape[3])
            if self._k is not None:
                k_new[:, :, : self.length] = self._k[:, :, : self.length]
                v_new[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v = k_new, v_new
        self._k[:, :, self.length : need] = k_BKLE
        self._v[:, :, self.length : need] = v_BKLE
        self.length = need
        return self.k_BKSE, self.v_BKSE

    @property
    def k_BKSE(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def v_BKSE(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (e.g. rejected speculative drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of length {self.length} to {length}")
        self.length = length

    def nbytes(self) -> int:
        if self._k is None:
            return 0
        return 2 * self._k[:, :, : self.length].numel() * self._k.element_size()


class MambaState:
    """Conv state (kept in the activation dtype) and SSM state (kept in `precision`, see
    `state_precision`). `ssm_BHPN` reads back fp32 and stores on assignment; each store is one
    step of the (seed, layer, step) counter used by stochastic rounding."""

    def __init__(self, precision: str = "fp32", *, seed: int = 0, layer: int = 0) -> None:
        self.precision = check_precision(precision)
        self.seed, self.layer, self.steps = seed, layer, 0
        self.conv_BSX: torch.Tensor | None = None
        self._ssm: StoredState | None = None

    @property
    def ssm_BHPN(self) -> torch.Tensor | None:
        return None if self._ssm is None else self._ssm.load()

    @ssm_BHPN.setter
    def ssm_BHPN(self, value: torch.Tensor | None) -> None:
        if value is None:
            self._ssm = None
            return
        self._ssm = StoredState.store(
            value, self.precision, seed=self.seed, layer=self.layer, step=self.steps
        )
        self.steps += 1

    def ssm_nbytes(self) -> int:
        return 0 if self._ssm is None else self._ssm.nbytes()

    def snapshot(self) -> tuple:
        # every step replaces conv_BSX and _ssm instead of mutating them, so references suffice
        return self.conv_BSX, self._ssm, self.steps

    def restore(self, snap: tuple) -> None:
        self.conv_BSX, self._ssm, self.steps = snap


@dataclass
class HybridCache:
    layers: list[KVState | MambaState | None] = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def for_pattern(
        cls, pattern: str, *, ssm_precision: str = "fp32", seed: int = 0
    ) -> HybridCache:
        """One state per block; `ssm_precision` is one of `state_precision.SSM_PRECISIONS`."""
        check_precision(ssm_precision)

        def make(i: int, letter: str) -> KVState | MambaState | None:
            if letter == "*":
                return KVState()
            if letter == "M":
                return MambaState(ssm_precision, seed=seed, layer=i)
            return None

        return cls(layers=[make(i, c) for i, c in enumerate(pattern)])

    def snapshot(self) -> tuple:
        """A cheap restore point: KV lengths and references to the Mamba states."""
        saved = [
            st.length if isinstance(st, KVState) else st.snapshot() if st is not None else None
            for st in self.layers
        ]
        return self.seen_tokens, saved

    def restore(self, snap: tuple) -> None:
        """Return to a `snapshot()` taken earlier on this cache (later tokens are forgotten)."""
        self.seen_tokens, saved = snap
        for st, s in zip(self.layers, saved, strict=True):
            if isinstance(st, KVState):
                st.truncate(s)
            elif st is not None:
                st.restore(s)

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on; only attention-only caches can (Mamba states
        cannot be rewound without a snapshot)."""
        if any(isinstance(st, MambaState) for st in self.layers):
            raise ValueError("a cache with Mamba states rewinds through snapshot()/restore()")
        for st in self.layers:
            if isinstance(st, KVState):
                st.truncate(length)
        self.seen_tokens = length
