"""Context parallelism: each sequence split into `cp` contiguous shards, one per rank, for
sequences no single device holds (Olmo 3 extends context with CP 8; Nemotron 3 Super trains to
1M tokens). Applied from outside (DESIGN habit 4): `apply_context_parallel` sets a
`ContextParallel` object as `HybridLM.context_parallel`; the mixers call its few exchange
operations and keep their own math. Rank r of the group holds positions
[r * Ls, (r + 1) * Ls) of every row.

Shape legend: S cp ranks, B rows, Ls shard length, K kv heads, H heads, P head dim, N state size,
X conv channels.

- Attention: every rank all-gathers the keys and values of the whole sequence (after RoPE, which
  uses global positions) and attends its queries with the causal mask at its offset
  (`ops.attention`'s `q_offset`). Exact; K/V memory is that of the whole sequence, the
  [Ls, S*Ls] scores are 1/S of the full ones. (Ring attention would also split K/V; with GQA's
  few KV heads the all-gather is the simpler choice, as in torchtitan's allgather rotate mode.)
- Mamba-2, by passing states (the inter-chunk step of SSD applied across ranks): each rank scans
  its shard from a zero state (`ops.ssd.ssd_chunked`), giving its final state S_r and the decay
  a_r = exp(sum dt*A) of its shard; an exclusive scan over ranks of the (a, S) pairs gives each
  rank the state entering its shard, h_r = a_{r-1} h_{r-1} + S_{r-1}, and the exact correction
  y_t += exp(cumsum(dt*A)_t) C_t h_r is added. The causal conv reads the previous shard's last
  conv_kernel - 1 inputs. Communication per layer is B*H*P*N states per rank, independent of
  the sequence length; Megatron's alternative (a sequence -> heads all-to-all before the scan and
  back after) moves the whole activations twice per layer and needs heads divisible by S.
- Packed documents: the entering state, the conv taps and the attention mask all stop at document
  boundaries across shards exactly as inside one (the state reaches only positions of the
  document running at the shard start, and passes a shard only if no document starts in it).
- Multi-token prediction reads the tokens k positions ahead across the shard boundary.

Every exchange is differentiable: the backward of the all-gather sums each shard's gradient
over the ranks that used it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def _gather(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[S, *x.shape] (the collective fills the pieces concatenated along dim 0)."""
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]) if x.dim() else (size,))
    dist.all_gather_into_tensor(out, x if x.dim() else x[None], group=group)
    return out.view(size, *x.shape)


class _AllGather(torch.autograd.Function):
    """[S, *x.shape]: every rank's `x`; the backward returns the sum over ranks of the
    gradients for this rank's piece."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.rank = group, rank
        return _gather(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class ContextParallel:
    """The exchanges of a context-parallel group (module docstring), as the model's mixers call
    them: `offset`, `gather` (+ along the sequence), `previous`, `scan_states`, `shift_left`,
    `sum`."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()

    def offset(self, shard_len: int) -> int:
        """Global position of this shard's first token."""
        return self.rank * shard_len

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[S, *x.shape]: `x` of every rank (differentiable)."""
        if x.requires_grad:
            return _AllGather.apply(x, self.group, self.size, self.rank)
        return _gather(x, self.group, self.size)

    def gather_seq(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence of `x`, the shards concatenated along `dim`."""
        parts = self.gather(x)
        return torch.cat(parts.unbind(0), dim=dim)

    def previous(self, x: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """The previous rank's `x` (`fill` on the first rank): e.g. the last conv inputs of the
        preceding shard."""
        # the same graph on every rank: each backward runs the same collectives in order
        prev = self.gather(x)[(self.rank - 1) % self.size]
        return prev.masked_fill(torch.tensor(self.rank == 0, device=x.device), fill)

    def scan_states(
        self, decay_BH: torch.Tensor, final_BHPN: torch.Tensor, carry_B: torch.Tensor
    ) -> torch.Tensor:
        """The SSD state entering this rank's shard: h_0 = 0, h_r = carry_r * (decay_{r-1} *
        h_{r-1} + final_{r-1}) with `final` each shard's state from a zero start, `decay` its
        total decay (0 when a document starts inside it) and `carry` whether the document of
        the shard's first token continues from the previous shard."""
        finals = self.gather(final_BHPN)
        decays = self.gather(decay_BH.to(final_BHPN.dtype))
        carries = self.gather(carry_B.to(final_BHPN.dtype))
        # every rank scans all S shards and takes its own: the same graph on every rank, so the
        # backward's collectives match
        h = [finals[0] * decays[0][:, :, None, None] * 0]  # zero, on the graph like the rest
        for j in range(self.size - 1):
            h.append(
                carries[j + 1][:, None, None, None]
                * (decays[j][:, :, None, None] * h[-1] + finals[j])
            )
        return h[self.rank]

    def shift_left(self, ids_BL: torch.Tensor, k: int, fill: int) -> torch.Tensor:
        """This shard of the whole rows shifted left by `k` (`fill` past the end): token t + k
        for position t, across shard boundaries."""
        full = self.gather_seq(ids_BL, dim=1)
        L = ids_BL.shape[1]
        pad = full.new_full((full.shape[0], k), fill)
        shifted = torch.cat([full[:, k:], pad], dim=1)
        return shifted[:, self.offset(L) : self.offset(L) + L]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group (not differentiable; for metrics)."""
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous part of `x` along `dim` (the sequence)."""
        L = x.shape[dim]
        if L % self.size:
            raise ValueError(
                f"a sequence of {L} tokens does not split over {self.size} context-parallel "
                "ranks; make data.seq_len divisible by train.parallel.cp"
            )
        n = L // self.size
        return x.narrow(dim, self.rank * n, n)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> ContextParallel:
    """Install `ContextParallel` over `cp_mesh` on `model` (a HybridLM): its forwards then take
    this rank's shard of every row."""
    cp = ContextParallel(cp_mesh)
    model.context_parallel = cp
    return cp
