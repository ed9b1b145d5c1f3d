"""MTP healing / boosting: train only the MTP head on the model's own generations, so that its
drafts match what the backbone will verify (Nemotron 3 Super §4.7 "MTP healing"; Nemotron 3.5
§2.1 MTP warm-up and §3.7 "MTP boosting").

    hybridlm mtp-boost --checkpoint runs/quickstart --set train.max_steps=300
    run_mtp_boost(model, tokenizer, train_prompts, eval_prompts, MTPBoostRunConfig())

Shape legend: B batch, L sequence, D width, V vocabulary.

Recipe:
1. **Self-generated data.** The frozen model continues `num_sequences` prompts for `gen_len`
   tokens (sampled at `gen_temperature` with the continuous-batching engine). After RL or SFT
   the backbone's distribution has moved away from the pretraining text the head was trained
   on; its own generations are exactly the distribution the drafts will be verified against.
2. **Backbone frozen**: only `model.mtp` is trained (the embeddings and the LM head it shares
   stay fixed). Per depth k = 1..D the head predicts token t+k+1 from (h^{k-1}_t, emb(x_{t+k})).
   The loss on generated targets is `(1 - w) * NLL + w * T^2 * KL(p_backbone || q_mtp)`: the NLL
   of the generated token, and distillation from the backbone's own next-token distribution at
   position t+k (the distribution that verifies the draft: matching it raises acceptance under
   greedy verification and, more so, under rejection sampling; Nemotron 3.5 §3.7).
3. **Hidden-state mixing** (Nemotron 3.5 §2.1): at depth k >= 2 the head's input hidden is, per
   position, the backbone's true hidden of the position it stands for (h^0_{t+k-1}, what depth 1
   sees) with probability `mix_true`, and its own recursive output h^{k-1}_t otherwise (what
   deeper drafts see at inference), so it is conditioned on both kinds of state.
4. **Acceptance before and after** with the speculative decoder on held-out prompts, greedy and
   at T=1, by draft position; the result goes to `metrics.jsonl` and `acceptance.png`. Also
   teacher-forced greedy agreement by depth (`mtp_init.head_agreement`) of the incoming heads
   (`source`), the initialised head (`init`) and the trained one (`after`).
5. **The head it starts from** (`init`, `train.mtp_init`): the model's own shared head (`keep`),
   per-depth heads consolidated into one (`consolidate`, Nemotron 3.5 Super), a head built from
   the backbone's tail with a fitted input projection (`fuse`, Lightning), or a random one; the
   warm-up of Nemotron 3.5 §2.1 is this stage run after the init.

The loop is the one `Trainer` (`MTPBoost` is its stage): AdamW over the head's parameters,
linear warm-up then cosine decay to `train.min_lr`, clipping, the finiteness check and the MoE
bias step of the head's own routers (the frozen backbone's routers keep their biases), `train`
rows every `train.log_interval` steps (`step` = optimizer steps done), a final checkpoint (exact
resume with `mtp_boost_trainer(..., resume=True)`).
"""

from __future__ import annotations

import dataclasses
import random
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..config import Config
from ..data.chat import render
from ..data.config import SourceConfig
from ..data.pipeline import build_source
from ..data.sft import Conversation, ReadReport
from ..data.tokenizer import ByteTokenizer
from ..files import metric_rows
from ..infer.engine import Engine
from ..infer.sampling import SamplingParams
from ..infer.speculative import merge_stats, speculative_generate
from ..interop.hf import save_pretrained
from ..io import load
from ..model.model import HybridLM, shift_left
from ..report.plot import pyplot, save_figure
from .callbacks import Callback, Close, EndRows, Export, Plot, StartRows, Summary, Throughput
from .config import ScheduleKind, TrainConfig
from .distributed.parallel import broadcast_object, is_main
from .mtp_init import CONSOLIDATIONS, HEAD_INITS, head_agreement, init_head
from .post_training import SFTDataConfig, load_source, prompt_key, prompt_of
from .run_data import training_data
from .trainer import Loss, Runtime, Step, Trainer, TrainModule


@dataclass(kw_only=True)
class MTPBoostTrainConfig(TrainConfig):
    """The loop of an MTP boost (`train`): `TrainConfig` with the boost's defaults, AdamW on
    the head, linear warm-up then cosine decay to `min_lr`, no periodic held-out evaluation
    (acceptance is measured before the first step and after the last). `init_from` is the model
    whose head is boosted (a run, training checkpoint or transformers directory;
    `boost_checkpoint`). Under torchrun rank 0 generates the sequences and every rank trains
    the head on its share of each batch (`parallel`: ddp or fsdp)."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.0
    schedule: ScheduleKind = "cosine"
    warmup_steps: int = 20
    max_steps: int = 300
    eval_interval: int = 0
    checkpoint_interval: int = 0  # 0: only the final checkpoint
    out_dir: str = "runs/mtp_boost"

    def validate(self) -> None:
        super().validate()
        # acceptance is measured before and after, not every eval_interval steps
        self.check_own_loop("the MTP boost", ("eval_interval",))


@dataclass(kw_only=True)
class MTPBoostDataConfig:
    """What the head trains on and is measured on (`data`)."""

    # where prompts come from: "data" (the checkpoint's training data: text windows of a
    # pretraining run, the chat prompts of an SFT run; the stdlib corpus when there is no run
    # data) or an RL environment kind (e.g. "sft_arithmetic", "arithmetic"): healing after RL
    # reuses the RL prompts (Nemotron 3 Super §4.7)
    prompts: str = "data"
    # what the head trains on: "generated" (the model's own continuations of the prompts; the
    # post-training boost and healing) or "text" (windows of prompt_len + gen_len tokens of the
    # training data itself; the warm-up of Nemotron 3.5 §2.1 on pretraining data)
    kind: Literal["generated", "text"] = "generated"
    num_sequences: int = 128  # self-generated training sequences
    prompt_len: int = 64
    gen_len: int = 128
    gen_temperature: float = 1.0
    batch_size: int = 8  # sequences per step and rank
    eval_prompts: int = 16  # held-out prompts of the acceptance measurement

    def validate(self) -> None:
        for name in ("batch_size", "num_sequences", "prompt_len", "gen_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.kind == "text" and self.prompts != "data":
            raise ValueError(
                "data.kind: text trains on the training data's windows (prompts: data)"
            )


@dataclass(kw_only=True)
class MTPBoostConfig:
    """The head, its objective and the acceptance measurement (`mtp_boost`; module docstring)."""

    depth: int = 0  # MTP depths trained; 0 = draft_len (train the recursion as deep as used)
    mix_true: float = 0.5  # hidden-state mixing: P(true backbone hidden) at depth >= 2
    distill_weight: float = 0.5  # w: (1 - w) * NLL + w * KL(backbone || head)
    distill_temperature: float = 1.0
    eval_new_tokens: int = 96
    draft_len: int = 3
    eval_temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    # the head the warm-up starts from (`train.mtp_init`, Nemotron 3.5 §1): keep it, consolidate
    # per-depth heads (`consolidate`: average / first), build it from the backbone (fuse, a
    # ridge least-squares projection with relative `fuse_ridge`) or draw it at random
    init: str = "keep"
    consolidate: str = "average"
    fuse_ridge: float = 1.0e-3

    def validate(self) -> None:
        if not 0.0 <= self.mix_true <= 1.0:
            raise ValueError(f"mtp_boost.mix_true must be in [0, 1], got {self.mix_true}")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(
                f"mtp_boost.distill_weight must be in [0, 1], got {self.distill_weight}"
            )
        if self.distill_temperature <= 0:
            raise ValueError("mtp_boost.distill_temperature must be > 0")
        if not 1 <= self.draft_len <= 16:
            raise ValueError(f"mtp_boost.draft_len must be in [1, 16], got {self.draft_len}")
        if not self.eval_temperatures:
            raise ValueError("mtp_boost.eval_temperatures must list at least one temperature")
        if self.init not in HEAD_INITS:
            raise ValueError(f"mtp_boost.init must be one of {HEAD_INITS}, got {self.init!r}")
        if self.consolidate not in CONSOLIDATIONS:
            raise ValueError(
                f"mtp_boost.consolidate must be one of {CONSOLIDATIONS}, got {self.consolidate!r}"
            )
        if self.fuse_ridge < 0:
            raise ValueError(f"mtp_boost.fuse_ridge must be >= 0, got {self.fuse_ridge}")


# where the keys of the flat config (before the sections) went
_TRAIN_KEYS = ("lr", "warmup_steps", "grad_clip", "weight_decay", "log_interval", "seed")
_MOVED = {
    "steps": "train.max_steps",
    "checkpoint_interval": "train.checkpoint_interval",
    "parallel": "train.parallel",
    **{k: f"train.{k}" for k in _TRAIN_KEYS},
    **{f.name: f"data.{f.name}" for f in dataclasses.fields(MTPBoostDataConfig)},
    **{f.name: f"mtp_boost.{f.name}" for f in dataclasses.fields(MTPBoostConfig)},
}


@dataclass(kw_only=True)
class MTPBoostRunConfig(Config):
    """An MTP boost: `train` (the loop; `train.init_from` is the model, `train.out_dir` where
    the run goes), `data` (the prompts and sequences) and `mtp_boost` (the head, its objective,
    the acceptance measurement), the sections of every stage."""

    WHAT = "mtp-boost config"
    MOVED = _MOVED

    train: MTPBoostTrainConfig = field(default_factory=MTPBoostTrainConfig)
    data: MTPBoostDataConfig = field(default_factory=MTPBoostDataConfig)
    mtp_boost: MTPBoostConfig = field(default_factory=MTPBoostConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MTPBoostRunConfig:
        if isinstance(data, dict) and isinstance(data.get("data"), str):  # the flat key
            raise ValueError(f"data is a section now: data: {data['data']} is data.kind")
        return super().from_dict(data)

    def validate(self) -> MTPBoostRunConfig:
        self.train.validate()
        self.data.validate()
        self.mtp_boost.validate()
        return self


def mtp_boost_loss(
    model: HybridLM,
    ids_BL: torch.Tensor,
    target_mask_BL: torch.Tensor,
    *,
    depth: int,
    mix_true: float,
    distill_weight: float,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    picks: list[torch.Tensor] | None = None,
    num_targets: list[int] | None = None,
    head: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over depths of `(1 - w) * NLL + w * T^2 * KL(p_backbone || q_head)` on the tokens
    whose `target_mask_BL` is set (a target at position j is predicted at depth k from position
    j - k - 1). The backbone runs without gradients; only the MTP head gets them.

    Data parallelism (the token sums of every rank add up to the global mean): `num_targets[k-1]`
    is the depth-k target count of the whole batch (default: this one's), `picks[k-2]` the
    hidden-state mixing draws [B, L] of depth k >= 2 for these rows (default: drawn from
    `generator`), `head` what runs the MTP module (its data-parallel wrapper; default
    `model.mtp`)."""
    if model.mtp is None:
        raise ValueError("the model has no MTP head (mtp.pattern is empty)")
    head = head if head is not None else model.mtp
    _, L = ids_BL.shape
    with torch.no_grad():
        out = model(ids_BL, return_hidden=True)
        ct = torch.promote_types(out.logits.dtype, torch.float32)  # fp32 (fp64 in references)
        h0_BLD, teacher_BLV = out.hidden, out.logits.to(ct)
    ctx = {"positions_L": torch.arange(L, device=ids_BL.device)}
    h_BLD, losses, metrics = h0_BLD, [], {}
    for k in range(1, depth + 1):
        if k >= 2 and mix_true > 0:
            true_BLD = shift_left(h0_BLD, k - 1)  # the backbone's hidden of position t+k-1
            if picks is not None:
                pick_BL = picks[k - 2].to(h_BLD.device)
            else:
                pick_BL = torch.rand(h_BLD.shape[:2], generator=generator, device=h_BLD.device)
            h_BLD = torch.where((pick_BL < mix_true)[..., None], true_BLD, h_BLD)
        emb_BLD = model.embeddings(shift_left(ids_BL, k))
        h_BLD = head(h_BLD, emb_BLD, **ctx)
        valid_BL = shift_left(target_mask_BL, k + 1, False)
        n = max(1, num_targets[k - 1] if num_targets is not None else int(valid_BL.sum()))
        logits_NV = model.lm_head(h_BLD[valid_BL]).to(ct)
        target_N = shift_left(ids_BL, k + 1)[valid_BL]
        nll = F.cross_entropy(logits_NV, target_N, reduction="sum") / n
        t = temperature
        p_NV = torch.softmax(shift_left(teacher_BLV, k)[valid_BL] / t, -1)
        kl = F.kl_div(torch.log_softmax(logits_NV / t, -1), p_NV, reduction="sum") / n * t * t
        losses.append((1 - distill_weight) * nll + distill_weight * kl)
        with torch.no_grad():
            acc = (logits_NV.argmax(-1) == target_N).float().sum() / n
            top1 = (logits_NV.argmax(-1) == p_NV.argmax(-1)).float().sum() / n
        metrics |= {f"nll_{k}": nll.item(), f"kl_{k}": kl.item(), f"acc_{k}": acc.item()}
        metrics[f"agree_{k}"] = top1.item()  # head's argmax == the backbone's (greedy accept)
    loss = torch.stack(losses).mean()
    metrics["loss"] = loss.item()
    return loss, metrics


@torch.no_grad()
def self_generate(
    model: HybridLM,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    gen_len: int,
    temperature: float,
    seed: int,
    max_batch_size: int = 16,
) -> list[list[int]]:
    """The model's own continuations (prompt + generation, EOS kept off) of every prompt."""
    engine = Engine(model, tokenizer, max_batch_size=max_batch_size, prefix_cache_size=0)
    params = [
        SamplingParams(max_tokens=gen_len, temperature=temperature, seed=seed + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = engine.generate(prompts, params)
    return [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]


@torch.no_grad()
def measure_acceptance(
    model: HybridLM,
    prompts: list[list[int]],
    *,
    draft_len: int,
    new_tokens: int,
    temperature: float,
    seed: int = 0,
) -> dict[str, Any]:
    """Speculative decoding of every prompt with the MTP drafter; merged acceptance stats, and
    each prompt's (accepted, drafted) counts per draft position (`by_prompt`), from which a
    report draws confidence intervals by resampling prompts."""
    device = model.embeddings.weight.device
    stats = []
    for i, p in enumerate(prompts):
        x = torch.tensor([p], device=device)
        _, st = speculative_generate(
            model, x, new_tokens, draft_len=draft_len, temperature=temperature, seed=seed + i
        )
        stats.append(st)
    by_prompt = [[list(s.accepted_at), list(s.drafted_at)] for s in stats]
    return {**merge_stats(stats), "prompts": len(stats), "by_prompt": by_prompt}


def _acceptance_rows(
    model: HybridLM, prompts: list[list[int]], run: MTPBoostRunConfig, when: str, step: int
) -> list[dict[str, Any]]:
    """One `acceptance` row per evaluation temperature (`when`: before / after boosting)."""
    rows, cfg = [], run.mtp_boost
    for t in cfg.eval_temperatures:
        m = measure_acceptance(
            model,
            prompts,
            draft_len=cfg.draft_len,
            new_tokens=cfg.eval_new_tokens,
            temperature=t,
            seed=run.train.seed,
        )
        rows.append({"kind": "acceptance", "when": when, "step": step, "temperature": t, **m})
    return rows


class MTPBoost(TrainModule):
    """MTP boosting on the `Trainer` (module docstring): the frozen model's own continuations
    of `train_prompts` are generated once when the stage is built; each step trains `model.mtp`
    on `batch_size` of them (`mtp_boost_loss`). Acceptance on `eval_prompts` is logged before
    the first step and after the last; the boosted model is written to `<out>/model`."""

    stage = "mtp_boost"

    def __init__(
        self,
        rt: Runtime,
        model: HybridLM,
        tokenizer: Any,
        train_prompts: list[list[int]],
        eval_prompts: list[list[int]],
        run: MTPBoostRunConfig,
    ) -> None:
        super().__init__(rt)
        self.model, self.tokenizer, self.run, self.cfg = model, tokenizer, run, run.mtp_boost
        data, seed = run.data, run.train.seed
        self.eval_prompts = eval_prompts
        self.total_steps = run.train.max_steps
        self.depth = self.cfg.depth or self.cfg.draft_len
        model.eval()
        t0 = time.perf_counter()
        prompts = [train_prompts[i % len(train_prompts)] for i in range(data.num_sequences)]
        seqs = None
        if data.kind == "text":  # the windows are the sequences; every token after the first
            seqs, prompts = prompts, [p[:1] for p in prompts]
        elif rt.rank == 0:  # data parallelism: one rank generates, every rank trains on them
            seqs = self_generate(
                model,
                tokenizer,
                prompts,
                gen_len=data.gen_len,
                temperature=data.gen_temperature,
                seed=seed,
            )
        seqs = broadcast_object(seqs)
        self.generation_s = time.perf_counter() - t0
        device = model.embeddings.weight.device
        self.ids_NL, valid_NL = _pad_rows(seqs, device)
        # targets: the generated tokens only
        self.mask_NL = _from_position(valid_NL, [len(p) for p in prompts])
        self.head_rows = self._init_head(model, self.cfg, valid_NL, seed)
        # only the head is trained: the embeddings and LM head it shares stay fixed (Nemotron 3
        # Super §4.7); the Trainer's AdamW sees the parameters that require grad
        model.requires_grad_(False)
        model.mtp.requires_grad_(True)
        # the run directory loads with its tokenizer (`hybridlm.io.load` reads data.tokenizer)
        self.tokenizer_spec = "byte"
        if not isinstance(tokenizer, ByteTokenizer) and hasattr(tokenizer, "save"):
            path = rt.out / "tokenizer"
            if rt.rank == 0:
                tokenizer.save(path)
            self.tokenizer_spec = str(path.resolve())
        self.mixing = torch.Generator(device=device).manual_seed(seed)  # hidden-state mixing
        self.order = random.Random(seed)  # the order sequences are drawn in
        self.pending: list[int] = []  # the rest of the current pass over the sequences
        self.train_s, self._t0 = 0.0, None

    def _init_head(
        self, model: HybridLM, cfg: MTPBoostConfig, valid_NL: torch.Tensor, seed: int
    ) -> list[dict[str, Any]]:
        """Give the model its one shared head (`cfg.init`, calibrated on the generated
        sequences); `agreement` rows of the incoming heads and of the initialised one:
        teacher-forced greedy acceptance on the held-out prompts' greedy continuations
        (`mtp_init.head_agreement`), the one measure that per-depth heads, which cannot draft,
        share with the shared head."""
        device = model.embeddings.weight.device
        greedy = broadcast_object(
            self_generate(
                model,
                self.tokenizer,
                self.eval_prompts,
                gen_len=cfg.eval_new_tokens,
                temperature=0.0,
                seed=seed,
            )
            if self.rt.rank == 0
            else None
        )
        held_ids, held_valid = _pad_rows(greedy, device)
        # positions from the prompt's last on: each predicts a greedy output token
        firsts = [len(p) - 1 for p in self.eval_prompts]
        held = self.held_rows = (held_ids, _from_position(held_valid, firsts))
        depth = min(self.depth, model.config.mtp.depth) if model.mtp_depths else self.depth
        rows = [
            {"kind": "agreement", "when": "source", **head_agreement(model, *held, depth=depth)}
        ]
        fit = init_head(
            model,
            cfg.init,
            self.ids_NL,
            valid_NL,
            consolidate=cfg.consolidate,
            ridge=cfg.fuse_ridge,
            seed=seed,
        )
        if cfg.init != "keep":
            agree = head_agreement(model, *held, depth=self.depth)
            rows.append({"kind": "agreement", "when": "init", "init": cfg.init, **agree, **fit})
        return rows

    def trained_module(self) -> torch.nn.Module:
        return self.model.mtp

    def prepare_step(self, step: int) -> Step:
        """The step's global batch of `batch_size * world` sequences (every rank draws the same
        ones), its target counts per depth and hidden-state mixing draws; this rank's rows."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        B, N = self.run.data.batch_size * self.rt.world_size, len(self.ids_NL)
        while len(self.pending) < B:  # a new random pass over the sequences
            self.pending += self.order.sample(range(N), N)
        idx, self.pending = self.pending[:B], self.pending[B:]
        ids_BL, mask_BL = self.ids_NL[idx], self.mask_NL[idx]
        counts = [int(shift_left(mask_BL, k + 1, False).sum()) for k in range(1, self.depth + 1)]
        picks = []
        if self.cfg.mix_true > 0:  # depth >= 2 mixes true and recursive hidden states
            shape = ids_BL.shape
            picks = [
                torch.rand(shape, generator=self.mixing, device=ids_BL.device)
                for _ in range(2, self.depth + 1)
            ]
        rows = self.rt.share(list(range(B)))
        micro = (ids_BL[rows], mask_BL[rows], [p[rows] for p in picks])
        return Step([micro], ctx={"num_targets": counts})

    def loss(
        self, micro: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]], step: Step
    ) -> Loss:
        ids_BL, mask_BL, picks = micro
        value, metrics = mtp_boost_loss(
            self.model,
            ids_BL,
            mask_BL,
            depth=self.depth,
            mix_true=self.cfg.mix_true,
            distill_weight=self.cfg.distill_weight,
            temperature=self.cfg.distill_temperature,
            picks=picks,
            num_targets=step.ctx["num_targets"],
            head=self.forward_model,
        )
        return Loss(value, metrics)

    def callbacks(self) -> list[Callback]:
        return [
            StartRows(self.start_rows),
            Throughput(),
            Close(self.close),
            EndRows(self.end_rows),
            Export(self.export),
            Plot(self.plot),
            Summary(self.summary),
        ]

    def start_rows(self) -> list[dict[str, Any]]:
        """The incoming head's agreement and the acceptance before boosting."""
        rows = [{**r, "step": 0} for r in self.head_rows]
        return rows + _acceptance_rows(self.model, self.eval_prompts, self.run, "before", 0)

    def end_rows(self) -> list[dict[str, Any]]:
        """The head's agreement and the acceptance after boosting."""
        if self._t0 is not None:
            self.train_s = time.perf_counter() - self._t0
        if any(r["when"] == "after" for r in metric_rows(self.rt.metrics_path, "acceptance")):
            return []  # a finished run resumed: measured already (a resume drops later rows)
        self.model.eval()
        agree = head_agreement(self.model, *self.held_rows, depth=self.depth)
        rows = [{"kind": "agreement", "when": "after", "step": self.total_steps, **agree}]
        return rows + _acceptance_rows(
            self.model, self.eval_prompts, self.run, "after", self.total_steps
        )

    def close(self) -> None:
        """The model as it came: every parameter trainable, in eval mode."""
        self.model.requires_grad_(True)
        self.model.eval()

    def state_dict(self) -> dict[str, Any]:
        # the draw order and the mixing generator, for an exact resume
        version, state, gauss = self.order.getstate()
        return {
            "boost_data": {
                "order": [version, list(state), gauss],
                "pending": list(self.pending),
                "mixing": self.mixing.get_state().tolist(),
            }
        }

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        data = meta["boost_data"]
        version, state, gauss = data["order"]
        self.order.setstate((version, tuple(state), gauss))
        self.pending = list(data["pending"])
        self.mixing.set_state(torch.tensor(data["mixing"], dtype=torch.uint8))

    def run_config(self) -> dict[str, Any]:
        # data.tokenizer: the tokenizer the run directory loads with (`hybridlm.io.load`)
        run = self.run.to_dict()
        return {**run, "model": self.model.config.to_dict()} | {
            "data": {**run["data"], "tokenizer": self.tokenizer_spec}
        }

    def export(self) -> Path:
        path = self.rt.out / "model"
        save_pretrained(self.model, path, tokenizer=self.tokenizer)
        return path

    def plot(self, metrics_path: Path) -> Path:
        png = self.rt.out / "acceptance.png"
        plot_acceptance(metrics_path, png)
        return png

    def summary(self) -> dict[str, Any]:
        return {
            "generation_s": self.generation_s,
            "train_s": self.train_s,
            "sequences": len(self.ids_NL),
        }


def _pad_rows(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-padded into [N, L] ids and the mask of real tokens."""
    L = max(len(s) for s in seqs)
    ids_NL = torch.zeros(len(seqs), L, dtype=torch.long)
    valid_NL = torch.zeros(len(seqs), L, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids_NL[i, : len(s)] = torch.tensor(s)
        valid_NL[i, : len(s)] = True
    return ids_NL.to(device), valid_NL.to(device)


def _from_position(valid_NL: torch.Tensor, firsts: list[int]) -> torch.Tensor:
    """`valid_NL` from position `firsts[i]` of row i on."""
    firsts_N1 = torch.tensor(firsts, device=valid_NL.device)[:, None]
    return valid_NL & (torch.arange(valid_NL.shape[1], device=valid_NL.device)[None] >= firsts_N1)


def _check_inputs(
    model: HybridLM, train_prompts: list, eval_prompts: list, cfg: MTPBoostConfig
) -> None:
    if model.mtp is None:
        raise ValueError("the model has no MTP head (mtp.pattern is empty): nothing to boost")
    if model.mtp_depths is not None and cfg.init == "keep":
        raise ValueError(
            "the model has per-depth MTP heads (mtp.shared: false) and the boost trains one "
            "shared head: set mtp_boost.init to consolidate, fuse or random"
        )
    if not train_prompts or not eval_prompts:
        raise ValueError("need at least one training prompt and one evaluation prompt")


def mtp_boost_trainer(
    model: HybridLM,
    tokenizer: Any,
    train_prompts: list[list[int]],
    eval_prompts: list[list[int]],
    cfg: MTPBoostRunConfig,
    *,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> Trainer:
    """The `Trainer` of an MTP boost of `model` (in place) under `cfg.train.out_dir`, ready to
    `train()`; `resume` / `overwrite` as for every run on the Trainer."""
    cfg.validate()
    _check_inputs(model, train_prompts, eval_prompts, cfg.mtp_boost)
    tc = dataclasses.replace(
        cfg.train,
        device=str(model.embeddings.weight.device),
        progress=cfg.train.progress and progress,
    )
    trainer = Trainer(
        tc,
        lambda rt: MTPBoost(rt, model, tokenizer, train_prompts, eval_prompts, cfg),
        resume=resume,
        overwrite=overwrite,
    )
    if is_main():
        cfg.save(trainer.out / "mtp_boost.yaml")
    return trainer


def run_mtp_boost(
    model: HybridLM,
    tokenizer: Any,
    train_prompts: list[list[int]],
    eval_prompts: list[list[int]],
    cfg: MTPBoostRunConfig,
    *,
    progress: bool = True,
    overwrite: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Boost the MTP head of `model` in place; writes `metrics.jsonl`, `acceptance.png`, the
    final checkpoint and the boosted model (`model/`, a transformers directory) under
    `cfg.train.out_dir`, which may hold an earlier run only with `overwrite=True` (it is
    removed) or `resume=True` (it is continued from its newest checkpoint). Returns the summary:
    acceptance rows `before` / `after`, the `first` / `last` logged train rows."""
    trainer = mtp_boost_trainer(
        model,
        tokenizer,
        train_prompts,
        eval_prompts,
        cfg,
        progress=progress,
        resume=resume,
        overwrite=overwrite,
    )
    res = trainer.train()
    if not is_main():  # under torchrun rank 0 wrote the metrics and reports
        return res
    # the result is read back from metrics.jsonl (DESIGN habit 15)
    train = metric_rows(res["metrics"], "train")
    acc = metric_rows(res["metrics"], "acceptance")
    return {
        "before": [r for r in acc if r["when"] == "before"],
        "after": [r for r in acc if r["when"] == "after"],
        "first": train[0],
        "last": train[-1],
        "generation_s": res["generation_s"],
        "train_s": res["train_s"],
        "sequences": res["sequences"],
        "metrics": res["metrics"],
        "plot": res["plot"],
        "model": res["hf"],
    }


def plot_acceptance(metrics_path: str | Path, png: str | Path) -> None:
    """Acceptance by draft position before/after (one panel per temperature) and the loss."""

    plt = pyplot()

    acc = metric_rows(metrics_path, "acceptance")
    train = metric_rows(metrics_path, "train")  # step: optimizer steps done (the Trainer's rows)
    temps = sorted({r["temperature"] for r in acc})
    fig, axes = plt.subplots(1, len(temps) + 1, figsize=(4.2 * (len(temps) + 1), 3.4))
    for ax, t in zip(axes, temps, strict=False):
        for r in (r for r in acc if r["temperature"] == t):
            pos = list(range(1, len(r["acceptance_by_position"]) + 1))
            label = f"{r['when']} (AL {r['acceptance_length']:.2f})"
            ax.plot(pos, r["acceptance_by_position"], marker="o", label=label)
        ax.set(title=f"T={t:g}", xlabel="draft position", ylabel="accepted fraction", ylim=(0, 1))
        ax.set_xticks(range(1, max(len(r["acceptance_by_position"]) for r in acc) + 1))
        ax.legend()
    ax = axes[-1]
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="loss")
        for k in range(1, 9):
            if f"kl_{k}" in train[0]:
                ax.plot([r["step"] for r in train], [r[f"kl_{k}"] for r in train], label=f"KL d{k}")
        ax.set(title="MTP boosting", xlabel="step")
        ax.legend()
    save_figure(fig, png)


# ---------------------------------------------------------------------- prompts
def prompts_from_checkpoint(
    path: str | None,
    tokenizer: Any,
    *,
    n_train: int,
    n_eval: int,
    prompt_len: int,
    seed: int,
    train_len: int = 0,
) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts from the data the checkpoint was trained on (`run_data.training_data`), split
    into boosting prompts and held-out evaluation prompts (every 5th document or conversation,
    by a hash of its id or prompt):

    - pretraining text (the sources of a pretraining run; the embedded stdlib corpus when the
      run has none or there is no run): a window of `prompt_len` tokens of each document;
    - chat sources (an SFT, distillation or QAD run): each conversation up to its last assistant
      turn, rendered with the generation prompt, whole (what the model answers when served).

    `train_len` > 0 (`data: text`): the boosting windows are that long instead, up to 4
    disjoint ones per document (a conversation rendered whole is one document)."""
    data = None
    if path is not None:
        fix = (
            "set data.prompts to an RL environment kind instead, e.g. "
            "--set data.prompts=sft_arithmetic"
        )
        data = training_data(path, fix=fix)
    if isinstance(data, SFTDataConfig):
        convs = _conversations(data)
        if not train_len:
            return _chat_prompts(convs, tokenizer, n_train=n_train, n_eval=n_eval)
        docs: Iterable[tuple[str, str]] = (
            (prompt_key(c), render(c, add_generation_prompt=False)) for c in convs
        )
    else:
        sources = [SourceConfig(name="stdlib", kind="stdlib")]
        if data is not None:  # shard directories hold token ids, not text to draw prompts from
            sources = [s for s in data.sources if s.kind != "shards"] or sources
        docs = ((doc.id, doc.text) for src in sources for doc in build_source(src))
    rng = random.Random(seed)
    train, held = [], []
    for doc_id, text in docs:
        ids = tokenizer.encode(text, add_bos=False)
        pool = held if zlib.crc32(doc_id.encode()) % 5 == 0 else train
        n = train_len if train_len and pool is train else prompt_len
        if len(ids) < 2 * n:
            continue
        starts = [rng.randrange(0, len(ids) - n)]
        if n == train_len:  # disjoint windows from a random offset
            offset = rng.randrange(0, n)
            starts = list(range(offset, len(ids) - n, n))[:4]
        for start in starts:
            if len(pool) < (n_eval if pool is held else n_train):
                pool.append([tokenizer.bos_id, *ids[start : start + n - 1]])
        if len(train) >= n_train and len(held) >= n_eval:
            return train, held
    if not train or not held:
        raise ValueError(
            "the training data has too few documents long enough for prompts (at least twice "
            f"{prompt_len} tokens, and {train_len} for the boosting windows): set prompt_len "
            "(and gen_len) lower"
            if train_len
            else "the training data has too few documents long enough for prompts (at least "
            f"twice {prompt_len} tokens): set prompt_len lower"
        )
    return train, held


def _conversations(data: SFTDataConfig) -> list[Conversation]:
    """The conversations of a chat data config's sources (their bad rows skipped)."""
    report = ReadReport()
    convs = [c for src in data.sources for c in load_source(src, report)]
    if not convs:
        raise ValueError(f"the run's chat sources hold no usable conversation ({report.summary()})")
    return convs


def _chat_prompts(
    convs: list[Conversation], tokenizer: Any, *, n_train: int, n_eval: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Each distinct prompt (the messages before the last assistant turn) rendered with the
    generation prompt and tokenised as `hybridlm sft` evaluates it; a prompt's hash puts it in
    the held-out fifth or not, so a repeated question (generated sets repeat them) never lands
    on both sides."""
    train: list[list[int]] = []
    held: list[list[int]] = []
    seen = set()
    for conv in convs:
        prompt = prompt_of(conv)
        key = prompt_key(conv)
        if not prompt or key in seen:
            continue
        seen.add(key)
        pool, cap = (held, n_eval) if zlib.crc32(key.encode()) % 5 == 0 else (train, n_train)
        if len(pool) < cap:
            pool.append(tokenizer.encode(render(prompt, add_generation_prompt=True)))
        if len(train) >= n_train and len(held) >= n_eval:
            break
    if not train or not held:
        raise ValueError(
            f"the run's chat sources give {len(seen)} distinct prompt(s): too few for both "
            "boosting and held-out prompts"
        )
    return train, held


def boost_checkpoint(
    cfg: MTPBoostRunConfig,
    *,
    progress: bool = True,
    overwrite: bool = False,
    resume: bool = False,
    environment_prompts: Callable[..., tuple[list[list[int]], list[list[int]]]] | None = None,
) -> dict[str, Any]:
    """Boost the MTP head of the model at `cfg.train.init_from` (run, training checkpoint or
    transformers directory) with its own tokenizer, on prompts from its training data
    (`data.prompts: data`, `prompts_from_checkpoint`: pretraining text or an SFT run's chat
    prompts) or from an RL environment (`data.prompts` names its kind;
    `environment_prompts(kind, tokenizer, n_train=, n_eval=, seed=)` makes them,
    `rl.env_config.environment_prompts`); writes under `cfg.train.out_dir` as `run_mtp_boost`
    does (`overwrite`, `resume` as there)."""
    cfg.validate()
    checkpoint, data, seed = cfg.train.init_from, cfg.data, cfg.train.seed
    if not checkpoint:
        raise ValueError("the MTP boost needs a model: set train.init_from (or --checkpoint)")
    torch.manual_seed(seed)
    loaded = load(checkpoint, setting="train.init_from")
    model, tok = loaded.model.float(), loaded.tokenizer
    if data.prompts == "data":
        train, held = prompts_from_checkpoint(
            str(checkpoint),
            tok,
            n_train=data.num_sequences,
            n_eval=data.eval_prompts,
            prompt_len=data.prompt_len,
            train_len=data.prompt_len + data.gen_len if data.kind == "text" else 0,
            seed=seed,
        )
    else:  # the RL environment's prompts (healing after RL, Nemotron 3 Super §4.7)
        if environment_prompts is None:
            raise ValueError(
                f"mtp boost prompts {data.prompts!r} name an RL environment: pass "
                "environment_prompts (rl.env_config.environment_prompts)"
            )
        train, held = environment_prompts(
            data.prompts, tok, n_train=data.num_sequences, n_eval=data.eval_prompts, seed=seed
        )
    res = run_mtp_boost(
        model, tok, train, held, cfg, progress=progress, overwrite=overwrite, resume=resume
    )
    return {**res, "eval_prompts": len(held)}
