"""`HybridLM`: the one model class of every stage (pretrain, SFT, RL, quantise, eval, serve).

Shape legend: B batch, L sequence, D model width, V vocabulary.

Embedding -> blocks from the pattern string -> final RMSNorm -> untied LM head, plus an optional
shared-weight MTP module. `forward(input_ids)` returns values, never a loss (`ModelOutput`): the
logits [B, L, V] (or the final-normed hidden states [B, L, D] alone with `return_logits=False`,
for the fused LM-head + CE), with `mtp_depth=k` the hidden states (and logits) of MTP depths
1..k, and in training the MoE sequence-level balancing loss in `aux["moe_aux"]`. The losses
(next-token CE, MTP, the balancing term) are computed from these in `train/objectives.py`.

Every model is built on the meta device and materialised in one of three ways:
`build_model(cfg, seed=0, device="cpu")` (initialised once), `HybridLM.empty(cfg, device)`
(allocated, for a loader that copies weights in) or `HybridLM.from_state_dict(cfg, state)` (the
state's tensors assigned, no copy). Each ties the embeddings and computes the non-persistent
buffers, which a meta-built model lacks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig, YarnConfig
from .attention import Attention
from .block import build_blocks
from .cache import HybridCache
from .mamba2 import Mamba2Mixer, mamba2_decode_step, mamba2_decode_step_torch
from .moe import AuxSink, MoE, moe_decode_step, moe_decode_step_torch
from .mtp import MTP
from .norm import RMSNorm
from .slots import SlotCache
from .stock import project

IGNORE_INDEX = -100  # label of a position without a target (transformers' convention)


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, L, V]; None with return_logits=False (fused LM-head + CE)
    # final-normed hidden states [B, L, D], the MTP module's input (return_hidden, or
    # return_logits=False: then the fused loss needs them)
    hidden: torch.Tensor | None = None
    mtp_hidden: list[torch.Tensor] = field(default_factory=list)  # depth k = index k-1, [B, L, D]
    mtp_logits: list[torch.Tensor] = field(default_factory=list)  # with return_logits, [B, L, V]
    # auxiliary loss terms of this call ("moe_aux": the MoE sequence-level balancing loss summed
    # over layers and MTP depths, training only); empty when there is none
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    head: Any = None  # what forward's `head` callable returned (e.g. the training loss)


def shift_left(x: torch.Tensor, k: int, fill: float | int = 0) -> torch.Tensor:
    """out[:, t] = x[:, t + k] (along dim 1); the last k positions get `fill`."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, :-k] = x[:, k:]
    return out


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
        # per-depth heads (`mtp.shared` False): depth k >= 2 runs `mtp_depths[k - 2]`
        self.mtp_depths = (
            nn.ModuleList(MTP(config) for _ in range(config.mtp.heads - 1))
            if config.mtp.pattern and config.mtp.heads > 1
            else None
        )
        # how engines store this model's attention KV cache, set from outside
        # (`precision.kv_cache.KVCacheQuant`: a checkpoint's declared format and calibration)
        self.kv_cache_quant: Any = None
        # a reward model's scalar head (config.num_labels): `score(hidden[last token])`
        self.score = nn.Linear(d, config.num_labels, bias=False) if config.num_labels else None
        if self.embeddings.weight.device.type != "meta":
            self.init_weights(seed=seed)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """The init laws in one place.

        - embeddings, LM head, score head, every input projection, router, experts' up:
          N(0, init_std)
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
            for module, init in self.init_units():
                init(module)
        finally:
            if seed is not None:
                torch.random.set_rng_state(gen_state)

    def init_units(self) -> list[tuple[nn.Module, Callable[[nn.Module], None]]]:
        """`init_weights` as (module, init of that module) in the order it draws random
        numbers, so that a sharded build can initialise one unit at a time on the CPU and keep
        only its shard (`train.distributed.parallel.materialize_sharded`), equal to the
        whole-model init."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * len(self.config.pattern))

        def normal(m: nn.Module) -> None:
            nn.init.normal_(m.weight, std=std)

        def block_init(b: nn.Module) -> None:
            b.norm.reset_parameters()
            b.mixer.reset_parameters(std, out_std)

        def reset(m: nn.Module) -> None:
            m.reset_parameters()

        units: list[tuple[nn.Module, Callable[[nn.Module], None]]] = [(self.embeddings, normal)]
        if not self.config.tie_embeddings:
            units.append((self.lm_head, normal))
        units.append((self.norm_f, reset))
        units += [(block, block_init) for block in self.layers]
        heads = self.mtp_heads()
        if heads:
            # per-depth heads start equal to the first (its random draws replayed on the
            # device the head is drawn on), so that consolidating them by averaging
            # (`train.mtp_init`) starts from one point
            start: dict[str, torch.Tensor] = {}

            def replay(init: Callable) -> Callable:
                def run(m: nn.Module) -> None:
                    device = next(m.parameters()).device
                    gen: Any = torch.cuda if device.type == "cuda" else torch.random
                    args = (device,) if device.type == "cuda" else ()
                    start.setdefault("state", gen.get_rng_state(*args))
                    gen.set_rng_state(start["state"], *args)
                    init(m)

                return run

            for h in heads:
                head_units = [(block, block_init) for block in h.layers]
                head_units += [(n, reset) for n in (h.enorm, h.hnorm, h.final_layernorm)]
                head_units.append((h.eh_proj, normal))
                units.append((head_units[0][0], replay(head_units[0][1])))
                units += head_units[1:]
        if self.score is not None:
            units.append((self.score, normal))
        return units

    def mtp_heads(self) -> list[MTP]:
        """The MTP modules: none, the one shared head, or one per depth (depth 1 first)."""
        if self.mtp is None:
            return []
        return [self.mtp, *(self.mtp_depths or [])]

    def mtp_head(self, k: int) -> MTP:
        """The module that runs MTP depth k (1-based)."""
        if self.mtp is None:
            raise ValueError("the model has no MTP module (mtp.pattern is empty)")
        if self.mtp_depths is None:
            return self.mtp
        return self.mtp if k == 1 else self.mtp_depths[k - 2]

    def check_drafter(self, what: str) -> None:
        """Raise unless the model drafts: one MTP head, shared over depths, applied recursively
        (what speculative decoding, vLLM and the exports take)."""
        if self.mtp is None:
            raise ValueError(f"{what} needs a model with an MTP head (mtp.pattern is empty)")
        if self.mtp_depths is not None:
            raise ValueError(
                f"{what} drafts with one recursively shared MTP head and this model has one per "
                "depth (mtp.shared: false): consolidate them first "
                "(hybridlm mtp-boost --set mtp_boost.init=consolidate)"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def empty(cls, config: ModelConfig, device: torch.device | str = "cpu") -> HybridLM:
        """A model allocated on `device` with uninitialised weights (for a loader that copies
        them in, or `init_weights`): built on meta, tied again (`to_empty` gives every module its
        own tensor), non-persistent buffers computed."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        model.tie_weights()
        model.init_buffers()
        return model

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
        strict: bool = True,
        missing_ok: frozenset[str] | set[str] = frozenset(),
        what: str = "the state dict",
    ) -> HybridLM:
        """A model holding `state`'s tensors (assigned, not copied; then moved to `device`
        when given). A tied LM head may be absent from `state`. With `strict`, a parameter
        missing from `state` (other than `missing_ok`, which the caller replaces or fills and
        which stay on the meta device) or a key the model lacks is an error naming `what`."""
        with torch.device("meta"):
            model = cls(config)
        if config.tie_embeddings and "lm_head.weight" not in state and "embeddings.weight" in state:
            state = {**state, "lm_head.weight": state["embeddings.weight"]}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = sorted(set(missing) - set(missing_ok))
        if strict and (missing or unexpected):
            raise ValueError(
                f"{what} does not match its model config: missing {missing[:6]}, "
                f"unexpected {sorted(unexpected)[:6]}"
            )
        if device is not None:
            model.to(device)
        model.tie_weights()  # assign replaced the shared tensor: share it again
        model.init_buffers()
        return model

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

    @torch.no_grad()
    def extend_context(self, max_seq_len: int, yarn: YarnConfig | None = None) -> list[str]:
        """Long-context extension of a trained model (Olmo 3 §5, Nemotron 3 Super §2.6): raise
        `config.max_seq_len` to at least `max_seq_len` and, with `yarn`, rescale the RoPE of the
        full-attention layers (Olmo 3 §3.6: sliding-window layers keep plain RoPE). NoPE attention
        and Mamba-2 layers carry no positions and need nothing. Returns the names of the
        attention modules whose frequencies changed."""
        cfg = self.config
        cfg.max_seq_len = max(cfg.max_seq_len, int(max_seq_len))
        if yarn is None:
            return []
        yarn.validate()
        cfg.attention.yarn = yarn
        changed = []
        for name, module in self.named_modules():
            if isinstance(module, Attention) and module.a.rope_theta is not None:
                if not module.sliding:
                    module.yarn = yarn
                    module.init_buffers(module.q_proj.weight.device)
                    changed.append(name)
        return changed

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache: HybridCache | SlotCache | None = None,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        mtp_depth: int = 0,
        return_hidden: bool = False,
        return_logits: bool = True,
        head: Callable[[ModelOutput], Any] | None = None,
    ) -> ModelOutput:
        """Logits (and/or hidden states) of `input_ids` [B, L]; no loss.

        `doc_ids` [B, L]: packed rows, attention and Mamba state stay within a document.
        `mtp_depth=k` runs the shared MTP module recursively for depths 1..k (Nemotron 3 Super
        §2.1.2) and returns their hidden states in `mtp_hidden` (and logits in `mtp_logits`).
        `return_logits=False` (training) skips the LM head and returns the hidden states, for
        the fused LM-head + cross-entropy (`ops.cross_entropy`) that never holds the [B, L, V]
        logits or their gradient. In training mode, MoE layers add their balancing loss to
        `aux["moe_aux"]`.

        `head(out)`, when given, runs at the end of the forward and its result is `out.head`:
        a loss defined outside the model (`train.objectives`) that uses the LM-head weight on the
        hidden states (the fused cross-entropy) is then computed inside the forward, where data
        parallelism expects parameters to be used (DDP's gradient hooks, FSDP2's unsharded
        parameters)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        L = input_ids.shape[1]
        ctx = self._block_context(input_ids, doc_ids, attention_mask, cache)
        aux_sink = AuxSink()  # MoE balancing losses of this call only
        h = self.embeddings(input_ids)
        for i, block in enumerate(self.layers):
            h = block(
                h, state=cache.layers[i] if cache is not None else None, aux_sink=aux_sink, **ctx
            )
        if cache is not None:
            cache.advance(L)
        h = self.norm_f(h)
        out = ModelOutput(
            logits=project(self.lm_head, h) if return_logits else None,
            hidden=h if return_hidden or not return_logits else None,
        )
        if mtp_depth > 0:
            if self.mtp is None:
                raise ValueError(f"mtp_depth={mtp_depth} but the model has no MTP module")
            if self.mtp_depths is not None and mtp_depth > self.config.mtp.depth:
                raise ValueError(
                    f"mtp_depth={mtp_depth}: the model has per-depth MTP heads for depths "
                    f"1..{self.config.mtp.depth} only"
                )
            h_k = h
            for k in range(1, mtp_depth + 1):
                emb = self.embeddings(self._tokens_ahead(input_ids, k))
                h_k = self.mtp_head(k)(h_k, emb, aux_sink=aux_sink, **ctx)
                out.mtp_hidden.append(h_k)
                if return_logits:
                    out.mtp_logits.append(project(self.lm_head, h_k))
        moe_aux = aux_sink.total()
        if moe_aux is not None:
            out.aux["moe_aux"] = moe_aux
        if head is not None:
            out.head = head(out)
        return out

    # The two methods below are what a forward sees of the rows beyond its own tokens. On one
    # device the rows are whole; context parallelism (`train.distributed.context_parallel`)
    # gives each rank one shard of every row and overrides them (with the mixers'
    # `_keys_values`, `_conv_rows`, `_add_entering_state`, `_whole_row_counts`) to exchange
    # what crosses shards.
    def _block_context(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache: HybridCache | None,
    ) -> dict[str, torch.Tensor]:
        """Keyword context of every block: positions, masks and document ids."""
        if isinstance(cache, SlotCache):  # static buffers of a captured decode step
            if doc_ids is not None or attention_mask is not None:
                raise ValueError("a SlotCache call takes unpadded rows: no doc_ids or mask")
            return cache.context(input_ids)
        if doc_ids is not None:
            local = self._check_doc_ids(input_ids, doc_ids, attention_mask, cache)
            return self._document_context(local, local, 0)
        offset = cache.seen_tokens if cache is not None else 0
        positions_L = torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)
        return self._padding_context(input_ids, attention_mask, cache, positions_L)

    def _tokens_ahead(self, input_ids: torch.Tensor, k: int) -> torch.Tensor:
        """Token t + k at position t (0 past the end): the input of MTP depth k."""
        return shift_left(input_ids, k, 0)

    @staticmethod
    def _check_doc_ids(
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: HybridCache | None,
    ) -> torch.Tensor:
        """`doc_ids` on the rows' device, after the checks of packed training rows."""
        if cache is not None or attention_mask is not None:
            raise ValueError("doc_ids are for packed training rows: no cache or attention_mask")
        if doc_ids.shape != input_ids.shape:
            raise ValueError(
                f"doc_ids shape {tuple(doc_ids.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        return doc_ids.to(input_ids.device)

    @staticmethod
    def _document_context(
        local: torch.Tensor, doc: torch.Tensor, start: int
    ) -> dict[str, torch.Tensor]:
        """Positions within documents, the same-document attention mask, the doc ids for Mamba,
        of rows `local` [B, L] that are the part of the whole rows `doc` beginning at `start`
        (the whole rows themselves on one device): positions and the mask's key axis are those
        of the whole rows."""
        if bool((doc[:, 1:] < doc[:, :-1]).any()):
            raise ValueError("doc_ids must be non-decreasing along each row (packed documents)")
        L = doc.shape[1]
        idx_L = torch.arange(L, device=doc.device)
        start_BL = torch.ones_like(doc, dtype=torch.bool)
        start_BL[:, 1:] = doc[:, 1:] != doc[:, :-1]
        # position within the document: index minus the index of the document's first token
        first_BL = torch.cummax(torch.where(start_BL, idx_L, 0), dim=1).values
        own = slice(start, start + local.shape[1])  # these rows' positions
        return {
            "positions_L": idx_L[own],
            "positions_BL": (idx_L - first_BL)[:, own],
            "doc_ids_BL": local,  # Mamba: conv taps and SSD state reset at document starts
            # attention within the own document only
            "attn_mask_B1LS": (local[:, :, None] == doc[:, None, :])[:, None],
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

    @property
    def train_mtp_depth(self) -> int:
        """MTP depths a training forward runs by default: `mtp.depth`, 0 without an MTP module."""
        return self.config.mtp.depth if self.mtp is not None else 0

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
                module.decode_fn = (
                    _compiled(mamba2_decode_step_torch) if enabled else mamba2_decode_step
                )
            elif isinstance(module, MoE):
                module.decode_fn = _compiled(moe_decode_step_torch) if enabled else moe_decode_step
        return self

    # ------------------------------------------------------------------ facts
    def count_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig, *, seed: int, device: torch.device | str) -> HybridLM:
    """Build on the meta device, materialise on `device`, initialise once (model.init_weights)."""
    model = HybridLM.empty(cfg, device)
    model.init_weights(seed=seed)
    return model
