"""MoE and LatentMoE with a sigmoid top-k router (Nemotron 3 Super §2.1.1, notes §1.5).

Shape legend: B batch, L sequence, T = B*L tokens, D model width, W routed width (latent size
for LatentMoE, else D), F expert hidden, E experts, K top-k, A = T*K assignments.

Per token x:   s = sigmoid(x W_r) in fp32 at full width; experts = topk(s + bias) where the
correction bias steers *selection only*; gates = chosen s, renormalised, x routed scaling factor;
y = W_up( sum_k g_k * expert_k(W_down x) ) + shared_expert(x), experts W->F->W with relu^2.
Names and semantics match transformers' NemotronHMoE (`gate.e_score_correction_bias`,
`fc1_latent_proj`, `fc2_latent_proj`, 3-D `experts.up_proj` / `experts.down_proj`).
Balancing: the aux-loss-free bias update (`bias += rate * sign(mean_load - load)`, applied by the
trainer after each optimizer step through `HybridLM.update_moe_bias`) plus a sequence-level
load-balancing loss (DeepSeek-V3 §2.1.2 "complementary sequence-wise auxiliary loss") that a
training forward adds to the call's `AuxSink` (`HybridLM.forward` returns their sum in
`out.aux["moe_aux"]`; the loss itself is added in `train/objectives.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LayerSpec, ModelConfig
from ..ops import fused, native
from .mlp import MLP, relu2
from .stock import is_stock, project


class AuxSink:
    """The auxiliary loss terms of one forward call, collected from the layers that make them.
    A plain object, not a list: data-parallel wrappers (FSDP2) rebuild the containers they find
    in a module's keyword arguments, and terms appended to a copy would be lost."""

    def __init__(self) -> None:
        self.terms: list[torch.Tensor] = []

    def add(self, term: torch.Tensor) -> None:
        self.terms.append(term)

    def total(self) -> torch.Tensor | None:
        """The sum of the terms, None when there is none."""
        return torch.stack(self.terms).sum() if self.terms else None


class TopKRouter(nn.Module):
    def __init__(self, d_model: int, cfg_moe) -> None:
        super().__init__()
        self.cfg = cfg_moe
        self.weight = nn.Parameter(torch.empty(cfg_moe.num_experts, d_model, dtype=torch.float32))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(cfg_moe.num_experts, dtype=torch.float32)
        )

    def _apply(self, fn, recurse: bool = True):
        # The router stays fp32 through model.to(bfloat16) / .half(), as transformers keeps
        # `gate.weight` and the correction bias (Nemotron 3 Super: router computed in fp32).
        super()._apply(fn, recurse)
        if self.weight.is_floating_point() and self.weight.dtype != torch.float32:
            self.weight.data = self.weight.data.float()
        if self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (scores_TE, topk_idx_TK, topk_weight_TK); routing is computed in fp32."""
        c = self.cfg
        return sigmoid_topk_route(
            x_TD,
            self.weight,
            self.e_score_correction_bias,
            top_k=c.top_k,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            scaling=c.routed_scaling_factor,
        )


def sigmoid_topk_route(
    x_TD: torch.Tensor,
    weight_ED: torch.Tensor,
    bias_E: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router as a pure function (shared by `TopKRouter` and `moe_decode_step`): sigmoid
    scores in fp32 (fp64 for reference runs); the correction bias steers selection only;
    optional group-limited routing; chosen scores renormalised and scaled. `linear` computes
    the scores (`ops.native.linear` on the decode path)."""
    ct = torch.promote_types(x_TD.dtype, torch.float32)
    if torch.is_autocast_enabled(x_TD.device.type):  # bf16 training: autocast would cast back
        with torch.autocast(x_TD.device.type, enabled=False):
            scores_TE = linear(x_TD.to(ct), weight_ED.to(ct)).sigmoid()
    else:
        scores_TE = linear(x_TD.to(ct), weight_ED.to(ct)).sigmoid()
    choice_TE = scores_TE.detach() + bias_E.to(ct)
    if n_group > 1:  # group-limited routing: keep the topk_group groups with best top-2 sums
        grouped = choice_TE.view(-1, n_group, choice_TE.shape[-1] // n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score).scatter_(
            1, group_score.topk(topk_group, dim=-1).indices, 1.0
        )
        choice_TE = grouped.masked_fill(keep[..., None] == 0, float("-inf")).view_as(choice_TE)
    idx_TK = choice_TE.topk(top_k, dim=-1, sorted=False).indices
    w_TK = scores_TE.gather(1, idx_TK)
    if norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
    return scores_TE, idx_TK, w_TK * scaling


# an expert computation over tokens sorted by expert: (z_AW, counts_E, up_EFW, down_EWF) -> y_AW
ExpertsFn = Callable[[torch.Tensor, list[int], torch.Tensor, torch.Tensor], torch.Tensor]


def _experts_loop(
    z_AW: torch.Tensor, counts: list[int], up_EFW: torch.Tensor, down_EWF: torch.Tensor
) -> torch.Tensor:
    """Reference dispatch: one matmul pair per expert over its contiguous slice of sorted tokens."""
    outs = []
    for e, chunk in enumerate(z_AW.split(counts)):
        if chunk.shape[0]:
            outs.append(F.linear(relu2(F.linear(chunk, up_EFW[e])), down_EWF[e]))
    return torch.cat(outs) if outs else z_AW.new_zeros(0, down_EWF.shape[1])


def _experts_grouped(
    z_AW: torch.Tensor, counts: list[int], up_EFW: torch.Tensor, down_EWF: torch.Tensor
) -> torch.Tensor:
    """Fast path: two grouped GEMMs over the same sorted layout (torch grouped_mm). grouped_mm
    is not on autocast's lists, so the weights are cast to the activations' dtype here, as
    autocast casts them for every other matmul (bf16 training keeps fp32 master weights)."""
    offs = torch.tensor(counts, device=z_AW.device).cumsum(0).to(torch.int32)
    dtype = z_AW.dtype  # also for relu^2's output: autocast runs pow in fp32
    up, down = up_EFW.to(dtype), down_EWF.to(dtype)
    h_AF = relu2(F.grouped_mm(z_AW, up.transpose(1, 2), offs=offs)).to(dtype)
    return F.grouped_mm(h_AF, down.transpose(1, 2), offs=offs)


def _experts_padded(
    z_AW: torch.Tensor, counts: list[int], up_EFW: torch.Tensor, down_EWF: torch.Tensor
) -> torch.Tensor:
    """CPU fast path: scatter the sorted tokens into a zero-padded [E, max_count, W] buffer and run
    two batched matmuls. Padding rows are zeros, stay zero through relu^2 and get no gradient, so
    the result equals the per-expert loop while launching 2 kernels instead of 2 per expert."""
    E = len(counts)
    counts_E = torch.tensor(counts, device=z_AW.device)
    expert_A = torch.repeat_interleave(torch.arange(E, device=z_AW.device), counts_E)
    slot_A = (
        torch.arange(z_AW.shape[0], device=z_AW.device) - (counts_E.cumsum(0) - counts_E)[expert_A]
    )
    buf_ECW = z_AW.new_zeros(E, max(counts), z_AW.shape[1]).index_put((expert_A, slot_A), z_AW)
    h_ECF = relu2(torch.bmm(buf_ECW, up_EFW.transpose(1, 2)))
    return torch.bmm(h_ECF, down_EWF.transpose(1, 2))[expert_A, slot_A]


def experts_gathered(
    z_TW: torch.Tensor,
    idx_TK: torch.Tensor,
    w_TK: torch.Tensor,
    up_EFW: torch.Tensor,
    down_EWF: torch.Tensor,
) -> torch.Tensor:
    """Decode path (few tokens): gather each assignment's expert weights and run two batched
    matrix-vector products, skipping the sort and the E-wide padded buffer. Equals the sorted
    dispatch (`Experts.forward` with impl "loop"); returns the gate-weighted sum [T, W]."""
    T, K = idx_TK.shape
    flat_A = idx_TK.reshape(-1)
    z_TK1W = z_TW[:, None, None, :]
    # matrix-vector products as broadcast multiply + sum: no copy of z, no N=1 GEMM kernels
    h_TKF = relu2((up_EFW[flat_A].view(T, K, *up_EFW.shape[1:]) * z_TK1W).sum(-1))
    y_TKW = (down_EWF[flat_A].view(T, K, *down_EWF.shape[1:]) * h_TKF[:, :, None, :]).sum(-1)
    return (y_TKW * w_TK[..., None].to(y_TKW.dtype)).sum(1)


def moe_decode_step(
    x_TD: torch.Tensor,
    gate_w_ED: torch.Tensor,
    bias_E: torch.Tensor,
    up_EFW: torch.Tensor,
    down_EWF: torch.Tensor,
    fc1_WD: torch.Tensor | None,
    fc2_DW: torch.Tensor | None,
    shared_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    *,
    use_native: bool = True,
    **route: int | float | bool,
) -> torch.Tensor:
    """The MoE forward for a few tokens (decoding, speculative verification) as one pure
    function of tensors (router, gathered experts, latent projections, shared expert). Same
    math as `MoE.forward`; parity is tested. `route` are the keyword arguments of
    `sigmoid_topk_route`. With `use_native` and fp32 CPU inference the projections and the
    experts run through `ops.native` (each chosen expert's weights read once for all tokens);
    otherwise, and under `torch.compile` (`HybridLM.compile_decode`), pure torch."""
    weights = (gate_w_ED, up_EFW, down_EWF, fc1_WD, fc2_DW, shared_up, shared_down)
    fast = use_native and native.usable(x_TD, *weights)
    linear = native.linear if fast else F.linear
    if fast and route["n_group"] == 1 and bias_E.dtype == torch.float32:
        idx_TK, w_TK = native.route(
            native.linear(x_TD, gate_w_ED),
            bias_E,
            top_k=int(route["top_k"]),
            norm_topk_prob=bool(route["norm_topk_prob"]),
            scaling=float(route["scaling"]),
        )
    else:
        _, idx_TK, w_TK = sigmoid_topk_route(x_TD, gate_w_ED, bias_E, linear=linear, **route)
    z_TW = linear(x_TD, fc1_WD) if fc1_WD is not None else x_TD
    if fast:
        y_TW = native.experts(z_TW, idx_TK, w_TK, up_EFW, down_EWF)
    else:
        y_TW = experts_gathered(z_TW, idx_TK, w_TK, up_EFW, down_EWF).to(x_TD.dtype)
    y_TD = linear(y_TW, fc2_DW) if fc2_DW is not None else y_TW
    if shared_up is not None:
        y_TD = y_TD + linear(relu2(linear(x_TD, shared_up)), shared_down)
    return y_TD


def moe_decode_step_torch(*args: Any, **kw: Any) -> torch.Tensor:
    """`moe_decode_step` in pure torch (the reference of its native path; compiled by
    `HybridLM.compile_decode`)."""
    return moe_decode_step(*args, use_native=False, **kw)


def run_local(
    fn: ExpertsFn,
    z_AW: torch.Tensor,
    counts: list[int],
    up_EFW: torch.Tensor,
    down_EWF: torch.Tensor,
) -> torch.Tensor:
    """Default expert dispatch: every expert is on this device, run `fn` on the sorted tokens.
    Expert parallelism (`hybridlm.train.distributed.expert_parallel`) swaps in an all-to-all
    dispatch with the same signature, so the model never touches collectives."""
    return fn(z_AW, counts, up_EFW, down_EWF)


def _experts_fused(
    z_AW: torch.Tensor,
    counts: list[int] | torch.Tensor,
    up_EFW: torch.Tensor,
    down_EWF: torch.Tensor,
) -> torch.Tensor:
    """CUDA fast path: the Triton grouped GEMMs with relu^2 fused (`ops.fused.experts`), which
    keep only relu's output for the backward."""
    from ..ops.fused.experts import experts_fused

    return experts_fused(z_AW, counts, up_EFW, down_EWF)


def grouped_mm_available(device: torch.device) -> bool:
    # torch's grouped_mm backward is CUDA-only; the per-expert loop is the CPU path
    return device.type == "cuda" and hasattr(F, "grouped_mm")


class Experts(nn.Module):
    def __init__(self, num_experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.impl = "auto"  # "auto" | "loop" | "padded" | "grouped" | "fused" | "gathered"
        # how sorted tokens reach their experts: `run_local`, or expert parallelism's
        # all-to-all (set from outside by `train.distributed.expert_parallel.apply_expert_parallel`)
        self.dispatch = run_local

    def forward(self, z_TW: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        T, K = idx_TK.shape
        E = self.up_proj.shape[0]
        impl = self.impl
        if impl == "auto" and T * K <= E and not torch.is_grad_enabled():
            impl = "gathered"  # decoding: fewer assignments than experts
        if impl == "gathered":
            y_TW = experts_gathered(z_TW, idx_TK, w_TK, self.up_proj, self.down_proj)
            return y_TW.to(z_TW.dtype)
        flat_A = idx_TK.reshape(-1)
        order_A = flat_A.argsort(stable=True)  # sort assignments by expert
        token_A = order_A // K
        # a scatter, not bincount: bincount reads its maximum back to the host, which a
        # captured decode step (CUDA graphs, `infer.graphs`) cannot do
        counts_E = torch.zeros(E, dtype=torch.long, device=flat_A.device).scatter_add_(
            0, flat_A, torch.ones_like(flat_A)
        )
        z_AW = z_TW[token_A]
        if impl == "auto" and fused.usable(z_TW, self.up_proj, self.down_proj):
            impl = "fused"
        elif impl == "auto":
            impl = "grouped" if grouped_mm_available(z_TW.device) else "padded"
        if impl == "fused" and self.dispatch is run_local:
            # the kernels tile from the counts on the device: no host sync per layer
            y_AW = _experts_fused(z_AW, counts_E, self.up_proj, self.down_proj)
        else:
            fn = {
                "grouped": _experts_grouped,
                "loop": _experts_loop,
                "padded": _experts_padded,
                "fused": _experts_fused,
            }[impl]
            y_AW = self.dispatch(fn, z_AW, counts_E.tolist(), self.up_proj, self.down_proj)
        y_AW = y_AW * w_TK.reshape(-1)[order_A, None].to(y_AW.dtype)
        return torch.zeros_like(z_TW, dtype=y_AW.dtype).index_add_(0, token_A, y_AW).to(z_TW.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec | None = None) -> None:
        super().__init__()
        e = self.cfg = cfg.moe
        d = cfg.d_model
        width = e.latent_size or d
        self.gate = TopKRouter(d, e)
        self.experts = Experts(e.num_experts, width, e.expert_hidden)
        if e.shared_expert_hidden:
            self.shared_experts = MLP(d, e.shared_expert_hidden, "relu2")
        if e.latent_size:
            self.fc1_latent_proj = nn.Linear(d, e.latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(e.latent_size, d, bias=False)
        self.register_buffer("load_E", torch.zeros(e.num_experts), persistent=False)
        # off while activation checkpointing recomputes a forward: its tokens are counted once
        self.count_routing = True
        self.decode_fn = moe_decode_step  # HybridLM.compile_decode swaps in a compiled one

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate.weight, std=std)
        self.gate.e_score_correction_bias.zero_()
        nn.init.normal_(self.experts.up_proj, std=std)
        nn.init.normal_(self.experts.down_proj, std=out_std)
        if self.cfg.shared_expert_hidden:
            self.shared_experts.reset_parameters(std, out_std)
        if self.cfg.latent_size:
            nn.init.normal_(self.fc1_latent_proj.weight, std=std)
            nn.init.normal_(self.fc2_latent_proj.weight, std=out_std)
        self.init_buffers(self.gate.weight.device)

    def init_buffers(self, device: torch.device) -> None:
        self.load_E = torch.zeros(self.cfg.num_experts, device=device)

    def forward(
        self,
        x_BLD: torch.Tensor,
        *,
        aux_sink: AuxSink | None = None,
        **_: object,
    ) -> torch.Tensor:
        """`aux_sink`: the caller's per-call collector; a training forward adds its
        sequence-level balancing loss there (Nemotron 3 Super §2.1.1). The module keeps no loss
        between calls."""
        c = self.cfg
        Bsz, L, D = x_BLD.shape
        x_TD = x_BLD.reshape(-1, D)
        if (
            self.decode_fn is not None
            and not self.training
            and not torch.is_grad_enabled()
            and (Bsz * L * c.top_k <= c.num_experts or native.usable(x_TD, self.experts.up_proj))
            and self.experts.impl == "auto"
            and is_stock(self)
        ):
            return self._decode(x_TD).view(Bsz, L, D)
        scores_TE, idx_TK, w_TK = self.gate(x_TD)
        if self.training:
            if self.count_routing:  # routing statistics of training steps only
                with torch.no_grad():
                    counts = torch.bincount(idx_TK.reshape(-1), minlength=c.num_experts)
                    self.load_E += counts.to(self.load_E.dtype)
            if aux_sink is not None:
                aux = self._sequence_aux_loss(scores_TE, idx_TK, Bsz, L)
                if aux is not None:
                    aux_sink.add(aux)

        z_TW = project(self.fc1_latent_proj, x_TD) if c.latent_size else x_TD
        y_TW = self.experts(z_TW, idx_TK, w_TK)
        y_TD = project(self.fc2_latent_proj, y_TW) if c.latent_size else y_TW
        if c.shared_expert_hidden:  # shared expert at full width, added in d-space
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view(Bsz, L, D)

    def _decode(self, x_TD: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        latent = bool(c.latent_size)
        shared = bool(c.shared_expert_hidden)
        return self.decode_fn(
            x_TD,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            self.experts.up_proj,
            self.experts.down_proj,
            self.fc1_latent_proj.weight if latent else None,
            self.fc2_latent_proj.weight if latent else None,
            self.shared_experts.up_proj.weight if shared else None,
            self.shared_experts.down_proj.weight if shared else None,
            top_k=c.top_k,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            scaling=c.routed_scaling_factor,
        )

    def _sequence_aux_loss(
        self, scores_TE: torch.Tensor, idx_TK: torch.Tensor, Bsz: int, L: int
    ) -> torch.Tensor | None:
        """alpha * sum_i f_i P_i per sequence, averaged over sequences (DeepSeek-V3 eq. 17-20):
        f_i = E/(K L) * #tokens choosing i, P_i = mean over tokens of normalised scores.
        For rows that are part of longer ones (`_whole_row_counts`), f counts the whole rows
        and P_i sums these tokens over the whole length: the parts add up to the rows' loss."""
        c = self.cfg
        if c.aux_loss_coef <= 0:
            return None
        E, K = c.num_experts, c.top_k
        probs_BLE = (scores_TE / scores_TE.sum(-1, keepdim=True)).view(Bsz, L, E)
        chosen = torch.zeros(Bsz * L, E, device=scores_TE.device).scatter_(1, idx_TK, 1.0)
        count_BE, whole = self._whole_row_counts(chosen.view(Bsz, L, E).sum(1), L)
        P_BE = probs_BLE.mean(1) if whole == L else probs_BLE.sum(1) / whole
        f_BE = count_BE * (E / (K * whole))
        return c.aux_loss_coef * (f_BE * P_BE).sum(-1).mean()

    def _whole_row_counts(self, count_BE: torch.Tensor, L: int) -> tuple[torch.Tensor, int]:
        """Tokens per expert of the whole rows these `L` tokens per row belong to, and the
        rows' length: these rows' own on one device. Context parallelism
        (`train.distributed.context_parallel`) sums the shards'."""
        return count_BE, L

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the
        over-loaded ones (DeepSeek-V3 §2.1.2; rate 1e-3 in Nemotron 3 Super). A frozen router
        (`gate.weight` not requiring grad, e.g. during RL) keeps its bias too."""
        if not self.gate.weight.requires_grad:
            self.load_E.zero_()
            return
        load = self.load_E if load_E is None else load_E.to(self.load_E)
        bias = self.gate.e_score_correction_bias
        bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load).to(bias.dtype)
        self.load_E.zero_()
