"""Supervised fine-tuning: `run_sft(cfg)` and `hybridlm sft`.

Shape legend: B rows, L `data.seq_len`, V vocabulary.

A run is one YAML file with four sections (`configs/sft.yaml`):

    model: tiny-super          # used only when sft.init_from is empty (a fresh model)
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

import contextlib
import copy
import dataclasses
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from ..config import ModelConfig, read_mapping, write_mapping
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
from ..model.model import HybridLM
from ..presets import PRESETS, get_preset
from .checkpoint import (
    load_checkpoint,
    prepare_run_dir,
    resume_checkpoint,
    save_checkpoint,
    truncate_metrics,
)
from .config import TrainConfig, run_from_dict
from .objectives import sft_token_weights, shift_targets_float, token_nll
from .optim import StepOutcome, build_optimizer, optimizer_step

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
    """Chat data: sources, tokenizer ("byte" or a tokenizer directory), packing, held-out split
    (`held_out` conversations drawn with `seed` before any transform) and reasoning modes."""

    sources: list[ChatSource] = field(default_factory=list)
    tokenizer: str = "byte"
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

    init_from: str = ""  # a hybridlm training checkpoint or HF directory; "" = fresh model
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


class PostTrainingRunConfig:
    """YAML / JSON I/O shared by the post-training run configs (SFT, DPO, distillation):
    subclasses name their sections besides `model` and `train` (`SECTIONS`) and those a file
    must have (`REQUIRED`)."""

    SECTIONS: ClassVar[dict[str, type]] = {}
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    WHAT: ClassVar[str] = "run config"

    def __post_init__(self) -> None:
        model = getattr(self, "model", None)
        if isinstance(model, str) and model not in PRESETS:
            raise ValueError(f"model {model!r} is not a preset; use one of {sorted(PRESETS)}")

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        for name in cls.REQUIRED:
            if isinstance(data, dict) and name not in data:
                raise ValueError(f"a {cls.WHAT} needs a {name!r} section")
        return run_from_dict(cls, data, cls.SECTIONS)

    def save(self, path: str | Path) -> None:
        write_mapping(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> Any:
        return cls.from_dict(read_mapping(path, cls.WHAT))


@dataclass(kw_only=True)
class SFTRunConfig(PostTrainingRunConfig):
    SECTIONS = {"data": SFTDataConfig, "sft": SFTConfig}
    WHAT = "SFT run config"

    model: ModelConfig | str = "tiny-super"
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


# ---------------------------------------------------------------------------- config helpers
def _to_plain(run: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(run):
        value = getattr(run, f.name)
        if isinstance(value, ModelConfig):
            out[f.name] = value.to_dict()
        elif dataclasses.is_dataclass(value):
            out[f.name] = dataclasses.asdict(value)
        else:
            out[f.name] = value
    return out


def autocast(tc: TrainConfig, device: torch.device):
    """bf16 autocast when `train.precision` is bf16 (fp32 master weights), else nothing."""
    if tc.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_model(
    init_from: str, model: ModelConfig | str | None, *, seed: int, device: torch.device
) -> HybridLM:
    """The model a post-training run starts from: a hybridlm training checkpoint or run
    directory, a transformers directory, or (empty `init_from`) a freshly initialised `model`."""
    from .trainer import build_model

    if not init_from:
        if model is None:
            raise ValueError("give sft.init_from (a checkpoint) or a model config")
        cfg = get_preset(model) if isinstance(model, str) else copy.deepcopy(model)
        return build_model(cfg, seed=seed, device=device)
    # a training checkpoint, a run directory (its newest checkpoint) or a transformers directory
    return HybridLM.from_pretrained(init_from).to(device)


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
    from ..infer.generate import generate

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


def plot_post_training(
    metrics_path: str | Path,
    out_png: str | Path,
    keys: Sequence[str],
    eval_keys: Sequence[str] | None = None,
) -> Path:
    """Train curves (`keys` of kind "train" rows) and eval curves (`eval_keys`, default every
    numeric eval field) against the step, as a PNG rendered from metrics.jsonl."""
    from .plot import pyplot, save_figure

    plt = pyplot()

    from .plot import read_metrics

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    fig, (ax, ax_eval) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for key in keys:
        pts = [(r["step"], r[key]) for r in train if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=1, label=key)
    ax.set_ylabel("train")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    if eval_keys is None:
        eval_keys = sorted(
            {k for r in evals for k, v in r.items() if isinstance(v, float) and k != "step"}
        )
    eval_keys = [k for k in eval_keys if any(k in r for r in evals)]
    for key in eval_keys:
        pts = [(r["step"], r[key]) for r in evals if isinstance(r.get(key), (int, float))]
        ax_eval.plot(*zip(*pts, strict=True), "o-", ms=3, label=key)
    ax_eval.set_ylabel("held-out")
    ax_eval.set_xlabel("step")
    if eval_keys:
        ax_eval.legend(loc="best")
    ax_eval.grid(alpha=0.3)
    return save_figure(fig, out_png, dpi=100)


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
        held_convs=held_convs,
        held_examples=list(held.examples),
        read_report=report,
        mode_counts=dict(mode_counts),
        dropped=dropped,
    )


def chat_batches(dc: SFTDataConfig, num_rows: int) -> list[dict[str, torch.Tensor]]:
    """About `num_rows` packed rows of an SFT data config's training conversations, e.g. to
    calibrate post-training quantisation on the post-training data (Nemotron 3 Super calibrates
    its NVFP4 checkpoint on 256 samples of the SFT set)."""
    from ..data.bpe import load_tokenizer

    tokenizer = load_tokenizer(dc.tokenizer)
    data = prepare_chat_data(dc, tokenizer)
    loader = SFTLoader(
        data.examples,
        seq_len=dc.seq_len,
        batch_size=dc.batch_size,
        seed=dc.seed + 1,  # other rows than the run's first steps
        pad_id=pad_id_of(tokenizer),
    )
    return [next(loader) for _ in range(max(1, -(-num_rows // dc.batch_size)))]


class PostTrainingLoop:
    """The step / log / eval / checkpoint / plot loop shared by the SFT, DPO and distillation
    trainers. A subclass sets `stage`, `plot_train` / `plot_eval` (metric keys of the PNG) and
    `rate_key` / `units_per_step` (throughput), calls `prepare_run` (`out`, `metrics_path`,
    `device`, `tokenizer`) first and, with `resume`, `resume_run` once its model and optimizer
    exist; has `tc`, `step`, `total_steps`, `resumed_from`, and implements
    `train_step()`, `evaluate()` (an empty dict: nothing to evaluate), `save()` and
    `data_summary()`; `start_rows()`, `progress_info()` and `close()` are optional hooks.
    `train_step` ends its update with `optimizer_step` (`model`, `optimizer`, `params`)."""

    stage = "train"
    plot_train: tuple[str, ...] = ("loss",)
    plot_eval: tuple[str, ...] | None = None
    rate_key = "steps_per_s"
    units_per_step = 1

    def optimizer_step(self, loss: float) -> StepOutcome:
        """The shared update (`optim.optimizer_step`) at this loop's step and schedule."""
        return optimizer_step(
            self.model,
            self.optimizer,
            self.params,
            loss=loss,
            tc=self.tc,
            step=self.step,
            total_steps=self.total_steps,
        )

    def prepare_run(
        self, tc: TrainConfig, tokenizer: str, *, resume: bool = False, overwrite: bool = False
    ) -> None:
        """The run's output directory (an earlier run in it needs `resume` or `overwrite`:
        `checkpoint.prepare_run_dir`) and metrics file, device, seeds and tokenizer."""
        from ..data.bpe import load_tokenizer

        self.out = prepare_run_dir(tc.out_dir, resume=resume, overwrite=overwrite)
        self.resumed_from: Path | None = None
        self.metrics_path = self.out / "metrics.jsonl"
        self.device = resolve_device(tc.device)
        seed_all(tc.seed)
        self.tokenizer = load_tokenizer(tokenizer)

    def resume_run(self, restore: Callable[[dict[str, Any]], None]) -> None:
        """Continue from the newest intact checkpoint (a damaged newer one is skipped, saying
        why): load weights, optimizer and RNG, `restore(meta)` the stage's counters and data
        position, and drop the metrics rows logged after the checkpoint. Without a checkpoint
        the run starts from scratch with an empty log."""
        path = resume_checkpoint(self.out)
        if path is None:
            print(f"{self.stage}: no checkpoint under {self.out} to resume; starting from scratch")
            truncate_metrics(self.metrics_path, None)
            return
        meta = load_checkpoint(path, self.model, self.optimizer, restore_rng=True)
        restore(meta)
        self.resumed_from = path
        truncate_metrics(self.metrics_path, self.step)
        print(f"{self.stage}: resumed from {path} at step {self.step}")

    def start_rows(self) -> list[dict[str, Any]]:
        """Rows logged once before the first step (after the data row)."""
        return []

    def progress_info(self, m: dict[str, Any]) -> str:
        return f"loss {m['loss']:.4f}"

    def close(self) -> None:
        """Release resources (rollout workers) when the loop ends."""

    def _log(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _evaluate_and_log(self, bar: Any = None) -> dict[str, float]:
        result = self.evaluate()
        if result:
            self._log({"kind": "eval", "step": self.step, **result})
            if bar is not None:
                text = ", ".join(f"{k} {v:.4f}" for k, v in result.items())
                bar.console.print(f"step {self.step}: {text}")
        return result

    def export_hf(self) -> Path | None:
        """`<out>/hf`: the final weights as a transformers directory with the run's tokenizer,
        chat template and generation config (as `hybridlm pretrain` writes); None, with a note,
        for a model transformers has no class for."""
        from ..interop.hf import to_hf_config

        try:
            to_hf_config(self.model.config)
        except ValueError as err:
            print(f"{self.stage}: no transformers export ({err})")
            return None
        return self.model.save_pretrained(self.out / "hf", tokenizer=self.tokenizer)

    def train(self, *, until_step: int | None = None) -> dict[str, Any]:
        tc = self.tc
        end = self.total_steps if until_step is None else min(until_step, self.total_steps)
        last_eval: dict[str, float] = {}
        if self.step == 0:
            self._log({"kind": "data", "step": 0, **self.data_summary()})
            for extra in self.start_rows():
                self._log(extra)
            last_eval = self._evaluate_and_log()
        last_ckpt = self.resumed_from
        row: dict[str, Any] = {}
        t0, steps = time.perf_counter(), 0
        try:
            with progress_bar(self.stage, tc.progress) as bar:
                task = bar.add_task("", total=self.total_steps, completed=self.step, info="")
                while self.step < end:
                    m = self.train_step()
                    steps += 1
                    if m.get("skipped"):
                        bar.console.print(f"[yellow]step {m['step']}: non-finite loss; skipped")
                    if self.step % tc.log_interval == 0 or self.step == end:
                        now = time.perf_counter()
                        row = {"kind": "train", **{k: v for k, v in m.items() if k != "skipped"}}
                        row[self.rate_key] = steps * self.units_per_step / max(now - t0, 1e-9)
                        if hasattr(self, "skipped_steps"):
                            row["skipped_steps"] = self.skipped_steps
                        t0, steps = now, 0
                        self._log(row)
                        bar.update(task, info=self.progress_info(m))
                    bar.update(task, completed=self.step)
                    final = self.step == self.total_steps
                    if (tc.eval_interval and self.step % tc.eval_interval == 0) or final:
                        last_eval = self._evaluate_and_log(bar) or last_eval
                        t0, steps = time.perf_counter(), 0
                    if (
                        tc.checkpoint_interval and self.step % tc.checkpoint_interval == 0
                    ) or final:
                        last_ckpt = self.save()
                        t0, steps = time.perf_counter(), 0
        finally:
            self.close()
        plot = hf = None
        if self.step == self.total_steps:
            hf = self.export_hf()
        if tc.plot and self.step == self.total_steps and self.metrics_path.exists():
            plot = plot_post_training(
                self.metrics_path, self.out / f"{self.stage}.png", self.plot_train, self.plot_eval
            )
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "last_train": row,
            "eval": last_eval,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "hf": str(hf) if hf else None,
            "metrics": str(self.metrics_path),
            "plot": str(plot) if plot else None,
            "data": self.data_summary(),
        }


class SFTTrainer(PostTrainingLoop):
    """Model, optimizer, data and counters of one SFT run; `train()` runs it to the end."""

    stage = "sft"
    plot_train = ("loss", "nll_token", "mtp")
    plot_eval = ("eval_loss", "eval_accuracy")
    rate_key = "tokens_per_s"

    @property
    def units_per_step(self) -> int:  # type: ignore[override]
        return self.tokens_per_step

    def progress_info(self, m: dict[str, Any]) -> str:
        return f"{m['norm']} loss {m['loss']:.3f} nll/tok {m['nll_token']:.3f}"

    def __init__(self, run: SFTRunConfig, *, resume: bool = False, overwrite: bool = False) -> None:

        self.run = run
        tc, dc, sc = run.train, run.data, run.sft
        self.tc, self.dc, self.sc = tc, dc, sc
        self.prepare_run(tc, dc.tokenizer, resume=resume, overwrite=overwrite)

        # data: read, hold out, transform, tokenise
        data = prepare_chat_data(dc, self.tokenizer)
        self.read_report, self.held_convs = data.read_report, data.held_convs
        self.mode_counts, self.dropped = data.mode_counts, data.dropped
        self.held_examples = data.held_examples
        self.loader = SFTLoader(
            data.examples,
            seq_len=dc.seq_len,
            batch_size=dc.batch_size,
            seed=dc.seed,
            pad_id=pad_id_of(self.tokenizer),
        )
        self.tokens_per_step = dc.batch_size * dc.seq_len * tc.grad_accum
        self.total_steps = tc.num_steps(self.tokens_per_step)

        # model + optimizer
        self.model = load_model(sc.init_from, run.model, seed=tc.seed, device=self.device)
        self.model_cfg = self.model.config
        if self.tokenizer.vocab_size > self.model_cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} ids but the model's vocab_size "
                f"is {self.model_cfg.vocab_size}"
            )
        self.mtp_depth = self.model_cfg.mtp.depth if sc.mtp_depth < 0 else sc.mtp_depth
        if self.model.mtp is None:
            self.mtp_depth = 0
        self.optimizer = build_optimizer(self.model, tc)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.step = 0
        self.skipped_steps = 0
        if resume:

            def restore(meta: dict[str, Any]) -> None:
                self.step, self.skipped_steps = meta["step"], meta.get("skipped_steps", 0)
                self.loader.load_state_dict(meta["loader"])

            self.resume_run(restore)

    # ------------------------------------------------------------------ loss of one micro-batch
    def micro_loss(
        self, batch: dict[str, torch.Tensor], *, norm: str, num_tokens: int, num_convs: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the step's loss and its parts (module docstring)."""
        dev = self.device
        ids_BL, labels_BL = batch["input_ids"].to(dev), batch["labels"].to(dev)
        doc_BL = batch["doc_ids"].to(dev)
        with autocast(self.tc, dev):
            out = self.model(
                ids_BL, labels_BL, doc_ids=doc_BL, mtp_depth=self.mtp_depth, return_logits=True
            )
        w_BL = sft_token_weights(
            labels_BL,
            batch["conv_ids"].to(dev),
            mode=norm,
            num_tokens=num_tokens,
            num_conversations=num_convs,
        )
        mask_BL = (labels_BL != -100).float()
        nll_BL = token_nll(out.logits, labels_BL, 1)
        ce = (nll_BL * shift_targets_float(w_BL, 1)).sum()
        parts = {
            "ce": float(ce.detach()),
            # the token-mean NLL of the step whatever the normalisation: comparable across stages
            "nll_token": float((nll_BL.detach() * shift_targets_float(mask_BL, 1)).sum())
            / max(1, num_tokens),
        }
        loss = ce
        if self.mtp_depth > 0:
            mtp_terms = []
            for k, logits_k in enumerate(out.mtp_logits, start=1):
                nll_k = token_nll(logits_k, labels_BL, k + 1)
                w_k = shift_targets_float(w_BL, k + 1)
                same = torch.zeros_like(w_k, dtype=torch.bool)
                same[:, : -(k + 1)] = doc_BL[:, : -(k + 1)] == doc_BL[:, k + 1 :]
                mtp_terms.append((nll_k * w_k * same).sum())
            mtp = torch.stack(mtp_terms).mean()
            loss = loss + self.sc.mtp_weight * mtp
            parts["mtp"] = float(mtp.detach())
        aux = out.losses.get("moe_aux")
        if aux is not None:  # a sequence mean per call: averaged over the micro-batches
            loss = loss + aux / self.tc.grad_accum
            parts["moe_aux"] = float(aux.detach()) / self.tc.grad_accum
        return loss, parts

    def train_step(self) -> dict[str, Any]:
        tc = self.tc
        self.model.train()
        norm = self.sc.norm_at(self.step, self.total_steps)
        batches = [next(self.loader) for _ in range(tc.grad_accum)]
        n_tok = sum(int(b["num_loss_tokens"]) for b in batches)
        n_conv = sum(int(b["num_conversations"]) for b in batches)
        total, parts = 0.0, Counter()
        for batch in batches:
            loss, p = self.micro_loss(batch, norm=norm, num_tokens=n_tok, num_convs=n_conv)
            loss.backward()
            total += float(loss.detach())
            parts.update(p)
        done = self.optimizer_step(total)
        finite, grad_norm, lr = done.finite, done.grad_norm, done.lr
        if not finite:
            self.skipped_steps += 1
        self.step += 1
        return {
            "step": self.step,
            "loss": total,
            **dict(parts),
            "norm": norm,
            "lr": lr,
            "grad_norm": grad_norm,
            "loss_tokens": n_tok,
            "conversations": n_conv,
            "skipped": not finite,
        }

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
    def run_dict(self) -> dict[str, Any]:
        """The run config stored in checkpoints (subclasses with their own config override)."""
        return self.run.to_dict()

    def save(self) -> Path:
        meta = {
            "run_config": {**self.run_dict(), "model": self.model_cfg.to_dict()},
            "stage": self.stage,
            "skipped_steps": self.skipped_steps,
            "total_steps": self.total_steps,
            "tokens_seen": self.step * self.tokens_per_step,
            "loader": self.loader.state_dict(),
        }
        return save_checkpoint(
            self.out,
            step=self.step,
            model=self.model,
            optimizer=self.optimizer,
            meta=meta,
            keep_last_n=self.tc.keep_last_n,
        )

    def data_summary(self) -> dict[str, Any]:
        return {
            "read": self.read_report.summary(),
            "modes": dict(self.mode_counts),
            "dropped": dict(self.dropped),
            "train_conversations": len(self.loader.examples),
            "held_out": len(self.held_examples),
            "rows_per_epoch": self.loader.rows_per_epoch,
        }


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
    trainer = SFTTrainer(cfg, resume=resume, overwrite=overwrite)
    cfg.save(Path(cfg.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)
