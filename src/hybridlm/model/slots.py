"""Static-shape inference state for captured decode steps (CUDA graphs, `infer.graphs`).

Shape legend: R rows (slots), S columns (positions), b / s the rows and columns of one call's
bucket, L tokens per row in the call, K kv heads, E head dim, X conv channels, H heads,
P head dim, N state size.

A `HybridCache` grows, concatenates and trims its tensors; a captured graph needs every tensor
it touches to stay where it is. A `SlotCache` allocates everything once: per attention layer
key / value buffers of [R, K, S, ...] in the KV codec's storage parts, per Mamba layer a conv
buffer [R, S_conv, X] and the SSM state in its storage precision. Each row is *left-aligned*:
its tokens sit in columns 0 .. n - 1 with no padding, so its next position is its length
`length_R[row]`, a device tensor. A call of L tokens per row writes columns length .. length + L
- 1 of each row through tensor indices, attends over columns 0 .. s - 1 of the bucket with a
mask built from the lengths (causal, and the sliding window where a layer has one), updates
the Mamba states in place, and advances the lengths of the active rows, all without a host
sync. Rows join by copying a prefilled `HybridCache` row in (`put`) and leave by moving the
rows above down (`keep`); speculative verification rewinds each row on the device (`rewind`).
The host keeps a mirror of the lengths (`host_len`) to choose the column bucket.

The arithmetic is the dynamic cache's (same mixers, same step functions), so a decode step
through a `SlotCache` equals one through a `HybridCache` (tests: `tests/test_slots.py`).
"""

from __future__ import annotations

import torch

from .cache import AS_GIVEN, HybridCache, KVCodec, KVState, MambaState, Parts
from .state_precision import StoredState, check_precision

# fp16-sr draws its noise from a generator seeded per (seed, layer, step) on the host: a step
# counter a captured graph cannot advance
STATIC_SSM_PRECISIONS = ("fp32", "fp16", "int16-block")
MAX_VERIFY = 17  # positions a verification feeds a row: 1 + at most 16 drafts


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 codes as their bytes: indexing kernels cover uint8 on every device."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


class SlotKV:
    """Keys and values of one attention layer in [R, K, S, ...] buffers (see the module)."""

    def __init__(
        self,
        slots: SlotCache,
        codec: tuple[KVCodec, KVCodec],
        probe_BKLE: torch.Tensor,
    ) -> None:
        self.slots = slots
        self.codec = codec
        self.dtype = probe_BKLE.dtype

        def buffers(c: KVCodec) -> Parts:
            return tuple(
                p.new_zeros(slots.rows, p.shape[1], slots.columns, *p.shape[3:])
                for p in c.encode(probe_BKLE)
            )

        self._k, self._v = buffers(codec[0]), buffers(codec[1])

    def update(
        self, k_BKLE: torch.Tensor, v_BKLE: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this call's keys and values at each row's next columns; return the keys and
        values of the bucket's columns (decoded from the storage parts)."""
        sl = self.slots
        rows_BL, cols_BL = sl.rows_BL, sl.positions_BL
        for bufs, parts in ((self._k, self.codec[0].encode(k_BKLE)),
                            (self._v, self.codec[1].encode(v_BKLE))):  # fmt: skip
            for buf, part in zip(bufs, parts, strict=True):
                _bytes(buf)[rows_BL, :, cols_BL] = _bytes(part).transpose(1, 2)
        b, s = sl.bucket
        k = self.codec[0].decode(tuple(p[:b, :, :s] for p in self._k), self.dtype)
        v = self.codec[1].decode(tuple(p[:b, :, :s] for p in self._v), self.dtype)
        return k, v

    def window_mask(self, window: int) -> torch.Tensor:
        """[b, 1, L, s]: key column within `window` positions of each query (columns are
        positions: rows are unpadded)."""
        sl = self.slots
        cols = sl.columns_S[: sl.bucket[1]]
        return (sl.positions_BL[:, :, None] - cols[None, None]) < window

    def put(self, row: int, state: KVState, src: int, cols: torch.Tensor) -> None:
        kv = state.parts()
        if kv is None:
            return
        n = cols.numel()
        for bufs, parts in ((self._k, kv[0]), (self._v, kv[1])):
            for buf, part in zip(bufs, parts, strict=True):
                _bytes(buf)[row, :, :n] = _bytes(part)[src][:, cols]

    def move(self, dst: int, src: int, n: int) -> None:
        for buf in self._k + self._v:
            buf[dst, :, :n] = buf[src, :, :n]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._k + self._v)


class SlotMamba(MambaState):
    """Conv and SSM state of one Mamba layer in [R, ...] buffers: reading gives the bucket's
    rows, assigning copies into them (the mixers assign new states each call)."""

    def __init__(
        self, slots: SlotCache, precision: str, conv_SX: torch.Tensor, ssm_HPN: torch.Tensor
    ) -> None:
        self.slots = slots
        self._conv = conv_SX.new_zeros(slots.rows, *conv_SX.shape)
        probe = StoredState.store(ssm_HPN[None], precision)
        self._data = probe.data.new_zeros(slots.rows, *probe.data.shape[1:])
        scale = probe.scale
        self._scale = None if scale is None else scale.new_zeros(slots.rows, *scale.shape[1:])
        self._ssm_shape = ssm_HPN.shape
        self._hist: tuple[torch.Tensor, ...] | None = None  # see `set_history`
        super().__init__(precision)

    @property
    def conv_BSX(self) -> torch.Tensor:
        return self._conv[: self.slots.bucket[0]]

    @conv_BSX.setter
    def conv_BSX(self, value: torch.Tensor | None) -> None:
        if value is not None:
            self._conv[: value.shape[0]].copy_(value)

    @property
    def ssm_BHPN(self) -> torch.Tensor:
        b = self.slots.bucket[0]
        scale = None if self._scale is None else self._scale[:b]
        shape = torch.Size([b, *self._ssm_shape])
        return StoredState(self.precision, self._data[:b], scale, shape).load()

    @ssm_BHPN.setter
    def ssm_BHPN(self, value: torch.Tensor | None) -> None:
        if value is None:
            return
        st = StoredState.store(value, self.precision)
        self._data[: value.shape[0]].copy_(st.data)
        if self._scale is not None:
            self._scale[: value.shape[0]].copy_(st.scale)

    def set_history(
        self, conv_in_BSX: torch.Tensor | None, xbc_BLX: torch.Tensor, ssm_BLHPN: torch.Tensor
    ) -> None:
        """Copies into history buffers allocated once ([R, MAX_VERIFY, ...], on the first
        verification: every captured verification writes the same memory, and the conv input,
        a view of the buffer the call overwrites, is kept as it was)."""
        b, L = xbc_BLX.shape[:2]
        if L > MAX_VERIFY:
            raise ValueError(f"a SlotCache verifies at most {MAX_VERIFY} positions, got {L}")
        if self._hist is None:
            R = self.slots.rows
            self._hist = (
                self._conv.new_zeros(self._conv.shape),
                xbc_BLX.new_zeros(R, MAX_VERIFY, xbc_BLX.shape[2]),
                ssm_BLHPN.new_zeros(R, MAX_VERIFY, *ssm_BLHPN.shape[2:]),
            )
        conv, xbc, ssm = self._hist
        conv[:b].copy_(conv_in_BSX)
        xbc[:b, :L].copy_(xbc_BLX)
        ssm[:b, :L].copy_(ssm_BLHPN)

    def rewind(self, keep: int | torch.Tensor, length: int) -> None:
        """Per-row rewind on the device after a verification of `length` positions (no check,
        no host sync: the caller's counts)."""
        b = self.slots.bucket[0]
        keep_B = torch.as_tensor(keep, device=self._conv.device).long().expand(b)
        conv, xbc, ssm = self._hist
        self._history = (conv[:b], xbc[:b, :length], ssm[:b, :length])
        self.conv_BSX, self.ssm_BHPN = self._rewound(keep_B)
        self._history = None

    def put(self, row: int, state: MambaState, src: int) -> None:
        if state._ssm is None or state.conv_BSX is None:
            raise ValueError("only Mamba states that have seen tokens can join a SlotCache")
        if state.precision != self.precision:
            raise ValueError(
                f"a {state.precision} SSM state cannot join a {self.precision} SlotCache"
            )
        self._conv[row].copy_(state.conv_BSX[src])
        self._data[row].copy_(state._ssm.data[src])
        if self._scale is not None:
            self._scale[row].copy_(state._ssm.scale[src])

    def move(self, dst: int, src: int, n: int) -> None:
        for buf in (self._conv, self._data, self._scale):
            if buf is not None:
                buf[dst] = buf[src]

    def nbytes(self) -> int:
        bufs = [self._conv, self._data] + ([self._scale] if self._scale is not None else [])
        return sum(p.numel() * p.element_size() for p in bufs)


class SlotCache:
    """One `SlotKV` / `SlotMamba` per block (None for stateless blocks) over `rows` slots of
    `columns` positions, for `model` (its dtype and device); `kv_codecs` and `ssm_precision` as
    in `HybridCache.for_pattern`; `pattern`: the blocks' letters (default the model's; the MTP
    module's for a drafter's cache)."""

    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        columns: int,
        *,
        ssm_precision: str = "fp32",
        kv_codecs: dict[int, tuple[KVCodec, KVCodec]] | None = None,
        pattern: str | None = None,
    ) -> None:
        if check_precision(ssm_precision) not in STATIC_SSM_PRECISIONS:
            raise ValueError(
                f"a SlotCache stores SSM states in {list(STATIC_SSM_PRECISIONS)}; "
                f"{ssm_precision} draws its rounding noise per step on the host"
            )
        if rows < 1 or columns < 1:
            raise ValueError(f"a SlotCache needs rows and columns >= 1, got {rows}, {columns}")
        cfg = model.config
        w = model.embeddings.weight
        self.rows, self.columns = rows, columns
        self.device, self.dtype = w.device, w.dtype
        kv_codecs = kv_codecs or {}
        self.layers: list[SlotKV | SlotMamba | None] = []
        for i, letter in enumerate(cfg.pattern if pattern is None else pattern):
            if letter == "*":
                a = cfg.attention
                probe = w.new_zeros(1, a.num_kv_heads, 1, a.head_dim)
                self.layers.append(SlotKV(self, kv_codecs.get(i) or (AS_GIVEN, AS_GIVEN), probe))
            elif letter == "M":
                m = cfg.mamba
                conv = w.new_zeros(m.conv_kernel - 1, m.conv_dim)
                ct = torch.promote_types(w.dtype, torch.float32)  # as the mixer computes
                ssm = torch.zeros(m.num_heads, m.head_dim, m.state_size, dtype=ct, device=w.device)
                self.layers.append(SlotMamba(self, ssm_precision, conv, ssm))
            else:
                self.layers.append(None)
        self.length_R = torch.zeros(rows, dtype=torch.long, device=w.device)
        self.active_R = torch.zeros(rows, dtype=torch.long, device=w.device)  # 1: a request
        self.host_len = [0] * rows  # the host's copy of length_R
        self.columns_S = torch.arange(columns, device=w.device)
        self.bucket = (rows, columns)  # rows and columns the next call covers
        self.rows_BL = self.positions_BL = torch.zeros(0, dtype=torch.long, device=w.device)

    @staticmethod
    def planned_nbytes(
        model: torch.nn.Module, rows: int, columns: int, *, verify: bool = False
    ) -> int:
        """Bytes a SlotCache of `rows` x `columns` takes for `model`, keys and values stored in
        the model's dtype and SSM states in fp32 (a bound for quantised storage); `verify`:
        with the per-position states of speculative verification (`SlotMamba.set_history`)."""
        cfg = model.config
        size = model.embeddings.weight.element_size()
        total = 0
        if "*" in cfg.pattern:
            a = cfg.attention
            total += cfg.pattern.count("*") * 2 * rows * a.num_kv_heads * columns * a.head_dim
            total *= size
        if "M" in cfg.pattern:
            m = cfg.mamba
            conv = (m.conv_kernel - 1) * m.conv_dim * size
            ssm = m.num_heads * m.head_dim * m.state_size * max(size, 4)  # fp32 at least
            hist = conv + MAX_VERIFY * (ssm + m.conv_dim * size) if verify else 0
            total += cfg.pattern.count("M") * rows * (conv + ssm + hist)
        return total

    # ------------------------------------------------------------------ a call
    def context(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keyword context of every block for `input_ids` [b, L] (the bucket's rows): each row's
        positions (its length on), and the causal mask over the bucket's columns."""
        b, s = self.bucket
        Bsz, L = input_ids.shape
        if Bsz != b:
            raise ValueError(f"the bucket has {b} rows, the call {Bsz}")
        steps_L = torch.arange(L, device=self.device)
        self.positions_BL = self.length_R[:b, None] + steps_L
        self.rows_BL = torch.arange(b, device=self.device)[:, None].expand(b, L)
        cols = self.columns_S[:s]
        return {
            "positions_L": steps_L,
            "positions_BL": self.positions_BL,
            "attn_mask_B1LS": (cols[None, None] <= self.positions_BL[:, :, None])[:, None],
        }

    def advance(self, L: int | torch.Tensor) -> None:
        """After a call of L tokens per row: the active rows' lengths grow by L (or by L[row],
        a tensor over the bucket's rows, for rows whose call was right-padded)."""
        b = self.bucket[0]
        self.length_R[:b] += L * self.active_R[:b]

    def record_history(self, on: bool = True) -> None:
        for st in self.layers:
            if isinstance(st, SlotMamba):
                st.record_history = on

    def rewind(self, keep_B: torch.Tensor, length: int) -> None:
        """After a call of `length` tokens per row recorded with `record_history`: keep the
        first keep_B[row] of them (device tensor over the bucket's rows; >= 1)."""
        b = self.bucket[0]
        for st in self.layers:
            if isinstance(st, SlotMamba):
                st.rewind(keep_B, length)
        self.length_R[:b] += (keep_B - length) * self.active_R[:b]

    # ------------------------------------------------------------------ rows
    def put(self, row: int, cache: HybridCache, src: int = 0) -> None:
        """Copy row `src` of a prefilled `HybridCache` (padded or not) into slot `row`."""
        if not 0 <= row < self.rows:
            raise ValueError(f"slot {row} is outside 0..{self.rows - 1}")
        self.active_R[row] = 1
        if not cache.seen_tokens and not cache.padded:  # nothing cached yet (attention only)
            if any(isinstance(st, SlotMamba) for st in self.layers):
                raise ValueError("only Mamba states that have seen tokens can join a SlotCache")
            self.length_R[row], self.host_len[row] = 0, 0
            return
        cols = cache._full_mask()[src].nonzero()[:, 0]
        n = cols.numel()
        if n + 1 > self.columns:
            raise ValueError(f"a row of {n} tokens does not fit {self.columns} columns")
        if int(cache._full_positions()[src]) != n:
            raise ValueError("the row's position is not its number of cached tokens")
        for mine, theirs in zip(self.layers, cache.layers, strict=True):
            if isinstance(mine, SlotKV):
                mine.put(row, theirs, src, cols)
            elif isinstance(mine, SlotMamba):
                mine.put(row, theirs, src)
        self.length_R[row] = n
        self.host_len[row] = n

    def keep(self, rows: list[int]) -> None:
        """Keep the slots `rows` (ascending), moved down to 0 .. len(rows) - 1; the others are
        freed."""
        for dst, src in enumerate(rows):
            if dst != src:
                n = self.host_len[src]
                for st in self.layers:
                    if st is not None:
                        st.move(dst, src, n)
                self.length_R[dst] = self.length_R[src]
                self.active_R[dst] = self.active_R[src]
                self.host_len[dst] = n
        free = slice(len(rows), self.rows)
        self.length_R[free] = 0
        self.active_R[free] = 0
        self.host_len[free] = [0] * (self.rows - len(rows))

    def nbytes(self) -> int:
        """Bytes of the buffers."""
        return sum(st.nbytes() for st in self.layers if st is not None)
