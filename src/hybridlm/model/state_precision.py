"""Storage precisions for the Mamba SSM state cache (Nemotron 3 Super §4.3).

Shape legend: B batch, H heads, P head dim, N state size, K = N / block blocks per row.

The recurrence is always computed in fp32; between decode steps the state is *stored* in one of

    fp32         exact (the default)
    fp16         round-to-nearest-even. Increments below half an fp16 ulp of the state are lost
                 at every step, so slowly decaying states drift with a bias
    fp16-sr      stochastic rounding: round up with probability (x - lo) / (hi - lo) between the
                 two neighbouring fp16 values, so the stored state is unbiased, E[q(x)] = x.
                 The uniforms come from a counter-based stream keyed by (seed, layer, step):
                 reproducible for a seed and independent of what else the process draws
    int16-block  int16 codes with one fp32 scale (amax / 32767) per `block` = 128 elements along
                 the state dimension N (the whole row when N is not a multiple of 128)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..choices import SSM_PRECISIONS

Tensor = torch.Tensor
INT16_BLOCK = 128
_INT16_MAX = 32767.0


def check_precision(precision: str) -> str:
    if precision not in SSM_PRECISIONS:
        raise ValueError(
            f"unknown SSM state precision {precision!r}; choose one of {SSM_PRECISIONS}"
        )
    return precision


def counter_uniform(shape: torch.Size, seed: int, layer: int, step: int, device) -> Tensor:
    """U[0, 1) noise for one (seed, layer, step) key: a generator seeded by a 64-bit mix of the
    key (SplitMix64 finaliser), so each step's stream is fixed by the key alone."""
    key = (
        seed * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB
    ) % 2**64
    key ^= key >> 31
    key = (key * 0xBF58476D1CE4E5B9) % 2**64
    key ^= key >> 27
    gen = torch.Generator(device=device).manual_seed(key % 2**63)
    return torch.rand(shape, generator=gen, device=device)


def fp16_stochastic_round(x: Tensor, u: Tensor) -> Tensor:
    """Round fp32 `x` to fp16, up with probability equal to the distance from the value below."""
    near = x.to(torch.float16)
    near32 = near.float()
    toward = torch.where(
        near32 > x, torch.full_like(near, float("-inf")), torch.full_like(near, float("inf"))
    )
    other = torch.nextafter(near, toward)  # the fp16 neighbour on x's other side
    lo = torch.where(near32 > x, other, near)
    hi = torch.where(near32 > x, near, other)
    lo32, hi32 = lo.float(), hi.float()
    gap = hi32 - lo32
    p_up = torch.where(gap > 0, (x - lo32) / gap, torch.zeros_like(x))
    out = torch.where(u < p_up, hi, lo)
    return torch.where(near32 == x, near, out)  # exactly representable: no noise


@dataclass
class StoredState:
    """An SSM state tensor held in a storage precision; `load()` returns fp32."""

    precision: str
    data: Tensor
    scale: Tensor | None = None
    shape: torch.Size | None = None

    @classmethod
    def store(
        cls, x_BHPN: Tensor, precision: str, *, seed: int = 0, layer: int = 0, step: int = 0
    ) -> StoredState:
        if precision == "fp32":  # exact: fp32, or fp64 for fp64 models
            return cls(precision, x_BHPN.to(torch.promote_types(x_BHPN.dtype, torch.float32)))
        x = x_BHPN.float()
        if precision == "fp16":
            return cls(precision, x.to(torch.float16))
        if precision == "fp16-sr":
            u = counter_uniform(x.shape, seed, layer, step, x.device)
            return cls(precision, fp16_stochastic_round(x, u))
        if precision == "int16-block":
            N = x.shape[-1]
            block = INT16_BLOCK if N % INT16_BLOCK == 0 else N
            blocks = x.reshape(*x.shape[:-1], N // block, block)
            scale = (blocks.abs().amax(-1, keepdim=True) / _INT16_MAX).clamp(min=1e-30)
            codes = torch.round(blocks / scale).clamp(-_INT16_MAX, _INT16_MAX).to(torch.int16)
            return cls(precision, codes, scale, x.shape)
        raise ValueError(check_precision(precision))

    def load(self) -> Tensor:
        if self.precision == "int16-block":
            return (self.data.float() * self.scale).reshape(self.shape)
        return self.data if self.precision == "fp32" else self.data.float()

    def select(self, rows: Tensor) -> StoredState:
        """The stored state of some batch rows (dim 0), without re-rounding."""
        scale = None if self.scale is None else self.scale[rows]
        shape = None if self.shape is None else torch.Size([len(rows), *self.shape[1:]])
        return StoredState(self.precision, self.data[rows], scale, shape)

    @staticmethod
    def cat(states: list[StoredState]) -> StoredState:
        first = states[0]
        if any(st.precision != first.precision for st in states):
            raise ValueError("cannot batch SSM states stored in different precisions")
        data = torch.cat([st.data for st in states])
        scale = None if first.scale is None else torch.cat([st.scale for st in states])
        shape = None if first.shape is None else torch.Size([data.shape[0], *first.shape[1:]])
        return StoredState(first.precision, data, scale, shape)

    def nbytes(self) -> int:
        extra = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.data.numel() * self.data.element_size() + extra
