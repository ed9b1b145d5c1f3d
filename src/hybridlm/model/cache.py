"""Per-layer inference state of a hybrid model: KV for attention, conv + SSM state for Mamba.

Shape legend: B batch, K kv heads, S cached length (KV) or conv taps - 1 (conv), E head dim,
X conv channels, H heads, P head dim, N state size.
A `HybridCache` holds one state per block (None for stateless MLP / MoE blocks) and the number
of cache columns already written, which is the position offset of the next forward call.

Batches whose rows have different lengths (left-padded prompts, continuous batching) are kept
*right-aligned*: every row's real tokens are contiguous and end at the last column, padding sits
on the left and is masked by `key_mask_BS`; `positions_B` holds each row's next position. Then a
decode step appends one column for every row, a causal mask over columns is the causal mask over
positions, and a sliding window over columns is the window over positions. `select` (rows leave),
`cat` (rows join, shorter caches padded on the left) and `trim` (drop all-padding columns) keep
that layout. Mamba states need no padding: padded prompt positions leave them untouched (the
mixer zeroes their conv input and dt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from .state_precision import StoredState, check_precision


class KVCodec(Protocol):
    """How an attention layer stores its keys (or values) between calls: `encode` turns
    [B, K, L, E] into storage parts whose leading dims are [B, K, L] (codes, block scales, ...);
    `decode` turns the parts of the valid columns back into the activation dtype. Quantised
    codecs are applied from outside (`precision.kv_cache`); the default stores as given."""

    def encode(self, x_BKLE: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor: ...


class AsGiven:
    """Keys / values stored in the activation dtype (decoding returns views, no copy)."""

    def encode(self, x_BKLE: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x_BKLE,)

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return parts[0]


AS_GIVEN = AsGiven()
Parts = tuple[torch.Tensor, ...]


class KVState:
    """Keys and values of one attention layer in preallocated buffers that double when full;
    `update` appends and returns the valid prefix (views for the default codec, decoded copies
    for a quantised one: stored quantised, dequantised for attention), `truncate` rolls back.
    `codec`: (keys, values) `KVCodec`s; every storage part shares the [B, K, S] leading dims,
    so row selection, padding and column moves act on the stored parts as they are."""

    def __init__(self, capacity: int = 256, codec: tuple[KVCodec, KVCodec] | None = None) -> None:
        self.capacity0 = capacity
        self.codec = codec or (AS_GIVEN, AS_GIVEN)
        self._k: Parts | None = None
        self._v: Parts | None = None
        self.dtype: torch.dtype | None = None  # what decoding returns (the activations')
        self.length = 0

    def update(
        self, k_BKLE: torch.Tensor, v_BKLE: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.dtype = k_BKLE.dtype
        self._append(self.codec[0].encode(k_BKLE), self.codec[1].encode(v_BKLE))
        return self.k_BKSE, self.v_BKSE

    def _append(self, kp: Parts, vp: Parts) -> None:
        L = kp[0].shape[2]
        need = self.length + L
        if self._k is None or need > self._k[0].shape[2]:
            cap = max(self.capacity0, need, 2 * (0 if self._k is None else self._k[0].shape[2]))

            def grown(old: Parts | None, new: Parts) -> Parts:
                out = tuple(p.new_empty(*p.shape[:2], cap, *p.shape[3:]) for p in new)
                if old is not None:
                    for o, b in zip(out, old, strict=True):
                        o[:, :, : self.length] = b[:, :, : self.length]
                return out

            self._k, self._v = grown(self._k, kp), grown(self._v, vp)
        assert self._k is not None and self._v is not None
        for buf, part in zip(self._k + self._v, kp + vp, strict=True):
            buf[:, :, self.length : need] = part
        self.length = need

    def parts(self) -> tuple[Parts, Parts] | None:
        """The stored parts of the valid columns (views): keys, values."""
        if self._k is None or self._v is None:
            return None
        n = self.length
        return tuple(p[:, :, :n] for p in self._k), tuple(p[:, :, :n] for p in self._v)

    @property
    def k_BKSE(self) -> torch.Tensor | None:
        kv = self.parts()
        return None if kv is None else self.codec[0].decode(kv[0], self.dtype)

    @property
    def v_BKSE(self) -> torch.Tensor | None:
        kv = self.parts()
        return None if kv is None else self.codec[1].decode(kv[1], self.dtype)

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (e.g. rejected speculative drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of length {self.length} to {length}")
        self.length = length

    def nbytes(self) -> int:
        """Bytes of the valid keys and values as stored."""
        kv = self.parts()
        return 0 if kv is None else sum(p.numel() * p.element_size() for p in kv[0] + kv[1])

    def allocated_nbytes(self) -> int:
        """Bytes of the buffers, including the capacity not yet written."""
        if self._k is None or self._v is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self._k + self._v)

    def like(self, kp: Parts, vp: Parts) -> KVState:
        """A state of the same codec owning copies of these stored parts (room to grow)."""
        st = KVState(capacity=max(256, 2 * kp[0].shape[2]), codec=self.codec)
        st.dtype = self.dtype
        st._append(kp, vp)
        return st

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KVState:
        kv = self.parts()
        if kv is None:
            raise ValueError("the KV cache holds no columns yet")
        return self.like(tuple(fn(p) for p in kv[0]), tuple(fn(p) for p in kv[1]))

    def select(self, rows: torch.Tensor) -> KVState:
        return self._map(lambda p: p[rows])

    def copy(self) -> KVState:
        """An independent copy of the valid columns."""
        return self._map(lambda p: p)

    def view(self) -> KVState:
        """A state sharing storage with this one (views of the valid columns)."""
        out = KVState(codec=self.codec)
        kv = self.parts()
        if kv is not None:
            out._k, out._v, out.length, out.dtype = kv[0], kv[1], self.length, self.dtype
        return out

    def padded_left(self, n: int) -> tuple[Parts, Parts]:
        """The stored parts of the valid columns with `n` zero columns in front (zero codes
        decode to 0 in every format)."""
        kv = self.parts()
        if kv is None:
            raise ValueError("the KV cache holds no columns yet")
        return tuple(_pad_cols(p, n) for p in kv[0]), tuple(_pad_cols(p, n) for p in kv[1])

    def zeros(self, rows: int, columns: int) -> tuple[Parts, Parts]:
        """Stored parts of `rows` rows of `columns` zero columns, shaped like this state's."""
        kv = self.parts()
        if kv is None:
            raise ValueError("the KV cache holds no columns yet")

        def z(p: torch.Tensor) -> torch.Tensor:
            return p.new_zeros(rows, p.shape[1], columns, *p.shape[3:])

        return tuple(z(p) for p in kv[0]), tuple(z(p) for p in kv[1])

    def drop_left(self, n: int) -> None:
        """Forget the first `n` columns (all-padding columns after rows left the batch)."""
        if n:
            self._hold(self._map(lambda p: p[:, :, n:]))

    def gather_columns(self, src_BS: torch.Tensor) -> None:
        """Hold in row b the valid columns src_BS[b] (in that order)."""
        B, S = src_BS.shape

        def g(p: torch.Tensor) -> torch.Tensor:
            idx = src_BS.reshape(B, 1, S, *([1] * (p.dim() - 3)))
            idx = idx.expand(B, p.shape[1], S, *p.shape[3:])
            if p.element_size() == 1:  # float8 codes: gathered as their bytes
                return p.view(torch.uint8).gather(2, idx).view(p.dtype)
            return p.gather(2, idx)

        self._hold(self._map(g))

    def _hold(self, other: KVState) -> None:
        self._k, self._v, self.length = other._k, other._v, other.length


def _pad_cols(p: torch.Tensor, n: int) -> torch.Tensor:
    """`n` zero columns (dim 2) in front of a [B, K, S, ...] part."""
    return torch.cat([p.new_zeros(*p.shape[:2], n, *p.shape[3:]), p], dim=2)


class MambaState:
    """Conv state (kept in the activation dtype) and SSM state (kept in `precision`, see
    `state_precision`). `ssm_BHPN` reads back fp32 and stores on assignment; each store is one
    step of the (seed, layer, step) counter used by stochastic rounding."""

    def __init__(self, precision: str = "fp32", *, seed: int = 0, layer: int = 0) -> None:
        self.precision = check_precision(precision)
        self.seed, self.layer, self.steps = seed, layer, 0
        self.conv_BSX: torch.Tensor | None = None
        self._ssm: StoredState | None = None
        self.record_history = False  # keep the state after each position of the next call
        self._history: tuple | None = None

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

    def set_history(
        self, conv_in_BSX: torch.Tensor | None, xbc_BLX: torch.Tensor, ssm_BLHPN: torch.Tensor
    ) -> None:
        """Called by the mixer when `record_history` is on: the conv input of the call (the
        conv state after position j is the last S inputs up to j) and every position's state."""
        self._history = (conv_in_BSX, xbc_BLX, ssm_BLHPN)

    def rewind(self, keep: int | torch.Tensor) -> None:
        """Keep only the first `keep` (>= 1) positions of the last recorded call: one count for
        every row, or a [B] tensor of counts per row (a batch whose rows verified different
        numbers of drafts)."""
        if self._history is None:
            raise ValueError("rewind needs a call made with record_history on")
        xbc = self._history[1]
        Bsz, L = xbc.shape[:2]
        keep_B = torch.as_tensor(keep, device=xbc.device).long().expand(Bsz)
        if not bool(((keep_B >= 1) & (keep_B <= L)).all()):
            raise ValueError(f"can keep 1..{L} positions of the last call, not {keep}")
        self.conv_BSX, self.ssm_BHPN = self._rewound(keep_B)
        self._history = None

    def _rewound(self, keep_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and SSM states after each row's position keep_B - 1 of the recorded call
        (tensor ops only: no check, no host sync)."""
        conv_in, xbc, ssm = self._history
        Bsz = xbc.shape[0]
        S = self.conv_BSX.shape[1]
        if conv_in is None:
            xp = F.pad(xbc, (0, 0, S, 0))
        else:
            xp = torch.cat([conv_in.to(xbc.dtype), xbc], dim=1)
        # the conv state after position keep - 1 is the S inputs ending there
        cols_BS = keep_B[:, None] + torch.arange(S, device=xbc.device)
        conv_BSX = xp.gather(1, cols_BS[..., None].expand(-1, -1, xp.shape[2]))
        return conv_BSX, ssm[torch.arange(Bsz, device=ssm.device), keep_B - 1]

    def ssm_nbytes(self) -> int:
        return 0 if self._ssm is None else self._ssm.nbytes()

    def snapshot(self) -> tuple:
        # every step replaces conv_BSX and _ssm instead of mutating them, so references suffice
        return self.conv_BSX, self._ssm, self.steps

    def restore(self, snap: tuple) -> None:
        self.conv_BSX, self._ssm, self.steps = snap

    def _like(self, conv: torch.Tensor | None, ssm: StoredState | None, steps: int) -> MambaState:
        out = MambaState(self.precision, seed=self.seed, layer=self.layer)
        out.conv_BSX, out._ssm, out.steps = conv, ssm, steps
        return out

    def select(self, rows: torch.Tensor) -> MambaState:
        conv = None if self.conv_BSX is None else self.conv_BSX[rows]
        ssm = None if self._ssm is None else self._ssm.select(rows)
        return self._like(conv, ssm, self.steps)

    @staticmethod
    def cat(states: list[MambaState]) -> MambaState:
        """Rows of several states in one (all must have run at least one step)."""
        if any(st.conv_BSX is None or st._ssm is None for st in states):
            raise ValueError("only Mamba states that have seen tokens can be batched together")
        ssm = StoredState.cat([st._ssm for st in states])
        conv = torch.cat([st.conv_BSX for st in states])
        return states[0]._like(conv, ssm, max(st.steps for st in states))


@dataclass
class HybridCache:
    layers: list[KVState | MambaState | None] = field(default_factory=list)
    seen_tokens: int = 0  # columns written (= tokens seen when rows are unpadded)
    key_mask_BS: torch.Tensor | None = None  # False on padding columns; None: all valid
    positions_B: torch.Tensor | None = None  # next position of each row; None: seen_tokens

    @property
    def padded(self) -> bool:
        return self.key_mask_BS is not None

    def advance(self, L: int) -> None:
        """After a forward of L tokens per row (`HybridLM.forward`)."""
        self.seen_tokens += L

    def next_positions(self, batch: int, device: torch.device) -> torch.Tensor:
        if self.positions_B is not None:
            return self.positions_B
        return torch.full((batch,), self.seen_tokens, dtype=torch.long, device=device)

    def batch_size(self) -> int:
        if self.key_mask_BS is not None:
            return self.key_mask_BS.shape[0]
        for st in self.layers:
            if isinstance(st, KVState) and st.k_BKSE is not None:
                return st.k_BKSE.shape[0]
            if isinstance(st, MambaState) and st.conv_BSX is not None:
                return st.conv_BSX.shape[0]
        raise ValueError("an empty cache has no batch size")

    def _device(self) -> torch.device:
        for st in self.layers:
            if isinstance(st, KVState) and st.k_BKSE is not None:
                return st.k_BKSE.device
            if isinstance(st, MambaState) and st.conv_BSX is not None:
                return st.conv_BSX.device
        return torch.device("cpu")

    def _full_mask(self) -> torch.Tensor:
        if self.key_mask_BS is not None:
            return self.key_mask_BS
        return torch.ones(
            self.batch_size(), self.seen_tokens, dtype=torch.bool, device=self._device()
        )

    def _full_positions(self) -> torch.Tensor:
        return self.next_positions(self.batch_size(), self._device())

    def select(self, rows: torch.Tensor | list[int]) -> HybridCache:
        """A cache of the given rows (e.g. the requests still running)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self._device())
        layers = [None if st is None else st.select(rows) for st in self.layers]
        out = HybridCache(layers, self.seen_tokens)
        out.key_mask_BS = self._full_mask()[rows]
        out.positions_B = self._full_positions()[rows]
        out.trim()
        return out

    @classmethod
    def cat(cls, caches: list[HybridCache], device: torch.device | None = None) -> HybridCache:
        """Rows of several caches in one, right-aligned: shorter caches are padded on the left
        (masked columns), so every row's last token sits in the last column. An attention-only
        cache that has seen no tokens yet joins as one row of padding (`device`: where such
        rows' masks live when no cache holds a tensor yet; default: the caches' device)."""
        S = max(c.seen_tokens for c in caches)
        rows = [c.batch_size() if c.seen_tokens or c.key_mask_BS is not None else 1 for c in caches]
        if device is None:
            device = next((c._device() for c in caches if c.seen_tokens), None)
            if device is None:
                device = next(
                    (c.key_mask_BS.device for c in caches if c.key_mask_BS is not None),
                    torch.device("cpu"),
                )
        layers: list[KVState | MambaState | None] = []
        for states in zip(*(c.layers for c in caches), strict=True):
            first = states[0]
            if isinstance(first, KVState):
                ref = next((st for st in states if st.length), None)
                if ref is None:  # no row has a token yet
                    layers.append(KVState(codec=first.codec))
                    continue
                ks, vs = [], []
                for st, c, n in zip(states, caches, rows, strict=True):
                    kp, vp = st.padded_left(S - c.seen_tokens) if st.length else ref.zeros(n, S)
                    ks.append(kp)
                    vs.append(vp)
                k_parts = tuple(torch.cat(ps) for ps in zip(*ks, strict=True))
                v_parts = tuple(torch.cat(ps) for ps in zip(*vs, strict=True))
                layers.append(ref.like(k_parts, v_parts))
            elif isinstance(first, MambaState):
                layers.append(MambaState.cat(list(states)))
            else:
                layers.append(None)
        masks, positions = [], []
        for c, n in zip(caches, rows, strict=True):
            if c.seen_tokens:
                masks.append(F.pad(c._full_mask(), (S - c.seen_tokens, 0), value=False))
                positions.append(c._full_positions())
            else:
                masks.append(torch.zeros(n, S, dtype=torch.bool, device=device))
                positions.append(torch.zeros(n, dtype=torch.long, device=device))
        out = cls(layers, S)
        out.key_mask_BS = torch.cat(masks)
        out.positions_B = torch.cat(positions)
        return out

    def trim(self) -> None:
        """Drop leading columns that are padding in every row."""
        if self.key_mask_BS is None:
            return
        any_valid = self.key_mask_BS.any(0)
        n = int(any_valid.long().argmax()) if bool(any_valid.any()) else self.seen_tokens
        if n:
            for st in self.layers:
                if isinstance(st, KVState):
                    st.drop_left(n)
            self.key_mask_BS = self.key_mask_BS[:, n:]
            self.seen_tokens -= n
        if bool(self.key_mask_BS.all()) and bool((self.positions_B == self.seen_tokens).all()):
            self.key_mask_BS, self.positions_B = None, None  # back on the unpadded fast path

    def prefix_view(self) -> HybridCache:
        """A copy that shares storage: KV views of the valid columns and the (immutable) Mamba
        state tensors. Later appends to this cache do not reach the copy, and vice versa once the
        copy is `fork()`ed. Used to keep a prefix checkpoint without copying."""
        layers: list[KVState | MambaState | None] = []
        for st in self.layers:
            if isinstance(st, KVState):
                layers.append(st.view())
            elif isinstance(st, MambaState):
                layers.append(st._like(st.conv_BSX, st._ssm, st.steps))
            else:
                layers.append(None)
        out = HybridCache(layers, self.seen_tokens)
        out.key_mask_BS, out.positions_B = self.key_mask_BS, self.positions_B
        return out

    def fork(self) -> HybridCache:
        """An independent cache continuing from this one (KV copied, Mamba states shared until
        replaced)."""
        out = self.prefix_view()
        for i, st in enumerate(out.layers):
            if isinstance(st, KVState) and st._k is not None:
                out.layers[i] = st.copy()
        return out

    def nbytes(self) -> int:
        """Bytes of valid cache content: KV, conv states and stored SSM states."""
        total = 0
        for st in self.layers:
            if isinstance(st, KVState):
                total += st.nbytes()
            elif isinstance(st, MambaState):
                conv = st.conv_BSX
                total += 0 if conv is None else conv.numel() * conv.element_size()
                total += st.ssm_nbytes()
        return total

    @classmethod
    def for_pattern(
        cls,
        pattern: str,
        *,
        ssm_precision: str = "fp32",
        seed: int = 0,
        kv_codecs: dict[int, tuple[KVCodec, KVCodec]] | None = None,
    ) -> HybridCache:
        """One state per block; `ssm_precision` is one of `state_precision.SSM_PRECISIONS`;
        `kv_codecs`: block index -> (keys, values) codecs of its KV cache (default: stored as
        given; `precision.kv_cache` makes quantised ones)."""
        check_precision(ssm_precision)
        kv_codecs = kv_codecs or {}
        unknown = sorted(set(kv_codecs) - {i for i, c in enumerate(pattern) if c == "*"})
        if unknown:
            raise ValueError(f"kv_codecs name blocks {unknown} that are not attention layers")

        def make(i: int, letter: str) -> KVState | MambaState | None:
            if letter == "*":
                return KVState(codec=kv_codecs.get(i))
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
        return self.seen_tokens, saved, self.key_mask_BS, self.positions_B

    def restore(self, snap: tuple) -> None:
        """Return to a `snapshot()` taken earlier on this cache (later tokens are forgotten)."""
        self.seen_tokens, saved, self.key_mask_BS, self.positions_B = snap
        for st, s in zip(self.layers, saved, strict=True):
            if isinstance(st, KVState):
                st.truncate(s)
            elif st is not None:
                st.restore(s)

    def record_history(self, on: bool = True) -> None:
        """Make Mamba layers keep their state after every position of the following calls
        (speculative verification), so `rewind` can drop the tail of the last call."""
        for st in self.layers:
            if isinstance(st, MambaState):
                st.record_history = on
                if on:
                    st._history = None

    def rewind(self, drop: int) -> None:
        """Forget the last `drop` positions of the last call (made with `record_history`): KV
        truncated, Mamba conv and SSM states set to those after the last kept position."""
        if drop <= 0:
            return
        if self.key_mask_BS is not None:
            raise ValueError("rewind applies to unpadded caches")
        for st in self.layers:
            if isinstance(st, KVState):
                st.truncate(st.length - drop)
            elif isinstance(st, MambaState):
                st.rewind(st._history[1].shape[1] - drop)
            if isinstance(st, MambaState):
                st._history = None
        self.seen_tokens -= drop

    def rewind_rows(self, keep_B: torch.Tensor, length: int) -> None:
        """Keep the first keep_B[b] (>= 1) of the `length` positions the last call fed every
        row (made with `record_history`): Mamba states are set to those after each row's last
        kept position; the attention columns a row drops become padding in `key_mask_BS`
        (columns no row keeps are truncated), and `positions_B` advances by keep_B. Used when
        the rows of one forward verified different numbers of speculative drafts."""
        L = length
        device = self._device()
        keep_B = keep_B.to(device=device, dtype=torch.long)
        if keep_B.shape != (self.batch_size(),) or not bool(((keep_B >= 1) & (keep_B <= L)).all()):
            raise ValueError(f"keep one count in 1..{L} per row, got {keep_B.tolist()}")
        if not self.padded and bool((keep_B == keep_B[0]).all()):
            self.rewind(L - int(keep_B[0]))  # the same for every row: no padding needed
            return
        base_B = self._full_positions() - L  # positions before the call
        mask_BS = self._full_mask().clone()
        for st in self.layers:
            if isinstance(st, MambaState):
                st.rewind(keep_B)
        drop = L - int(keep_B.max())  # trailing columns no row keeps
        cols_L = torch.arange(L, device=device)
        mask_BS[:, self.seen_tokens - L :] &= cols_L[None] < keep_B[:, None]
        if drop:
            for st in self.layers:
                if isinstance(st, KVState):
                    st.truncate(st.length - drop)
            mask_BS = mask_BS[:, : self.seen_tokens - drop]
            self.seen_tokens -= drop
        self.key_mask_BS = mask_BS
        self.positions_B = base_B + keep_B
        self.trim()

    def compact(self) -> None:
        """Move every row's valid attention columns together, right-aligned (as `cat` lays
        rows out), dropping the padding between them; positions are unchanged (RoPE is
        applied before caching). Needed after `rewind_rows` left holes: for sliding windows,
        which count columns, and to bound the columns a step attends over."""
        if self.key_mask_BS is None:
            return
        mask_BS = self.key_mask_BS
        n_B = mask_BS.sum(1)
        S = int(n_B.max())
        cols = torch.arange(mask_BS.shape[1], device=mask_BS.device)
        if bool((mask_BS == (cols[None] >= mask_BS.shape[1] - n_B[:, None])).all()):
            self.trim()  # already right-aligned: at most leading padding to drop
            return
        # each row's valid column indices, right-aligned in S slots (the left slots repeat a
        # column but are masked)
        rank_BS = mask_BS.long().cumsum(1) - 1 + (S - n_B)[:, None]  # target slot of each column
        src_BS = torch.zeros(mask_BS.shape[0], S, dtype=torch.long, device=mask_BS.device)
        b_idx, s_idx = mask_BS.nonzero(as_tuple=True)
        src_BS[b_idx, rank_BS[b_idx, s_idx]] = s_idx
        new_mask = torch.arange(S, device=mask_BS.device)[None] >= (S - n_B)[:, None]
        for st in self.layers:
            if isinstance(st, KVState) and st._k is not None:
                st.gather_columns(src_BS)
        self.key_mask_BS = new_mask
        self.seen_tokens = S
        self.trim()

    def truncate(self, length: int) -> None:
        """Forget the columns from `length` on; only attention-only caches can (Mamba states
        cannot be rewound without a snapshot). In a padded batch every row must have had a token
        in each dropped column (e.g. the draft positions of a batch of MTP caches): each row's
        next position goes back by the columns dropped."""
        if any(isinstance(st, MambaState) for st in self.layers):
            raise ValueError("a cache with Mamba states rewinds through snapshot()/restore()")
        if not 0 <= length <= self.seen_tokens:
            raise ValueError(f"cannot truncate a cache of {self.seen_tokens} columns to {length}")
        drop = self.seen_tokens - length
        for st in self.layers:
            if isinstance(st, KVState):
                st.truncate(st.length - drop)
        self.seen_tokens = length
        if self.key_mask_BS is not None and drop:
            self.key_mask_BS = self.key_mask_BS[:, :length]
            self.positions_B = self.positions_B - drop
            self.trim()
