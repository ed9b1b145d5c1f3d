"""`HybridLM`: the one model class of every stage (pretrain, SFT, RL, quantise, eval, serve).

Shape legend: B batch, L sequence, D model width, V vocabulary.

Embedding -> blocks from the pattern string -> final RMSNorm -> untied LM head, plus an optional
shared-weight MTP module. `forward(input_ids, labels)` returns logits and the loss broken into
parts: next-token CE, MTP (mean over depths, weight `mtp.loss_weight`) and the MoE sequence-level
balancing loss. Labels follow the transformers convention: `labels[:, t]` is the token at position
t (usually `input_ids`), -100 is ignored, and the model shifts internally.

Build on the meta device and initialise in one place:

    with torch.device("meta"):
        model = HybridLM(cfg)
    model.to_empty(device="cpu"); model.init_weights(seed=0)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.cross_entropy import linear_cross_entropy
from .block import build_blocks
from .cache import HybridCache
from .mamba2 import Mamba2Mixer, mamba2_decode_step
from .moe import MoE, moe_decode_step
from .mtp import MTP
from .norm import RMSNorm

IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # None with return_logits=False (fused LM-head + CE)
    loss: torch.Tensor | None = None
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    hidden: torch.Tensor | None = None  # final-normed hidden states, the MTP module's input
    mtp_logits: list[torch.Tensor] = field(default_factory=list)


def _shift_left(x_BL: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """out[:, t] = x[:, t + k]; the last k positions get `fill`."""
    if k == 0:
        return x_BL
    return torch.cat(
        [x_BL[:, k:], x_BL.new_full((x_BL.shape[0], min(k, x_BL.shape[1])), fill)], dim=1
    )


@functools.cache
def _compiled(fn):
    """One compiled function per decode step kind, shared by every layer (weights are inputs)."""
    return torch.compile(fn, fullgraph=True)


class HybridLM(nn.Module):
    def __init__(self, config: ModelConfig, *, seed: int | None = None) -> None:
        super().__init__()
        config.validate()
        self.config = config
        d, V = config.d_model, config.vocab_size
        self.embeddings = nn.Embedding(V, d)
        self.layers = build_blocks(config, config.pattern)
        self.norm_f = RMSNorm(d, eps=config.norm_eps)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.tie_weights()
        self.mtp = MTP(config) if config.mtp.pattern else None
        if self.embeddings.weight.device.type != "meta":
            self.init_weights(seed=seed)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """The init laws in one place.

        - embeddings, LM head, every input projection, router, experts' up: N(0, init_std)
        - output projections writing into the residual stream (Mamba out_proj, attention o_proj,
          MLP/expert/shared down_proj, fc2_latent_proj): N(0, init_std / sqrt(2 * n_blocks)),
          the depth-scaled init of GPT-2 / Megatron
        - Mamba: A_log = log U[1, 16], dt_bias = softplus^-1(logU[dt_min, dt_max]), D = 1
        - norms 1, correction bias 0, RoPE frequencies recomputed (non-persistent buffers)
        """
        gen_state = torch.random.get_rng_state()
        if seed is not None:
            torch.manual_seed(seed)
        try:
            std = self.config.init_std
            out_std = std / math.sqrt(2 * len(self.config.pattern))
            nn.init.normal_(self.embeddings.weight, std=std)
            if not self.config.tie_embeddings:
                nn.init.normal_(self.lm_head.weight, std=std)
            self.norm_f.reset_parameters()
            blocks = list(self.layers) + (list(self.mtp.layers) if self.mtp is not None else [])
            for block in blocks:
                block.norm.reset_parameters()
                block.mixer.reset_parameters(std, out_std)
            if self.mtp is not None:
                for norm in (self.mtp.enorm, self.mtp.hnorm, self.mtp.final_layernorm):
                    norm.reset_parameters()
                nn.init.normal_(self.mtp.eh_proj.weight, std=std)
        finally:
            if seed is not None:
                torch.random.set_rng_state(gen_state)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when `tie_embeddings` is set."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embeddings.weight

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE frequencies, expert-load counters), e.g. after
        `load_state_dict(assign=True)` onto a meta-device model."""
        device = self.embeddings.weight.device
        for module in self.modules():
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers(device)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        cache: HybridCache | None = None,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        num_valid_tokens: int | torch.Tensor | None = None,
        mtp_depth: int | None = None,
        return_hidden: bool = False,
        return_logits: bool = True,
    ) -> ModelOutput:
        """`num_valid_tokens`: the global count of label tokens (after the shift) across all
        micro-batches and ranks, so that accumulation and data parallelism give the gradient of
        the global mean. Default: this batch's own count.

        `return_logits=False` (training) computes the LM-head and cross-entropy fused, chunk by
        chunk (`ops.cross_entropy`), never holding the [B, L, V] logits or their gradient."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        Bsz, L = input_ids.shape
        moe = self.moe_layers()
        for m in moe:  # balancing losses are collected per call
            m.aux_losses.clear()
        offset = cache.seen_tokens if cache is not None else 0
        positions_L = torch.arange(offset, offset + L, device=input_ids.device)
        if doc_ids is not None:
            ctx = self._document_context(input_ids, doc_ids, attention_mask, cache)
        else:
            ctx = self._padding_context(input_ids, attention_mask, cache, positions_L)
        h = self.embeddings(input_ids)
        for i, block in enumerate(self.layers):
            h = block(h, state=cache.layers[i] if cache is not None else None, **ctx)
        if cache is not None:
            cache.seen_tokens += L
        h = self.norm_f(h)
        if labels is None or return_logits:
            out = ModelOutput(logits=self.lm_head(h), hidden=h if return_hidden else None)
        else:
            out = ModelOutput(logits=None, hidden=h if return_hidden else None)
        if labels is None:
            return out
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )

        ce = self._loss(h, out.logits, _shift_left(labels, 1, IGNORE_INDEX), num_valid_tokens)
        out.losses["ce"] = ce
        total = ce
        depth = self.config.mtp.depth if mtp_depth is None else mtp_depth
        if self.mtp is not None and depth > 0:
            mtp_losses, h_k = [], h
            for k in range(1, depth + 1):
                emb = self.embeddings(_shift_left(input_ids, k, 0))
                h_k = self.mtp(h_k, emb, **ctx)
                logits_k = self.lm_head(h_k) if return_logits else None
                if logits_k is not None:
                    out.mtp_logits.append(logits_k)
                targets_k = _shift_left(labels, k + 1, IGNORE_INDEX)
                if doc_ids is not None:  # packed rows: no target from the next document
                    same = _shift_left(doc_ids.to(labels.device), k + 1, -1) == doc_ids.to(
                        labels.device
                    )
                    targets_k = targets_k.masked_fill(~same, IGNORE_INDEX)
                loss_k = self._loss(h_k, logits_k, targets_k, num_valid_tokens)
                out.losses[f"mtp_{k}"] = loss_k
                mtp_losses.append(loss_k)
            out.losses["mtp"] = torch.stack(mtp_losses).mean()
            total = total + self.config.mtp.loss_weight * out.losses["mtp"]
        aux = [loss for m in moe for loss in m.aux_losses]
        if aux:
            out.losses["moe_aux"] = torch.stack(aux).sum()
            total = total + out.losses["moe_aux"]
        out.loss = total
        return out

    @staticmethod
    def _document_context(
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: HybridCache | None,
    ) -> dict[str, torch.Tensor]:
        if cache is not None or attention_mask is not None:
            raise ValueError("doc_ids are for packed training rows: no cache or attention_mask")
        if doc_ids.shape != input_ids.shape:
            raise ValueError(
                f"doc_ids shape {tuple(doc_ids.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        doc = doc_ids.to(input_ids.device)
        if bool((doc[:, 1:] < doc[:, :-1]).any()):
            raise ValueError("doc_ids must be non-decreasing along each row (packed documents)")
        L = doc.shape[1]
        idx_L = torch.arange(L, device=doc.device)
        start_BL = torch.ones_like(doc, dtype=torch.bool)
        start_BL[:, 1:] = doc[:, 1:] != doc[:, :-1]
        # position within the document: index minus the index of the document's first token
        first_BL = torch.cummax(torch.where(start_BL, idx_L, 0), dim=1).values
        return {
            "positions_L": idx_L,
            "positions_BL": idx_L - first_BL,
            "doc_ids_BL": doc,  # Mamba: conv taps and SSD state reset at document starts
            # attention within the own document only
            "attn_mask_B1LS": (doc[:, :, None] == doc[:, None, :])[:, None],
        }

    @staticmethod
    def _padding_context(
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: HybridCache | None,
        positions_L: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Keyword context of every block: shared positions on the unpadded fast path; per-row
        positions, the key mask and the token mask when rows are padded. Updates the cache's
        key mask and next positions."""
        ctx: dict[str, torch.Tensor] = {"positions_L": positions_L}
        padded_cache = cache is not None and cache.padded
        if attention_mask is None and not padded_cache:
            return ctx
        Bsz, L = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            tok_BL = torch.ones(Bsz, L, dtype=torch.bool, device=device)
        else:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                    f"{tuple(input_ids.shape)}"
                )
            tok_BL = attention_mask.to(device=device, dtype=torch.bool)
            ctx["token_mask_BL"] = tok_BL
        base_B = (
            cache.next_positions(Bsz, device)
            if cache is not None
            else torch.zeros(Bsz, dtype=torch.long, device=device)
        )
        ctx["positions_BL"] = base_B[:, None] + (tok_BL.long().cumsum(1) - 1).clamp(min=0)
        key_BS = tok_BL
        offset = 0
        if cache is not None:
            offset = cache.seen_tokens
            if offset:
                key_BS = torch.cat([cache._full_mask(), tok_BL], dim=1)
            cache.key_mask_BS = key_BS
            cache.positions_B = base_B + tok_BL.sum(1)
        # a padded query sees at least itself, so no softmax row is empty (no NaN to leak)
        self_LS = (
            torch.arange(key_BS.shape[1], device=device)
            == (offset + torch.arange(L, device=device))[:, None]
        )
        ctx["attn_mask_B1LS"] = (key_BS[:, None, :] | self_LS)[:, None]
        return ctx

    def _loss(
        self,
        h_BLD: torch.Tensor,
        logits_BLV: torch.Tensor | None,
        targets_BL: torch.Tensor,
        denom: int | torch.Tensor | None,
    ) -> torch.Tensor:
        """Mean CE over targets != -100 (or their sum / `denom`), from logits when they exist,
        else fused with the LM head."""
        if denom is None:
            denom = (targets_BL != IGNORE_INDEX).sum().clamp(min=1)
        if logits_BLV is None:
            return linear_cross_entropy(
                h_BLD.flatten(0, 1), self.lm_head.weight, targets_BL.flatten(), denom
            )
        ct = torch.promote_types(logits_BLV.dtype, torch.float32)  # fp64 stays fp64
        loss_sum = F.cross_entropy(
            logits_BLV.flatten(0, 1).to(ct),
            targets_BL.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return loss_sum / denom

    # ------------------------------------------------------------------ MoE balancing
    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def expert_load(self) -> torch.Tensor:
        """Tokens routed to each expert since the last bias update: [n_moe_layers, n_experts]."""
        layers = self.moe_layers()
        if not layers:
            return torch.zeros(0, 0)
        return torch.stack([m.load_E for m in layers])

    def update_moe_bias(self, load: torch.Tensor | None = None) -> None:
        """Aux-loss-free bias step for every MoE layer; call after each optimizer step. Pass the
        all-reduced `expert_load()` under data parallelism so every rank applies the same step."""
        for i, m in enumerate(self.moe_layers()):
            m.update_bias(None if load is None else load[i])

    # ------------------------------------------------------------------ decoding
    def compile_decode(self, enabled: bool = True) -> HybridLM:
        """Compile the one-token decode steps of the Mamba-2 and MoE mixers (pure functions
        `mamba2_decode_step` / `moe_decode_step`) with `torch.compile`, fusing their
        elementwise chains; attention stays eager (its KV length grows every step). The first
        steps compile (tens of seconds on CPU); later ones reuse the kernels. `enabled=False`
        restores the eager functions."""
        for module in self.modules():
            if isinstance(module, Mamba2Mixer):
                module.decode_fn = _compiled(mamba2_decode_step) if enabled else mamba2_decode_step
            elif isinstance(module, MoE):
                module.decode_fn = _compiled(moe_decode_step) if enabled else moe_decode_step
        return self

    # ------------------------------------------------------------------ facts
    def count_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device) -> HybridLM:
    """Build on the meta device, materialise on `device`, initialise once (model.init_weights)."""
    with torch.device("meta"):
        model = HybridLM(cfg)
    model.to_empty(device=device)
    model.init_buffers()
    model.init_weights(seed=seed)
    return model
