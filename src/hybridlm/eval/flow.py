"""Evaluation of every model of a flow (the speedrun's `eval` stage).

For each finished model stage (pretrain, SFT, RL, MTP healing, the quantised model) on the same
data: held-out pretraining text (next-token loss and bits per byte, as the trainer measures
them); the RL stage's held-out problems (its eval set over every environment, greedy, the
fraction solved with a binomial standard error, overall and per environment); for
`spec_models`, the SPEED-Bench protocol at draft length 7; harness tasks on the packaged GSM8K /
HumanEval / tinyshakespeare (or those in `data_dir`, when that folder exists) for
`harness_models`. Cache memory vs context is computed from the model config (KV cache of the
attention layers + the fixed Mamba state) next to an attention-only twin, for the speedrun model
and Nemotron 3 Super.

Rows go to `<out>/metrics.jsonl` (`kind`: `model`, `cache_memory`); harness rows to
`<out>/<stage>/metrics.jsonl` (the harness's own format).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..config import ModelConfig
from ..data.bpb import token_byte_lengths
from ..data.pipeline import build_loaders, prepare_shards
from ..io import load_model
from ..precision.ptq import evaluate as text_loss
from ..precision.ptq import take
from ..presets import get_preset
from ..rl.env_config import build_mixture, eval_specs, evaluate_policy
from ..stage import Flow, Report, Stage
from ..train.run_data import pretraining_data
from .harness import EvalConfig, LoadedModel, evaluate


def attention_only(cfg: ModelConfig) -> ModelConfig:
    """The same width, depth and attention settings with every block attention (no MTP)."""
    d = cfg.to_dict()
    d["pattern"] = "*" * len(cfg.pattern)
    d["mtp"]["pattern"] = ""
    return ModelConfig.from_dict(d)


def cache_bytes(cfg: ModelConfig, context: int, kv_bytes: int = 2, state_bytes: int = 4) -> int:
    """Decode-cache bytes of one sequence at `context` tokens: KV of the attention layers grows
    with the context, the Mamba conv + SSM state does not (bf16 KV, fp32 state)."""
    return cfg.kv_cache_bytes_per_token(kv_bytes) * context + cfg.mamba_state_bytes_per_sequence(
        state_bytes
    )


def cache_memory_rows(name: str, cfg: ModelConfig, contexts: list[int]) -> list[dict[str, Any]]:
    twin = attention_only(cfg)
    return [
        {
            "kind": "cache_memory",
            "model": name,
            "pattern": cfg.pattern,
            "context": c,
            "hybrid_bytes": cache_bytes(cfg, c),
            "attention_only_bytes": cache_bytes(twin, c),
        }
        for c in contexts
    ]


def evaluate_flow(flow: Flow, out: Path) -> dict[str, Any]:
    """Evaluate the finished models of a `Speedrun` (`flow`); returns the summary rows."""
    ecfg = flow.cfg.eval
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.write_text("")

    def log(row: dict[str, Any]) -> None:
        with open(metrics, "a") as f:
            f.write(json.dumps(row) + "\n")

    tok = flow.tokenizer()
    held = None
    if flow.done("pretrain"):
        data = pretraining_data(flow.stage_dir("pretrain"))
        _, held_loader = build_loaders(data, prepare_shards(data))
        if held_loader is not None:
            held = take(held_loader, ecfg.text_batches)
    rl = flow.cfg.rl
    env = build_mixture(eval_specs(rl.data.envs, rl.data.eval_envs), tokenizer=tok)
    problems = env.sample(ecfg.arithmetic_problems, seed=rl.train.seed + 12345)  # RL's eval set
    harness_on = not ecfg.data_dir or Path(ecfg.data_dir).is_dir()  # "": the packaged data
    rows = []
    last_cfg = None
    for stage, name, path in flow.models():
        flow.console.print(f"eval {name}: {path}", markup=False)
        model = load_model(path).float().eval()
        last_cfg = model.config
        row: dict[str, Any] = {"kind": "model", "model": name, "stage": stage, "path": path}
        row["params"] = sum(p.numel() for p in model.parameters())
        if held:
            tb = token_byte_lengths(tok, model.config.vocab_size)
            row.update({f"text_{k}": v for k, v in text_loss(model, held, tb).items()})
        with torch.no_grad():
            m = evaluate_policy(model, tok, problems, env, max_new_tokens=ecfg.max_new_tokens)
        p, n = m["all/solved"], len(problems)
        row |= {
            "exact_match": p,
            "exact_match_stderr": math.sqrt(p * (1 - p) / n),
            "problems": n,
            "mean_length": m["mean_length"],
            "solved_by_env": {e: m[f"{e}/solved"] for e in env.envs if f"{e}/solved" in m},
        }
        log(row)
        rows.append(row)
        flow.console.print(
            f"eval {name}: text bpb {row.get('text_bpb', float('nan')):.4f} | "
            f"held-out solved {p:.3f} ± {row['exact_match_stderr']:.3f} (n={n})",
            markup=False,
        )
        tasks = []
        if stage in ecfg.spec_models and getattr(model, "mtp", None) is not None:
            tasks.append("spec_bench")
        if stage in ecfg.harness_models and harness_on:
            tasks += list(ecfg.harness_tasks)
        if tasks:
            cfg = EvalConfig(
                tasks=tasks,
                limit=None,
                data_dir=ecfg.data_dir,
                out_dir=str(out / name),
                max_new_tokens=ecfg.spec_new_tokens,
                prompt_format=ecfg.spec_prompt_format,
                progress=flow.progress,
            )
            loaded = LoadedModel(model=model, tokenizer=tok, name=name, source=path)
            _run_tasks(loaded, cfg, ecfg, out / name)
    if last_cfg is not None:
        for name, cfg in (
            ("speedrun", last_cfg),
            ("nemotron-3-super", get_preset("nemotron-3-super-120b-a12b")),
        ):
            for r in cache_memory_rows(name, cfg, ecfg.cache_contexts):
                log(r)
    return {"models": rows, "metrics": str(metrics), "harness": harness_on}


def _run_tasks(loaded: Any, cfg: Any, ecfg: Any, out: Path) -> None:
    """Harness tasks with per-task limits: SPEED-Bench prompts per category, else harness_limit."""
    spec = [t for t in cfg.tasks if t == "spec_bench"]
    rest = [t for t in cfg.tasks if t != "spec_bench"]
    if spec:
        evaluate(loaded, dataclasses.replace(cfg, tasks=spec, limit=ecfg.spec_prompts), out_dir=out)
    if rest:
        evaluate(
            loaded,
            dataclasses.replace(cfg, tasks=rest, limit=ecfg.harness_limit, prompt_format="base"),
            out_dir=out,
        )


# ---------------------------------------------------------------------------- the flow's stage
@dataclass(kw_only=True)
class EvalStageConfig:
    """What the eval stage measures on every model of the chain."""

    text_batches: int = 8  # held-out pretraining batches: loss and bits per byte
    arithmetic_problems: int = 96  # held-out problems of the RL eval set (every env), greedy
    max_new_tokens: int = 96
    spec_models: list[str] = field(default_factory=lambda: ["mtp_heal", "quantize"])
    spec_prompts: int = 4  # prompts per SPEED-Bench category (5 categories)
    spec_new_tokens: int = 48
    spec_prompt_format: Literal["base", "chat"] = "chat"
    # harness tasks on `harness_models`, over the packaged GSM8K / HumanEval / tinyshakespeare
    # (`data_dir` "") or a folder of them (run only when it exists)
    harness_tasks: list[str] = field(default_factory=lambda: ["base_easy"])
    harness_models: list[str] = field(default_factory=lambda: ["pretrain", "mtp_heal"])
    harness_limit: int = 32
    data_dir: str = ""
    cache_contexts: list[int] = field(
        default_factory=lambda: [2**k for k in range(10, 21)]  # 1K .. 1M tokens
    )


def _check(section: EvalStageConfig, cfg: Any, stages: tuple[Stage, ...]) -> None:
    model_stages = [s.name for s in stages if s.model]
    bad = sorted(set(section.spec_models + section.harness_models) - set(model_stages))
    if bad:
        raise ValueError(f"eval: unknown model stages {bad}; use {model_stages}")


def _settings(flow: Flow) -> dict[str, Any]:
    return {
        **dataclasses.asdict(flow.cfg.eval),
        "models": flow.models(),
        "rl_eval": flow.cfg.rl.to_dict()["data"]["envs"],
    }


def _headline(s: dict[str, Any], report: Report) -> str:
    ms = s["models"]
    n = ms[0]["problems"] if ms else 0
    return f"held-out solved (RL eval set, n={n}): " + ", ".join(
        f"{m['model']} {m['exact_match']:.2f}" for m in ms
    )


# every model of the chain on held-out text (bpb) and arithmetic (exact match), speculative
# decoding at draft length 7, cache memory vs context
STAGE = Stage(
    "eval",
    # pretrain's held-out text, rl's problems, and every model it evaluates
    inputs=("pretrain", "rl", "sft", "mtp_heal", "quantize", "qad"),
    config=EvalStageConfig,
    settings=_settings,
    run=lambda flow: evaluate_flow(flow, flow.stage_dir("eval")),
    check=_check,
    headline=_headline,
)
