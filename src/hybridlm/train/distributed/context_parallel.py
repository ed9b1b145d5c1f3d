"""Context parallelism: each sequence split into `cp` contiguous shards, one per rank, for
sequences no single device holds (Olmo 3 extends context with CP 8; Nemotron 3 Super trains to
1M tokens). Applied from outside (DESIGN habit 4), as `fully_shard` is: `apply_context_parallel`
turns the model and its mixers into context-parallel subclasses of their own classes, which
override the few methods through which a forward sees the rows beyond its own tokens (on one
device those rows are whole: `HybridLM._block_context` and `_tokens_ahead`,
`Attention._keys_values`, `Mamba2Mixer._conv_rows` and `_add_entering_state`,
`MoE._whole_row_counts`). The overrides call the exchanges of `ContextParallel`; the math stays
the mixers'. Rank r of the group holds positions [r * Ls, (r + 1) * Ls) of every row.

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
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ...model.attention import Attention
from ...model.mamba2 import Mamba2Mixer
from ...model.model import HybridLM, shift_left
from ...model.moe import MoE
from ...ops.conv1d import causal_conv1d, causal_conv1d_docs


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
        L = ids_BL.shape[1]
        shifted = shift_left(self.gather_seq(ids_BL, dim=1), k, fill)
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


class _Sharded:
    """What the context-parallel subclasses share: the group they exchange over."""

    _cp: ContextParallel


class _ShardedHybridLM(_Sharded, HybridLM):
    """A HybridLM whose forward takes one shard of every row (training rows only)."""

    def _block_context(self, input_ids, doc_ids, attention_mask, cache):
        if cache is not None or attention_mask is not None:
            raise ValueError("context parallelism shards training rows: no cache or attention_mask")
        cp, L = self._cp, input_ids.shape[1]
        if doc_ids is None:  # this shard's global positions
            return {
                "positions_L": torch.arange(cp.offset(L), cp.offset(L) + L, device=input_ids.device)
            }
        local = self._check_doc_ids(input_ids, doc_ids, attention_mask, cache)
        return self._document_context(local, cp.gather_seq(local, dim=1), cp.offset(L))

    def _tokens_ahead(self, input_ids, k):
        return self._cp.shift_left(input_ids, k, 0)


class _ShardedAttention(_Sharded, Attention):
    """Attention of one shard's queries over the keys and values of the whole rows."""

    def _keys_values(self, k_BKLE, v_BKLE):
        cp = self._cp
        offset = cp.offset(k_BKLE.shape[2])
        return cp.gather_seq(k_BKLE, dim=2), cp.gather_seq(v_BKLE, dim=2), offset


class _ShardedMamba2(_Sharded, Mamba2Mixer):
    """Mamba-2 of one shard: conv taps and the SSD state enter from the previous shards."""

    def _conv_rows(self, xbc_BLX, doc_ids_BL):
        return F.silu(self._conv_across_shards(xbc_BLX, doc_ids_BL))

    def _conv_across_shards(
        self, xbc_BLX: torch.Tensor, doc_ids_BL: torch.Tensor | None
    ) -> torch.Tensor:
        """The causal conv of one sequence shard: its first taps read the previous shard's last
        conv_kernel - 1 inputs (zeros before the first shard; masked across documents)."""
        cp, S, L = self._cp, self.m.conv_kernel - 1, xbc_BLX.shape[1]
        if L < S:
            raise ValueError(f"a context-parallel shard of {L} tokens is shorter than the conv")
        w, b = self.conv1d.weight[:, 0], self.conv1d.bias
        halo_BSX = cp.previous(xbc_BLX[:, L - S :])
        if doc_ids_BL is None:
            return causal_conv1d(xbc_BLX, w, b, halo_BSX)[0]
        prev_doc_BS = cp.previous(doc_ids_BL[:, L - S :], fill=-1)
        x_ext = torch.cat([halo_BSX, xbc_BLX], dim=1)
        doc_ext = torch.cat([prev_doc_BS, doc_ids_BL], dim=1)
        return causal_conv1d_docs(x_ext, w, b, doc_ext)[:, S:]

    def _add_entering_state(
        self,
        y_BLHP: torch.Tensor,
        dA_BLH: torch.Tensor,
        C_BLGN: torch.Tensor,
        final_BHPN: torch.Tensor,
        doc_ids_BL: torch.Tensor | None,
    ) -> torch.Tensor:
        """`y_BLHP` plus the output of the state entering this shard: the shard was scanned
        from a zero state, ending in `final_BHPN`; an exclusive scan over the shards gives the
        entering state h, which reaches position t as exp(cumsum(dt*A)_t) C_t h (the
        inter-chunk term of SSD, Mamba-2 §7), within the document running at the shard start."""
        cp = self._cp
        acum_BLH = dA_BLH.cumsum(1)
        Bsz, L, H = acum_BLH.shape
        ones_B = torch.ones(Bsz, dtype=torch.bool, device=acum_BLH.device)
        reach_BL, carry_B, whole_B = None, ones_B, ones_B
        if doc_ids_BL is not None:
            first_B1 = doc_ids_BL[:, :1]
            reach_BL = doc_ids_BL == first_B1  # still the document the shard starts in
            carry_B = (cp.previous(doc_ids_BL[:, L - 1 :], fill=-1) == first_B1)[:, 0]
            whole_B = doc_ids_BL[:, -1] == doc_ids_BL[:, 0]  # no document starts inside
        decay_BH = acum_BLH[:, -1].exp() * whole_B[:, None]
        h_BHPN = cp.scan_states(decay_BH, final_BHPN, carry_B)
        C_BLHN = C_BLGN.to(h_BHPN.dtype).repeat_interleave(H // C_BLGN.shape[2], dim=2)
        gain_BLH = acum_BLH.exp()
        if reach_BL is not None:
            gain_BLH = gain_BLH * reach_BL[..., None]
        return y_BLHP + torch.einsum("blhn,bhpn->blhp", C_BLHN, h_BHPN) * gain_BLH[..., None]


class _ShardedMoE(_Sharded, MoE):
    """MoE whose balancing loss counts the routing of the whole rows."""

    def _whole_row_counts(self, count_BE, L):
        return self._cp.sum(count_BE), L * self._cp.size


_SHARDED: dict[type, type] = {
    HybridLM: _ShardedHybridLM,
    Attention: _ShardedAttention,
    Mamba2Mixer: _ShardedMamba2,
    MoE: _ShardedMoE,
}


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> ContextParallel:
    """Make `model` (a HybridLM) context-parallel over `cp_mesh`: its forwards then take this
    rank's shard of every row (module docstring). The modules keep their parameters, buffers
    and state-dict keys; only their class changes, to the sharded subclass."""
    cp = ContextParallel(cp_mesh)
    for module in model.modules():
        sharded = _SHARDED.get(type(module))
        if sharded is None and isinstance(module, tuple(_SHARDED)):
            raise TypeError(
                f"context parallelism does not know {type(module).__name__}, a subclass of a "
                "model class; apply it before converting the model"
            )
        if sharded is not None:
            module.__class__ = sharded
            module._cp = cp
    return cp


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    """The context-parallel group `model` was made parallel over, if any."""
    return model._cp if isinstance(model, _Sharded) else None
