"""Supervised fine-tuning: `run_sft(cfg)` and `hybridlm sft`.

Shape legend: B rows, L `data.seq_len`, V vocabulary.

A run is one YAML file with four sections (`configs/sft.yaml`):

    model: tiny-super          # used only when train.init_from is empty (a fresh model)
    data: {...}                # SFTDataConfig: chat sources, tokenizer, packing, reasoning modes
    train: {...}               # hybridlm.train.config.TrainConfig (optimizer, schedule, loop)
    sft: {...}                 # SFTConfig: init checkpoint, loss normalisation, MTP weight, eval

Per optimizer step: `train.grad_accum` packed micro-batches (`hybridlm.data.sft.SFTLoader`);
the loss is assistant-only CE with `token` or `sample` normalisation over the whole step
(`train.objectives`), switched from token to sample at `sft.stage2_start` of the steps with
`loss_norm: two_stage` (Nemotron 3 Super §4.2), plus the MTP loss (weight 0.3, the mean of the
depths, each depth's targets weighted like the next-token ones and never crossing a packed
conversation) and the MoE balancing loss. Optimizer, LR schedule, checkpoints (exact resume:
weights, optimizer, loader position, RNG) and `metrics.jsonl` are the pretraining ones
(`train.optim`, `train.schedule`, `train.checkpoint`). The final weights are also written as a
transformers directory `<out>/hf` with the tokenizer, chat template and generation config (the
SFT, DPO and distillation runs alike: `PostTrainingLoop.export_hf`).

Evaluation (`eval_interval`, at step 0 and at the end): held-out assistant-token NLL, and exact
match of the final answers that the model generates greedily for `sft.eval_generate` held-out
prompts (the content of the last assistant turn, compared after stripping whitespace). The
held-out conversations are drawn before the reasoning-mode transforms, and every training
conversation with the same prompt as a held-out one is removed (generated sets repeat
questions). `train.precision: bf16` runs the forwards under autocast (fp32 master weights).
Runs are single-process; the loss is already normalised by global counts, so data parallelism
only needs the counts all-reduced over ranks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..config import Config, ModelConfig
from ..data.chat import STOP, parse_assistant, render
from ..data.sft import (
    ChatExample,
    Conversation,
    ReadReport,
    ReasoningModes,
    SFTLoader,
    apply_reasoning_modes,
    arithmetic_conversations,
    gsm8k_conversations,
    read_conversations,
    tokenize_conversations,
)
from ..infer.generate import generate
from ..interop.hf import save_pretrained, to_hf_config
from ..model.model import HybridLM
from ..presets import PRESETS, get_preset
from .config import TrainConfig
from .objectives import sft_token_weights, shift_targets_float, token_nll
from .parallel import is_main
from .trainer import (
    Loss,
    Runtime,
    Step,
    Trainer,
    TrainModule,
    check_tokenizer,
    initial_model,
    run_tokenizer,
)

LossNorm = Literal["token", "sample", "two_stage"]


# ---------------------------------------------------------------------------- configs
@dataclass(kw_only=True)
class ChatSource:
    """One source of conversations. `kind`: `file` (JSONL / Parquet / saved HF dataset at
    `path`), `hf` (a hub dataset name at `path`, `split`), `gsm8k` (GSM8K JSONL at `path`, the
    packaged train split when empty; the worked solution as the reasoning trace) or
    `arithmetic` (`max_rows` generated questions with `digits` digits, from `seed`).
    `max_rows`: 0 = all rows."""

    kind: Literal["file", "hf", "gsm8k", "arithmetic"] = "file"
    path: str = ""
    split: str = "train"
    messages_field: str = "messages"
    max_rows: int = 0
    digits: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind in ("file", "hf") and not self.path:
            raise ValueError(f"a chat source of kind {self.kind!r} needs a path")
        if self.kind == "arithmetic" and self.max_rows <= 0:
            raise ValueError("an arithmetic chat source needs max_rows > 0 (how many to generate)")
        if self.max_rows < 0 or self.digits < 1:
            raise ValueError("chat source max_rows must be >= 0 and digits >= 1")


@dataclass(kw_only=True)
class SFTDataConfig:
    """Chat data: sources, tokenizer ("byte", a tokenizer directory, or "" for the tokenizer of
    the model the run starts from: `trainer.run_tokenizer`), packing, held-out split
    (`held_out` conversations drawn with `seed` before any transform) and reasoning modes."""

    sources: list[ChatSource] = field(default_factory=list)
    tokenizer: str = ""  # "": the starting model's (train.init_from), byte for a fresh model
    seq_len: int = 512
    batch_size: int = 8
    overflow: Literal["drop", "truncate"] = "drop"
    held_out: int = 64
    seed: int = 0
    reasoning: ReasoningModes = field(default_factory=ReasoningModes)

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.batch_size < 1 or self.held_out < 0:
            raise ValueError("data.seq_len >= 2, data.batch_size >= 1 and data.held_out >= 0")


@dataclass(kw_only=True)
class SFTConfig:
    """The SFT objective and its evaluation."""

    loss_norm: LossNorm = "two_stage"
    stage2_start: float = 0.7  # two_stage: fraction of the steps run with token normalisation
    mtp_weight: float = 0.3  # Nemotron 3 Super §4.2: MTP continues in SFT with weight 0.3
    mtp_depth: int = -1  # -1: the model's mtp.depth
    eval_generate: int = 32  # held-out prompts answered greedily for exact match (0: none)
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.loss_norm not in ("token", "sample", "two_stage"):
            raise ValueError(f"sft.loss_norm must be token, sample or two_stage: {self.loss_norm}")
        if not 0 <= self.stage2_start <= 1:
            raise ValueError(f"sft.stage2_start must be in [0, 1], got {self.stage2_start}")
        if self.mtp_weight < 0 or self.eval_generate < 0 or self.max_new_tokens < 1:
            raise ValueError("sft.mtp_weight, eval_generate >= 0 and max_new_tokens >= 1")

    def norm_at(self, step: int, total_steps: int) -> str:
        """The loss normalisation of optimizer step `step` (0-based)."""
        if self.loss_norm != "two_stage":
            return self.loss_norm
        return "token" if step < round(self.stage2_start * total_steps) else "sample"


class PostTrainingRunConfig(Config):
    """A post-training run (SFT, DPO, distillation): `model` (DPO: none), `train` and the stage's
    own sections, declared as fields by the subclasses; `REQUIRED` names those a file must give."""

    EXPAND = {"model": get_preset}

    def __post_init__(self) -> None:
        model = getattr(self, "model", None)
        if isinstance(model, str) and model not in PRESETS:
            raise ValueError(f"model {model!r} is not a preset; use one of {sorted(PRESETS)}")


@dataclass(kw_only=True)
class SFTRunConfig(PostTrainingRunConfig):
    WHAT = "SFT run config"

    model: ModelConfig | str = "tiny-super"
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


def load_source(src: ChatSource, report: ReadReport) -> list[Conversation]:
    """The conversations of one `ChatSource` (bad rows counted in `report`)."""
    limit = src.max_rows or None
    if src.kind == "arithmetic":
        convs = arithmetic_conversations(src.max_rows, seed=src.seed, digits=src.digits)
        report.rows += len(convs)
        report.kept += len(convs)
        return convs
    if src.kind == "gsm8k":
        if src.path and not Path(src.path).is_file():
            raise ValueError(f"GSM8K file not found: {src.path}")
        convs = gsm8k_conversations(src.path or None, max_rows=limit)
        report.rows += len(convs)
        report.kept += len(convs)
        return convs
    kind = "hf" if src.kind == "hf" else "auto"
    return list(
        read_conversations(
            src.path,
            kind=kind,
            split=src.split,
            messages_field=src.messages_field,
            max_rows=limit,
            report=report,
        )
    )


def prompt_key(conv: Conversation) -> str:
    """The prompt of a conversation (messages before its last assistant turn) as a string key."""
    last = max((i for i, m in enumerate(conv) if m.get("role") == "assistant"), default=len(conv))
    return json.dumps(conv[:last], sort_keys=True, ensure_ascii=False)


def split_held_out(
    convs: list[Conversation], n: int, seed: int
) -> tuple[list[Conversation], list[Conversation], int]:
    """(train, held-out, removed): `n` conversations drawn with `seed`; the rest in their order,
    minus every conversation whose prompt equals a held-out prompt (exact decontamination:
    generated sets repeat questions), whose number is `removed`."""
    if n == 0:
        return convs, [], 0
    if n >= len(convs):
        raise ValueError(f"held_out={n} leaves no training data ({len(convs)} conversations)")
    held = set(np.random.default_rng([seed, 5]).choice(len(convs), n, replace=False).tolist())
    held_keys = {prompt_key(convs[i]) for i in held}
    train = [c for i, c in enumerate(convs) if i not in held]
    clean = [c for c in train if prompt_key(c) not in held_keys]
    return clean, [convs[i] for i in sorted(held)], len(train) - len(clean)


def prompt_and_answer(conv: Conversation) -> tuple[Conversation, str]:
    """The messages before the last assistant turn, and that turn's content."""
    last = max(i for i, m in enumerate(conv) if m.get("role") == "assistant")
    return conv[:last], str(conv[last].get("content") or "")


@torch.no_grad()
def generate_replies(
    model: HybridLM,
    tokenizer: Any,
    prompts: Sequence[Sequence[dict[str, Any]]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 32,
) -> list[str]:
    """The assistant reply (text up to `<|im_end|>`) of `model` to each conversation prompt;
    greedy by default. Prompts are batched with left padding."""

    device = next(model.parameters()).device
    stop_id = tokenizer.token_to_id(STOP) if hasattr(tokenizer, "token_to_id") else None
    replies: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        encoded = [tokenizer.encode(render(p, add_generation_prompt=True)) for p in chunk]
        width = max(len(e) for e in encoded)
        ids_BL = torch.zeros(len(encoded), width, dtype=torch.long)
        mask_BL = torch.zeros(len(encoded), width, dtype=torch.long)
        for b, e in enumerate(encoded):
            ids_BL[b, width - len(e) :] = torch.tensor(e)
            mask_BL[b, width - len(e) :] = 1
        out_BN = generate(
            model,
            ids_BL.to(device),
            max_new_tokens,
            temperature=temperature,
            eos_id=stop_id,
            seed=seed + i,
            attention_mask=mask_BL.to(device),
        )
        for row in out_BN.tolist():
            text = tokenizer.decode(row)
            replies.append(text.split(STOP, 1)[0])
    return replies


def answer_matches(reply: str, expected: str) -> bool:
    """Exact match of a reply's content (reasoning stripped) with the expected answer."""
    got = parse_assistant(reply).get("content") or ""
    return got.strip() == expected.strip()


def progress_bar(label: str, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        disable=not enabled,
    )


# ---------------------------------------------------------------------------- the trainer
@dataclass(kw_only=True)
class ChatData:
    """An SFT data config read, split, transformed and tokenised."""

    examples: list[ChatExample]  # training conversations (reasoning modes applied)
    train_convs: list[Conversation]  # the same, as conversations
    held_convs: list[Conversation]  # held-out conversations (their prompts kept out of training)
    held_examples: list[ChatExample]
    read_report: ReadReport
    mode_counts: dict[str, int]
    dropped: dict[str, int]


def pad_id_of(tokenizer: Any) -> int:
    return getattr(tokenizer, "pad_id", None) or 0


def prepare_chat_data(dc: SFTDataConfig, tokenizer: Any) -> ChatData:
    """Read the chat sources, hold out `held_out` conversations (and every training conversation
    with a held-out prompt), apply the reasoning modes and tokenise with the assistant mask."""
    if not dc.sources:
        raise ValueError("data.sources is empty: give at least one chat source")
    report = ReadReport()
    convs: list[Conversation] = []
    for src in dc.sources:
        convs += load_source(src, report)
    if not convs:
        raise ValueError(f"no usable conversations ({report.summary()})")
    train_convs, held_convs, decontaminated = split_held_out(convs, dc.held_out, dc.seed)
    train_convs, mode_counts = apply_reasoning_modes(train_convs, dc.reasoning, tokenizer)
    tok = tokenize_conversations(train_convs, tokenizer, max_len=dc.seq_len, overflow=dc.overflow)
    if not tok.examples:
        raise ValueError(f"no conversation fits data.seq_len={dc.seq_len} ({tok.dropped})")
    dropped = dict(tok.dropped)
    if decontaminated:
        dropped["prompt of a held-out conversation"] = decontaminated
    held = tokenize_conversations(held_convs, tokenizer, max_len=dc.seq_len, overflow="truncate")
    return ChatData(
        examples=list(tok.examples),
        train_convs=train_convs,
        held_convs=held_convs,
        held_examples=list(held.examples),
        read_report=report,
        mode_counts=dict(mode_counts),
        dropped=dropped,
    )


def chat_batches(dc: SFTDataConfig, num_rows: int, tokenizer: Any) -> list[dict[str, torch.Tensor]]:
    """About `num_rows` packed rows of an SFT data config's training conversations in
    `tokenizer`'s ids (the model's), e.g. to calibrate post-training quantisation on the
    post-training data (Nemotron 3 Super calibrates its NVFP4 checkpoint on 256 samples of the
    SFT set)."""

    data = prepare_chat_data(dc, tokenizer)
    loader = SFTLoader(
        data.examples,
        seq_len=dc.seq_len,
        batch_size=dc.batch_size,
        seed=dc.seed + 1,  # other rows than the run's first steps
        pad_id=pad_id_of(tokenizer),
    )
    return [next(loader) for _ in range(max(1, -(-num_rows // dc.batch_size)))]


def export_hf(model: HybridLM, out: Path, tokenizer: Any, stage: str) -> Path | None:
    """`<out>/hf`: the final weights as a transformers directory with the run's tokenizer,
    chat template and generation config (as `hybridlm pretrain` writes); None, with a note,
    for a model transformers has no class for."""

    try:
        to_hf_config(model.config)
    except ValueError as err:
        print(f"{stage}: no transformers export ({err})")
        return None
    return save_pretrained(model, out / "hf", tokenizer=tokenizer)


class SFT(TrainModule):
    """Chat data, assistant-only CE (+ MTP, MoE balancing), held-out NLL and exact match."""

    stage = "sft"
    plot_train = ("loss", "nll_token", "mtp")
    plot_eval = ("eval_loss", "eval_accuracy")
    rate_key = "tokens_per_s"

    @property
    def units_per_step(self) -> int:
        return self.tokens_per_step

    def progress_info(self, row: dict[str, Any]) -> str:
        return f"{row['norm']} loss {row['loss']:.3f} nll/tok {row['nll_token']:.3f}"

    def __init__(self, run: SFTRunConfig, rt: Runtime) -> None:

        super().__init__(rt)
        self.run = run
        tc, dc, sc = run.train, run.data, run.sft
        self.tc, self.dc, self.sc = tc, dc, sc
        self.device = rt.device
        self.tokenizer = run_tokenizer(dc, tc)

        # data: read, hold out, transform, tokenise
        data = prepare_chat_data(dc, self.tokenizer)
        self.read_report, self.held_convs = data.read_report, data.held_convs
        self.train_convs = data.train_convs
        self.mode_counts, self.dropped = data.mode_counts, data.dropped
        self.held_examples = data.held_examples
        # data parallelism: every rank packs the global batch of world * batch_size rows, each
        # trains on its own rows (Runtime.shard), the loss normalised by the global counts
        self.loader = SFTLoader(
            data.examples,
            seq_len=dc.seq_len,
            batch_size=dc.batch_size * rt.world_size,
            seed=dc.seed,
            pad_id=pad_id_of(self.tokenizer),
        )
        self.tokens_per_step = dc.batch_size * rt.world_size * dc.seq_len * tc.grad_accum
        self.total_steps = tc.num_steps(self.tokens_per_step)

        # model
        self.model = initial_model(tc, run.model, self.device)
        self.model_cfg = self.model.config
        check_tokenizer(self.tokenizer, self.model, "train.init_from" if tc.init_from else "model")
        self.mtp_depth = self.model_cfg.mtp.depth if sc.mtp_depth < 0 else sc.mtp_depth
        if self.model.mtp is None:
            self.mtp_depth = 0
        self.step = 0  # steps whose data was read

    # ------------------------------------------------------------------ one step
    def prepare_step(self, step: int) -> Step:
        norm = self.sc.norm_at(step, self.total_steps)
        batches = [next(self.loader) for _ in range(self.tc.grad_accum)]
        self.step = step + 1
        n_tok = sum(int(b["num_loss_tokens"]) for b in batches)
        n_conv = sum(int(b["num_conversations"]) for b in batches)
        return Step(
            [self.rt.shard(b) for b in batches],
            ctx={"norm": norm, "num_tokens": n_tok, "num_convs": n_conv},
            info={"norm": norm, "loss_tokens": n_tok, "conversations": n_conv},
        )

    def loss(self, micro: dict[str, torch.Tensor], step: Step) -> Loss:
        """This micro-batch's share of the step's loss and its parts (module docstring)."""
        dev = self.device
        norm, num_tokens = step.ctx["norm"], step.ctx["num_tokens"]
        ids_BL, labels_BL = micro["input_ids"].to(dev), micro["labels"].to(dev)
        doc_BL = micro["doc_ids"].to(dev)
        with self.rt.autocast():
            out = self.forward_model(
                ids_BL, doc_ids=doc_BL, mtp_depth=self.mtp_depth, return_logits=True
            )
        w_BL = sft_token_weights(
            labels_BL,
            micro["conv_ids"].to(dev),
            mode=norm,
            num_tokens=num_tokens,
            num_conversations=step.ctx["num_convs"],
        )
        mask_BL = (labels_BL != -100).float()
        nll_BL = token_nll(out.logits, labels_BL, 1)
        ce = (nll_BL * shift_targets_float(w_BL, 1)).sum()
        metrics = {
            "ce": float(ce.detach()),
            # the token-mean NLL of the step whatever the normalisation: comparable across stages
            "nll_token": float((nll_BL.detach() * shift_targets_float(mask_BL, 1)).sum())
            / max(1, num_tokens),
        }
        value = ce
        if self.mtp_depth > 0:
            mtp_terms = []
            for k, logits_k in enumerate(out.mtp_logits, start=1):
                nll_k = token_nll(logits_k, labels_BL, k + 1)
                w_k = shift_targets_float(w_BL, k + 1)
                same = torch.zeros_like(w_k, dtype=torch.bool)
                same[:, : -(k + 1)] = doc_BL[:, : -(k + 1)] == doc_BL[:, k + 1 :]
                mtp_terms.append((nll_k * w_k * same).sum())
            mtp = torch.stack(mtp_terms).mean()
            value = value + self.sc.mtp_weight * mtp
            metrics["mtp"] = float(mtp.detach())
        return moe_balancing(value, metrics, out, self.tc.grad_accum)

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out assistant-token NLL and greedy exact match."""
        if not self.held_examples:
            return {}
        self.model.eval()
        try:
            loader = SFTLoader(
                self.held_examples,
                seq_len=self.dc.seq_len,
                batch_size=self.dc.batch_size,
                sequential=True,
            )
            nats, n = 0.0, 0
            for batch in loader:
                labels_BL = batch["labels"].to(self.device)
                out = self.model(
                    batch["input_ids"].to(self.device),
                    doc_ids=batch["doc_ids"].to(self.device),
                )
                nats += float(token_nll(out.logits, labels_BL, 1).sum())
                n += int(batch["num_loss_tokens"])
            row: dict[str, float] = {"eval_loss": nats / max(1, n)}
            k = min(self.sc.eval_generate, len(self.held_convs))
            if k:
                pairs = [prompt_and_answer(c) for c in self.held_convs[:k]]
                replies = generate_replies(
                    self.model,
                    self.tokenizer,
                    [p for p, _ in pairs],
                    max_new_tokens=self.sc.max_new_tokens,
                )
                hits = sum(answer_matches(r, a) for r, (_, a) in zip(replies, pairs, strict=True))
                row["eval_accuracy"] = hits / k
                self.last_replies = replies
        finally:
            self.model.train()
        return row

    # ------------------------------------------------------------------ checkpoints + log
    def run_config(self) -> dict[str, Any]:
        return {**self.run.to_dict(), "model": self.model_cfg.to_dict()}

    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.step * self.tokens_per_step, "loader": self.loader.state_dict()}

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        self.step = meta["step"]
        self.loader.load_state_dict(meta["loader"])

    def data_summary(self) -> dict[str, Any]:
        return {
            "read": self.read_report.summary(),
            "modes": dict(self.mode_counts),
            "dropped": dict(self.dropped),
            "train_conversations": len(self.loader.examples),
            "held_out": len(self.held_examples),
            "rows_per_epoch": self.loader.rows_per_epoch,
        }

    def export(self) -> Path | None:
        return export_hf(self.model, self.rt.out, self.tokenizer, self.stage)

    def summary(self) -> dict[str, Any]:
        return {"data": self.data_summary()}


def moe_balancing(value: torch.Tensor, metrics: dict[str, float], out: Any, n_micro: int) -> Loss:
    """`Loss` of a micro-batch whose forward `out` may carry the MoE sequence-level balancing
    loss (Nemotron 3 Super §2.1.1): a mean over the call's sequences, averaged over the step's
    `n_micro` micro-batches (`Loss.mean`)."""
    aux = out.aux.get("moe_aux")
    if aux is not None:
        metrics["moe_aux"] = float(aux.detach()) / n_micro
    return Loss(value, metrics, mean=aux)


def sft_trainer(cfg: SFTRunConfig, *, resume: bool = False, overwrite: bool = False) -> Trainer:
    """The Trainer of an SFT run, ready to `train()`."""
    return Trainer(cfg.train, lambda rt: SFT(cfg, rt), resume=resume, overwrite=overwrite)


def run_sft(
    cfg: SFTRunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Run SFT from a config; returns the final metrics, checkpoint and plot paths.
    `resume=True` continues exactly from the newest intact checkpoint under `train.out_dir`;
    `overwrite=True` replaces an earlier run there (without either, one is an error)."""
    trainer = sft_trainer(cfg, resume=resume, overwrite=overwrite)
    if is_main():
        cfg.save(Path(cfg.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)
