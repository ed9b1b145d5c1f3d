"""`hybridlm qad`: quantisation-aware distillation (QAD), the last step of the Nemotron 3.5
deployment recipe (notes §"3.5 deployment": PTQ, then ~200 steps of QAD).

    hybridlm qad --config configs/qad.yaml --set train.init_from=runs/sft [--set qad.recipe=fp8]

The student is the model of `train.init_from` quantised as `hybridlm quantize` quantises it
(same calibration statistics, per-tensor scales, NVFP4 MSE block-scale search, exclusions; the
plan of every operator in `qad.recipe`, or the per-operator formats of an earlier `hybridlm
quantize` run, `qad.plan`, e.g. AutoQuantize's mix; `qad.formats` overrides operators by
glob), with trainable fake-quant modules
(`precision.ptq.QATLinear` / `QATExperts`): the forward is the deployed model's, bit for bit;
gradients reach the high-precision master weights straight through the quantisers. Per-tensor
scales stay those of calibration (as in ModelOpt's QAT; the checkpoints' meta records them),
NVFP4 block scales follow the weights. The teacher is the same model unquantised
(`distill.teacher`, default `train.init_from`), frozen; the loss is the offline distillation loss
of `train.stages.distill` (top-k forward KL on the logits; `distill.ce_weight` adds the data's CE,
`distill.hidden_weight` an MSE on the final hidden states) on the SFT-format chat data of
`data` (or the teacher's own replies, `qad.teacher_replies`, the right ones with
`qad.correct_only`), plus `qad.text_per_step` batches of pretraining text (`qad.text_data`)
distilled at every position by the KL alone. Everything else is the offline distillation
stage: loop, checkpoints with exact resume, held-out NLL and greedy exact match at each eval,
metrics.jsonl, the PNG.

Step 0's eval is the PTQ model (no step has changed a weight); `qad.text_data` (a pretraining
run) adds held-out text loss / bpb at each eval, the teacher's in the `teacher` row. At the end
the quantised model of the final master weights is written as a ModelOpt checkpoint to
`<out>/hf` (what vLLM loads; `hybridlm.io.load_model` reads it back), and `<out>/qad.json`
holds the figures: unquantised (teacher), PTQ (step 0) and QAD (final).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ...data.bpb import token_byte_lengths
from ...data.bpe import tokenizer_sha256
from ...data.chat import parse_assistant
from ...data.pipeline import build_loaders, build_tokenizer, prepare_shards
from ...data.sft import ChatExample, SFTLoader, tokenize_conversations
from ...interop.modelopt import export_modelopt
from ...precision.kv_cache import declare_kv_cache
from ...precision.ptq import (
    DEFAULT_EXCLUDE,
    calibrate,
    check_format,
    find_ops,
    load_qat_scales,
    model_bits,
    override_formats,
    plan_groups,
    qat_scales,
    quantize_model,
    recipe_plan,
    take,
    to_inference,
)
from ...precision.ptq import evaluate as text_eval
from ...stage import Flow, Report, Stage
from ..callbacks import Callback, Summary
from ..distillation import DistillConfig, DistillRunConfig, OfflineDistiller
from ..distributed.parallel import is_main
from ..objectives import IGNORE_INDEX, shift_targets
from ..post_training import (
    answer_matches,
    chat_batches,
    generate_replies,
    pad_id_of,
    prompt_and_answer,
)
from ..run_data import pretraining_data
from ..trainer import Loss, Runtime, Step, Trainer


@dataclass(kw_only=True)
class QADConfig:
    """What is quantised and how (the `hybridlm quantize` settings), and the text evaluation."""

    recipe: Literal["nvfp4", "fp8"] = "nvfp4"  # every quantisable operator in this format
    # a `hybridlm quantize` output directory (its quantize.json's per-operator plan, e.g. an
    # AutoQuantize mix; its exclusions, weight-scale search and KV cache too): "" = `recipe`
    plan: str = ""
    # operator glob -> format (nvfp4 / fp8 / bf16) over the recipe's or the plan's, e.g.
    # {"*.mixer.in_proj": fp8, "*.mixer.out_proj": fp8}: Nemotron 3.5's released checkpoints keep
    # the Mamba projections in FP8 or BF16 and NVFP4 on the experts (§4.3)
    formats: dict[str, str] = field(default_factory=dict)
    # the KV cache the export declares, calibrated on the final quantised model
    kv_cache: Literal["none", "fp8", "nvfp4"] = "none"
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    weight_scale: Literal["mse", "max"] = "mse"  # NVFP4 weight block scales
    calib_samples: int = 64  # calibration rows of the training data (as `hybridlm quantize`)
    # a pretraining run (its directory or run.yaml): held-out text loss / bpb at every eval
    text_data: str = ""
    text_batches: int = 8
    # training batches of `text_data` added to every step, distilled at every position: the
    # quantised model also follows its teacher on the text it was pretrained on (0: chats only)
    text_per_step: int = 0
    # > 0: the chats are the teacher's own greedy replies (up to distill.eval_max_new_tokens
    # tokens) to this many training prompts instead of the data's answers: the replies the
    # deployed model has to reproduce (after RL they differ from the SFT answers)
    teacher_replies: int = 0
    # keep only the teacher replies whose answer is the data's (`sft.answer_matches`, exact
    # strings: for short-answer data such as arithmetic): with
    # `distill.ce_weight` the CE then teaches answers the teacher gets right (its margins on
    # them are small, and a quantised model that only matches its distribution flips them)
    correct_only: bool = False
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # the unquantised tensors

    def __post_init__(self) -> None:
        if self.recipe not in ("nvfp4", "fp8"):
            raise ValueError(f"qad.recipe must be nvfp4 or fp8, got {self.recipe!r}")
        if self.weight_scale not in ("mse", "max"):
            raise ValueError(f"qad.weight_scale must be mse or max, got {self.weight_scale!r}")
        if self.kv_cache not in ("none", "fp8", "nvfp4"):
            raise ValueError(f"qad.kv_cache must be none, fp8 or nvfp4, got {self.kv_cache!r}")
        if self.calib_samples < 1 or self.text_batches < 1:
            raise ValueError("qad.calib_samples and qad.text_batches must be >= 1")
        if self.text_per_step < 0 or self.teacher_replies < 0:
            raise ValueError("qad.text_per_step and qad.teacher_replies must be >= 0")
        if self.correct_only and not self.teacher_replies:
            raise ValueError(
                "qad.correct_only filters the teacher's replies: set qad.teacher_replies"
            )
        self.exclude = tuple(self.exclude)
        for fmt in self.formats.values():
            try:
                check_format(fmt)
            except ValueError as err:
                raise ValueError(f"qad.formats: {err}") from None


@dataclass(kw_only=True)
class QADRunConfig(DistillRunConfig):
    """`model` is unused (the student is `train.init_from`); `distill`: the objective (teacher
    defaults to `train.init_from`; KL only by default, as ModelOpt's QAD)."""

    REQUIRED = ("qad",)
    WHAT = "QAD run config"

    distill: DistillConfig = field(
        default_factory=lambda: DistillConfig(kl_weight=1.0, ce_weight=0.0)
    )
    qad: QADConfig = field(default_factory=QADConfig)


def load_plan(path: str | Path) -> tuple[dict[str, str], dict[str, Any]]:
    """(per-operator formats, settings) of a `hybridlm quantize` output directory."""
    file = Path(path) / "quantize.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(f"qad.plan: no quantize.json at {file} (a `hybridlm quantize` output)")
    summary = json.loads(file.read_text())
    return summary["plan"], summary["settings"]


class QADistiller(OfflineDistiller):
    """Offline distillation of the quantised model (QAT modules) from itself unquantised."""

    stage = "qad"
    plot_eval = ("eval_loss", "eval_accuracy", "eval_kl", "eval_text_loss")

    def __init__(self, run: QADRunConfig, rt: Runtime) -> None:
        super().__init__(run, rt)
        q = self.qcfg = run.qad
        self.replies: dict[str, int] = {}
        exclude, weight_scale, self.kv_cache = q.exclude, q.weight_scale, q.kv_cache
        if q.plan:
            plan, settings = load_plan(q.plan)
            exclude, weight_scale = tuple(settings["exclude"]), settings["weight_scale"]
            self.kv_cache = settings.get("kv_cache", "none")
        else:
            plan = recipe_plan(self.model, q.recipe, exclude)
        self.exclude, self.weight_scale = exclude, weight_scale
        self.ops = find_ops(self.model, exclude)
        plan = override_formats(plan, q.formats)
        plan_groups(plan, self.ops)  # checked before the replies and calibration: fails fast
        if q.teacher_replies:  # the teacher still unquantised
            self.loader = SFTLoader(
                self.teacher_reply_examples(q.teacher_replies),
                seq_len=self.dc.seq_len,
                batch_size=self.dc.batch_size * rt.world_size,
                seed=self.dc.seed,
                pad_id=pad_id_of(self.tokenizer),
            )
        # calibration on the data's chats, as `hybridlm quantize --calib-data` reads them (so a
        # plan's step 0, without `formats`, is that PTQ checkpoint)
        self.calib = chat_batches(run.data, q.calib_samples, self.tokenizer)
        stats = calibrate(self.model, self.calib, exclude=exclude)
        self.applied = quantize_model(
            self.model, plan, stats, weight_scale=weight_scale, exclude=exclude, qat=True
        )

        self.calibration = {"rows": stats.tokens // run.data.seq_len, "tokens": stats.tokens}
        self.text, self.text_train = self._text_sets(q)
        # the text batches' loss (`objective`); only with text batches, so a CE-only QAD on
        # chats alone (kl_weight 0) stays valid
        self.text_objective = (
            dataclasses.replace(self.dcfg, ce_weight=0.0, hidden_weight=0.0)
            if self.text_train is not None
            else self.dcfg
        )
        self.text_tokens = 0  # held-out text tokens of the last evaluation
        self.kv: dict[str, Any] = {}  # the exported KV cache's scales (quantize.json's layout)

    def teacher_reply_examples(self, n: int) -> list[ChatExample]:
        """The teacher's greedy replies to `n` training prompts (seeded draw), tokenised as
        chats (reasoning block and answer as the chat template renders them); with
        `qad.correct_only` only those whose answer is the data's."""
        assert self.teacher is not None
        rng = random.Random(self.dc.seed)
        convs = rng.sample(self.train_convs, min(n, len(self.train_convs)))
        pairs = [prompt_and_answer(c) for c in convs]
        prompts = [p for p, _ in pairs]
        replies = generate_replies(
            self.teacher, self.tokenizer, prompts, max_new_tokens=self.dcfg.eval_max_new_tokens
        )
        right = [answer_matches(r, a) for r, (_, a) in zip(replies, pairs, strict=True)]
        chats = [
            [*p, parse_assistant(r)]
            for p, r, ok in zip(prompts, replies, right, strict=True)
            if ok or not self.qcfg.correct_only
        ]
        tok = tokenize_conversations(
            chats, self.tokenizer, max_len=self.dc.seq_len, overflow=self.dc.overflow
        )
        if not tok.examples:
            raise ValueError(
                "no teacher reply fits data.seq_len" + " and is correct" * self.qcfg.correct_only
            )
        self.replies = {"prompts": len(prompts), "correct": sum(right), "kept": len(tok.examples)}
        return list(tok.examples)

    def objective(self, micro: dict[str, torch.Tensor]) -> DistillConfig:
        """The chats' loss is `distill`'s; the pretraining text's is its KL alone: a CE there
        would train toward the text, away from the teacher the text batches are there to
        follow."""
        return self.dcfg if _is_chat(micro) else self.text_objective

    def loss(self, micro: dict[str, torch.Tensor], step: Step) -> Loss:
        out = super().loss(micro, step)
        if not _is_chat(micro):  # the text's CE is logged apart: it is not in the loss
            out.metrics["text_ce"] = out.metrics.pop("ce")
            out.metrics.pop("nll_token", None)
        return out

    def _text_sets(self, q: QADConfig) -> tuple[tuple[list, torch.Tensor] | None, Any]:
        """(held-out text batches and token byte lengths, the training text loader when
        `text_per_step`) of `qad.text_data`."""
        if not q.text_data:
            return None, None
        data = pretraining_data(q.text_data)
        train_loader, held_loader = build_loaders(data, prepare_shards(data))
        if held_loader is None:
            raise ValueError(f"qad.text_data {q.text_data} has no held-out split")
        text_tokenizer = build_tokenizer(data)
        if tokenizer_sha256(text_tokenizer) != tokenizer_sha256(self.tokenizer):
            raise ValueError(
                f"qad.text_data={q.text_data} is tokenized with {data.tokenizer}, not the "
                f"model's tokenizer ({self.dc.tokenizer}): give a run trained with it"
            )
        tb = token_byte_lengths(text_tokenizer, self.model.config.vocab_size)
        return (take(held_loader, q.text_batches), tb), (train_loader if q.text_per_step else None)

    def prepare_step(self, step: int) -> Step:
        """The chats' micro-batches, and `text_per_step` pretraining batches distilled at every
        position; the loss is normalised by the tokens of both."""
        out = super().prepare_step(step)
        if self.text_train is not None:
            text = [next(self.text_train) for _ in range(self.qcfg.text_per_step)]
            n = sum(int((shift_targets(b["labels"], 1) != IGNORE_INDEX).sum()) for b in text)
            out.micro += [self.rt.shard(b) for b in text]
            out.ctx["num_tokens"] += n
            out.info["text_tokens"] = n
        return out

    def evaluate(self) -> dict[str, float]:
        row = super().evaluate()
        if self.text is not None:
            t = text_eval(self.model, *self.text)
            row |= {"eval_text_loss": t["loss"], "eval_text_bpb": t["bpb"]}
            self.text_tokens = t["tokens"]
        return row

    def teacher_reference(self) -> dict[str, float]:
        row = super().teacher_reference()
        if self.text is not None:
            assert self.teacher is not None
            t = text_eval(self.teacher, *self.text)
            row |= {"teacher_text_loss": t["loss"], "teacher_text_bpb": t["bpb"]}
        return row

    # the fixed scales travel in the checkpoint's meta (the weights file holds master weights)
    def state_dict(self) -> dict[str, Any]:
        out = {
            **super().state_dict(),
            "qat_scales": qat_scales(self.model),
            "plan": self.applied,
        }
        if self.text_train is not None:
            out["text_loader"] = self.text_train.state_dict()
        return out

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        super().load_state_dict(meta)
        if meta.get("plan", self.applied) != self.applied:  # the scales are the formats'
            raise ValueError("the checkpoint's QAD run quantised other formats than this config")
        load_qat_scales(self.model, meta["qat_scales"])
        if self.text_train is not None:
            self.text_train.load_state_dict(meta["text_loader"])

    def quantized_model(self) -> torch.nn.Module:
        """The deployable model of the current master weights (inference modules, CPU)."""
        return to_inference(copy.deepcopy(self.model).cpu()).eval()

    def export(self) -> Path | None:
        out = self.rt.out / "hf"
        dtype = getattr(torch, self.qcfg.export_dtype)
        model = self.quantized_model()
        self.kv = declare_kv_cache(model, self.kv_cache, self.calib)
        export_modelopt(model, out, dtype=dtype, tokenizer=self.tokenizer)
        return out

    def callbacks(self) -> list[Callback]:
        return [*super().callbacks(), Summary(self.summary)]

    def summary(self) -> dict[str, Any]:
        """The run's figures (`qad.json`): plan, calibration, unquantised / PTQ / QAD metrics,
        and the held-out text comparison in `hybridlm quantize`'s layout (quantize.json)."""
        bits = model_bits(self.model, self.applied, self.ops)
        figures = qad_figures(self.rt.metrics_path)
        result: dict[str, Any] = {
            "data": self.data_summary(),
            "plan": self.applied,
            "effective_bits": bits,
            "calibration": {**self.calibration, "data": "the run's training chats"},
            "kv_cache": self.kv,
            "teacher_replies": self.replies,
            "figures": figures,
        }
        u, q = figures["unquantized"], figures.get("qad", {})
        if self.text is not None and "text_loss" in u and "text_loss" in q:
            result |= {
                "eval": {"tokens": self.text_tokens, "batches": len(self.text[0])},
                "unquantized": {"loss": u["text_loss"], "bpb": u["text_bpb"]},
                "quantized": {"loss": q["text_loss"], "bpb": q["text_bpb"], "effective_bits": bits},
                "delta": {
                    "loss": q["text_loss"] - u["text_loss"],
                    "loss_rel": (q["text_loss"] - u["text_loss"]) / u["text_loss"],
                    "bpb_rel": (q["text_bpb"] - u["text_bpb"]) / u["text_bpb"],
                },
            }
        (self.rt.out / "qad.json").write_text(json.dumps(result, indent=2))
        return result


def _is_chat(micro: dict[str, torch.Tensor]) -> bool:
    """A chat micro-batch (SFTLoader rows carry `conv_ids`; the pretraining loader's, added by
    `qad.text_per_step`, have no conversations)."""
    return "conv_ids" in micro


def qad_figures(metrics: Path) -> dict[str, dict[str, float]]:
    """{unquantized, ptq, qad: {metric: value}} from a QAD run's metrics.jsonl: the teacher
    row, the step-0 eval (the PTQ model) and the last eval."""
    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    teacher = next((r for r in rows if r.get("kind") == "teacher"), {})

    def pick(r: dict[str, Any], prefix: str) -> dict[str, float]:
        return {
            k.removeprefix(prefix): v
            for k, v in r.items()
            if k.startswith(prefix) and isinstance(v, (int, float)) and math.isfinite(v)
        }

    out = {"unquantized": pick(teacher, "teacher_")}
    if evals:
        out["ptq"] = {"step": evals[0]["step"], **pick(evals[0], "eval_")}
        out["qad"] = {"step": evals[-1]["step"], **pick(evals[-1], "eval_")}
    return out


def resolved(cfg: QADRunConfig) -> QADRunConfig:
    """A copy with the teacher set (default: the model being quantised), checked."""
    cfg = copy.deepcopy(cfg)
    if not cfg.train.init_from:
        raise ValueError("qad needs train.init_from: the model to quantise (and its teacher)")
    if cfg.distill.mode != "offline":
        raise ValueError("qad distils offline (distill.mode offline)")
    cfg.distill.teacher = cfg.distill.teacher or cfg.train.init_from
    if cfg.qad.text_per_step and not cfg.qad.text_data:
        raise ValueError("qad.text_per_step needs qad.text_data (a pretraining run)")
    if cfg.qad.text_per_step and cfg.distill.kl_weight <= 0:
        raise ValueError("qad.text_per_step distils text by the KL alone: distill.kl_weight > 0")
    cfg.distill.check()
    return cfg


def qad_trainer(cfg: QADRunConfig, *, resume: bool = False, overwrite: bool = False) -> Trainer:
    """The Trainer of a QAD run."""
    cfg = resolved(cfg)
    return Trainer(cfg.train, lambda rt: QADistiller(cfg, rt), resume=resume, overwrite=overwrite)


def run_qad(
    cfg: QADRunConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Run QAD from a config; returns the final metrics, checkpoint and export paths (`hf`: the
    ModelOpt checkpoint) and the figures of `qad.json`."""
    trainer = qad_trainer(cfg, resume=resume, overwrite=overwrite)
    if is_main():  # the resolved config (the teacher set)
        run = trainer.module.run
        run.save(Path(run.train.out_dir) / "run.yaml")
    return trainer.train(until_step=until_step)


__all__ = ["QADConfig", "QADRunConfig", "QADistiller", "qad_figures", "run_qad"]


# ---------------------------------------------------------------------------- the flow's stage
def _stage_settings(flow: Flow) -> dict[str, Any]:
    """The qad section, on the SFT stage's chats and tokenizer, from the newest model; held-out
    text of the pretraining run. `qad.plan` (e.g. `{run}/quantize/nvfp4`) takes a quantize
    recipe's operators, exclusions and weight-scale search."""
    data = flow.format_paths(flow.cfg.qad.to_dict())
    data["data"] = flow.format_paths(flow.cfg.sft.to_dict())["data"]
    data["data"]["tokenizer"] = flow.tokenizer_spec()
    data["train"]["out_dir"] = str(flow.stage_dir("qad"))
    data["train"]["init_from"] = flow.model_path("qad")
    data["qad"]["text_data"] = str(flow.stage_dir("pretrain")) if flow.done("pretrain") else ""
    return data


def _stage_run(flow: Flow) -> dict[str, Any]:
    cfg = QADRunConfig.from_dict(flow.settings("qad"))
    result = flow.continue_or_start("qad", lambda **kw: run_qad(cfg, **kw))
    name = Path(cfg.qad.plan).name if cfg.qad.plan else cfg.qad.recipe
    name += "_mixed_qad" if cfg.qad.formats else "_qad"  # `qad.formats` changed some operators
    return {
        "model": result["hf"],
        "models": {name: result["hf"]},
        "from": cfg.train.init_from,
        "steps": result["step"],
        "figures": result["figures"],
    }


def _headline(s: dict[str, Any], report: Report) -> str:
    f = s["figures"]
    u, p, q = f["unquantized"], f["ptq"], f["qad"]
    return (
        f"{s['steps']} steps; SFT held-out exact match: unquantised {u['accuracy']:.2f}, "
        f"PTQ {p['accuracy']:.2f} -> QAD {q['accuracy']:.2f}; held-out KL to the "
        f"unquantised model {p['kl']:.4f} -> {q['kl']:.4f}"
    )


# quantisation-aware distillation of the quantised newest model from itself unquantised, on
# the SFT chats (Nemotron 3.5's deployment recipe)
STAGE = Stage(
    "qad",
    inputs=("pretrain", "sft", "quantize"),  # held-out text, the chats, the NVFP4 plan
    config=QADRunConfig,
    settings=_stage_settings,
    run=_stage_run,
    model="variants",
    headline=_headline,
)
