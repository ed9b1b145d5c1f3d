"""The pieces every post-training stage shares (SFT, DPO, RM, distillation, QAD, quantise's
calibration, MTP boosting): chat sources and their config, the held-out split by prompt, greedy
replies and answer matching, packed chat batches, the run-config base, the MoE balancing term,
the transformers export of a finished run, and `ChatModule`, the training module on chats that
SFT, offline distillation and QAD build on. No stage module imports another for these."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..config import Config
from ..data import tasks
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
from .callbacks import Callback, DataRow, Export, Progress, Throughput, curves
from .objectives import token_nll
from .trainer import (
    Loss,
    Runtime,
    Step,
    TrainModule,
    check_tokenizer,
    initial_model,
    run_tokenizer,
)

_GENERATED = ("arithmetic", "calculator", "ifeval", "code_gen")  # data.tasks


@dataclass(kw_only=True)
class ChatSource:
    """One source of conversations. `kind`: `file` (JSONL / Parquet / saved HF dataset at
    `path`), `hf` (a hub dataset name at `path`, `split`), `gsm8k` (GSM8K JSONL at `path`, the
    packaged train split when empty; the worked solution as the reasoning trace) or
    `arithmetic` (`max_rows` generated questions with `digits` digits and operators `ops`, chains
    of `terms` numbers, from `seed`), or the other generated task families of the RL environments
    (`data.tasks`): `calculator` (solved tool-call episodes, `digits`-digit factors), `ifeval`
    (notes under IFEval constraints) and `code_gen` (small Python functions). `max_rows`: 0 = all
    rows."""

    kind: Literal["file", "hf", "gsm8k", "arithmetic", "calculator", "ifeval", "code_gen"] = "file"
    path: str = ""
    split: str = "train"
    messages_field: str = "messages"
    max_rows: int = 0
    digits: int = 2
    terms: int = 2
    ops: str = "+-"  # arithmetic: operators drawn from ("*": by one digit)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind in ("file", "hf") and not self.path:
            raise ValueError(f"a chat source of kind {self.kind!r} needs a path")
        if self.kind in _GENERATED and self.max_rows <= 0:
            raise ValueError(f"a {self.kind} chat source needs max_rows > 0 (how many to generate)")
        if self.max_rows < 0 or self.digits < 1 or self.terms < 2:
            raise ValueError("chat source max_rows must be >= 0, digits >= 1 and terms >= 2")


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


class PostTrainingRunConfig(Config):
    """A post-training run (SFT, DPO, distillation): `model` (DPO: none), `train` and the stage's
    own sections, declared as fields by the subclasses; `REQUIRED` names those a file must give."""

    EXPAND = {"model": get_preset}

    def __post_init__(self) -> None:
        model = getattr(self, "model", None)
        if isinstance(model, str) and model not in PRESETS:
            raise ValueError(f"model {model!r} is not a preset; use one of {sorted(PRESETS)}")


def load_source(src: ChatSource, report: ReadReport) -> list[Conversation]:
    """The conversations of one `ChatSource` (bad rows counted in `report`)."""
    limit = src.max_rows or None
    if src.kind in _GENERATED:
        n, seed = src.max_rows, src.seed
        convs = {
            "arithmetic": lambda: arithmetic_conversations(
                n, seed=seed, digits=src.digits, terms=src.terms, ops=src.ops
            ),
            "calculator": lambda: tasks.calculator_conversations(n, digits=src.digits, seed=seed),
            "ifeval": lambda: tasks.ifeval_conversations(n, seed=seed),
            "code_gen": lambda: tasks.code_conversations(n, seed=seed),
        }[src.kind]()
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


def prompt_of(conv: Conversation) -> Conversation:
    """The prompt of a conversation: the messages before its last assistant turn (all of them
    when it has none)."""
    last = max((i for i, m in enumerate(conv) if m.get("role") == "assistant"), default=len(conv))
    return conv[:last]


def prompt_key(conv: Conversation) -> str:
    """The prompt of a conversation (`prompt_of`) as a string key."""
    return json.dumps(prompt_of(conv), sort_keys=True, ensure_ascii=False)


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


def moe_balancing(value: torch.Tensor, metrics: dict[str, float], out: Any, n_micro: int) -> Loss:
    """`Loss` of a micro-batch whose forward `out` may carry the MoE sequence-level balancing
    loss (Nemotron 3 Super §2.1.1): a mean over the call's sequences, averaged over the step's
    `n_micro` micro-batches (`Loss.mean`)."""
    aux = out.aux.get("moe_aux")
    if aux is not None:
        metrics["moe_aux"] = float(aux.detach()) / n_micro
    return Loss(value, metrics, mean=aux)


# ---------------------------------------------------------------------------- chat training
class ChatModule(TrainModule):
    """Training on the run's chats (SFT, offline distillation, QAD): the chats read, held out by
    prompt, transformed and packed (`prepare_chat_data`, `SFTLoader`), the model from
    `train.init_from` or `model`, the loader position in checkpoints, held-out assistant-token
    NLL and greedy exact match of `eval_generate` held-out answers, and the transformers export.
    A stage adds the micro-batch `loss` and, when it varies, the step's `norm_at`."""

    plot_train: tuple[str, ...] = ("loss",)  # the PNG's train-row keys
    plot_eval: tuple[str, ...] | None = ("eval_loss", "eval_accuracy")  # eval-row keys
    progress_keys: tuple[str, ...] = ("loss",)  # the progress bar's train-row keys

    def __init__(self, run: Any, rt: Runtime, *, eval_generate: int, max_new_tokens: int) -> None:
        super().__init__(rt)
        self.run = run
        tc, dc = run.train, run.data
        self.tc, self.dc = tc, dc
        self.eval_generate, self.max_new_tokens = eval_generate, max_new_tokens
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
        self.step = 0  # steps whose data was read

    # ------------------------------------------------------------------ one step
    def prepare_step(self, step: int) -> Step:
        norm = self.norm_at(step)
        batches = [next(self.loader) for _ in range(self.tc.grad_accum)]
        self.step = step + 1
        n_tok = sum(int(b["num_loss_tokens"]) for b in batches)
        n_conv = sum(int(b["num_conversations"]) for b in batches)
        return Step(
            [self.rt.shard(b) for b in batches],
            ctx={"norm": norm, "num_tokens": n_tok, "num_convs": n_conv},
            info={"norm": norm, "loss_tokens": n_tok, "conversations": n_conv},
        )

    def norm_at(self, step: int) -> str:
        """The loss normalisation of optimizer step `step` (`objectives.sft_token_weights`)."""
        return "token"

    # ------------------------------------------------------------------ eval
    def held_batches(self) -> SFTLoader:
        """The held-out conversations packed once, in order (this rank's micro-batch size)."""
        return SFTLoader(
            self.held_examples,
            seq_len=self.dc.seq_len,
            batch_size=self.dc.batch_size,
            sequential=True,
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out assistant-token NLL and greedy exact match."""
        if not self.held_examples:
            return {}
        self.model.eval()
        try:
            nats, n = 0.0, 0
            for batch in self.held_batches():
                labels_BL = batch["labels"].to(self.device)
                out = self.model(
                    batch["input_ids"].to(self.device),
                    doc_ids=batch["doc_ids"].to(self.device),
                )
                nats += float(token_nll(out.logits, labels_BL, 1).sum())
                n += int(batch["num_loss_tokens"])
            row: dict[str, float] = {"eval_loss": nats / max(1, n)}
            k = min(self.eval_generate, len(self.held_convs))
            if k:
                pairs = [prompt_and_answer(c) for c in self.held_convs[:k]]
                replies = generate_replies(
                    self.model,
                    self.tokenizer,
                    [p for p, _ in pairs],
                    max_new_tokens=self.max_new_tokens,
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
        """The finished model as a transformers directory `<out>/hf`."""
        return export_hf(self.model, self.rt.out, self.tokenizer, self.stage)

    def callbacks(self) -> list[Callback]:
        return [
            DataRow(self.data_summary),
            Throughput("tokens_per_s", self.tokens_per_step),
            Progress(keys=self.progress_keys),
            Export(self.export),
            curves(self.rt.out, self.stage, self.plot_train, self.plot_eval),
        ]
