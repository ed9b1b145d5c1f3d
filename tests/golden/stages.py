"""The golden runs: one short, seeded fp32 run of every training stage through the stage's own
entry point, and the comparison of a replay with its recording. Shared by `record.py` (which
writes `recordings/<platform>/<stage>.json`, `recordings.py`) and `tests/test_golden.py` (which
replays every stage and compares).

A runner builds a tiny run under a scratch directory from the tiny configs of the stage tests
(`tests/_tiny.py`; the stages' own tests drive them the same way), runs it on the CPU and returns
`(settings, rows)`: the run's configuration (scratch paths replaced by `<tmp>`) and the rows the
stage wrote to its `metrics.jsonl`, wall-clock fields dropped (`*_s`, `*_per_s`, `mfu`) and nested
mappings flattened into dotted keys (`staleness.0`). `run_stage` makes runs repeatable: one torch
thread (float reductions depend on the thread count), every global RNG seeded first, and the
caller's thread count and RNG states restored afterwards, so that nothing leaks between stages.

Data is generated (text files, arithmetic chats and preference pairs, random prompts); nothing
is read from ../shared or downloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _tiny import arithmetic_pairs, lowercase_first_env, tiny_run, tiny_train_model
from hybridlm.config import ModelConfig
from hybridlm.data.tokenizer import ByteTokenizer
from hybridlm.interop.hf import save_pretrained
from hybridlm.io.checkpoint import save_checkpoint
from hybridlm.model.model import HybridLM
from hybridlm.report.plot import read_metrics
from hybridlm.rl.environments import MixtureEnvironment
from hybridlm.train.config import TrainConfig

Row = dict[str, Any]
Result = tuple[dict[str, Any], list[Row]]

# Relative tolerance of a number replayed on the platform it was recorded on (`recordings.py`):
# fp32 runs there repeat bit for bit (also across torch 2.13 / 2.14.1 and thread counts); 1e-6
# (~8 fp32 ulps) leaves room for a reordered sum, nothing more.
RTOL = 1e-6
# Absolute floor of the fields that are differences of O(1) fp32 numbers, 0 in exact arithmetic
# (`RESIDUALS`: DPO rewards and margin at step 1, policy == reference; the RL engine-trainer
# log-prob gap; a GRPO loss of centred advantages, ~1e-9 at step 1): their size is rounding noise
# of O(1) operands (one fp32 ulp of 1 is 1.2e-7), so relative differences of them mean nothing.
# Every other value, however small (learning rates, MoE aux ~3e-4, KL ~2e-2), is held to RTOL
# of itself.
ATOL = 1e-7
RESIDUALS = {
    "dpo": frozenset(
        f"{p}reward_{k}" for p in ("", "eval_") for k in ("chosen", "rejected", "margin")
    ),
    "rl": frozenset({"loss", "logprob_diff_mean"}),
}
# Relative tolerance of a replay compared with a recording from another platform
# (`recordings.py`: kernel family, native kernels on/off, CPU model), per stage: 4x or more the
# largest difference measured between platforms, rounded up. Measured (largest over every
# number of a stage) on an AMD EPYC (AVX512) replaying with the native kernels on and off and
# with ATEN_CPU_CAPABILITY avx512 / avx2 / default (6 variants), against recordings from the
# same machine and from an Intel Xeon (AVX512, native kernels):
#   pretrain 3.0e-7, SFT 3.2e-5, DPO 3.2e-6, distill 4.2e-6, RL 4.9e-4, MTP boost 4.3e-7
# (RL's 20 steps amplify rounding: its grad_norm at step 20 is always the largest; SFT's too).
# `test_recordings_agree_across_platforms` holds every pair of recordings to these: a platform
# recorded later that differs more widens them, with the new measurement written here.
CROSS_PLATFORM_RTOL = {
    "pretrain": 1e-5,
    "sft": 3e-4,
    "dpo": 3e-5,
    "distill": 3e-5,
    "rl": 2e-3,
    "mtp_boost": 1e-5,
}

# wall-clock fields: throughput, MFU and the seconds a phase took are not behaviour
_TIMING = re.compile(r"(^|[._])(mfu|\w*_s)$")


# ---------------------------------------------------------------------------- isolation
@contextlib.contextmanager
def isolated(seed: int = 0) -> Iterator[None]:
    """One intra-op thread and every global RNG seeded for the run; the caller's thread count
    and RNG states are restored afterwards, so neither leaks into the next run or test."""
    threads = torch.get_num_threads()
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


# ---------------------------------------------------------------------------- rows + settings
def flatten(row: dict[str, Any], prefix: str = "") -> Row:
    """Nested mappings as dotted keys (`active_sampling.kept`), wall-clock fields dropped."""
    out: Row = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if _TIMING.search(name):
            continue
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def metrics_rows(path: str | Path) -> list[Row]:
    """Every row of a metrics.jsonl, flattened (module docstring)."""
    return [flatten(r) for r in read_metrics(path)]


def plain(value: Any, tmp: Path) -> Any:
    """A config as JSON-ready data, the scratch directory written as `<tmp>`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): plain(v, tmp) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, tmp) for v in value]
    if isinstance(value, str) and value.startswith(str(tmp)):
        return "<tmp>" + value[len(str(tmp)) :]
    return value


def _train(out: Path, **kw: Any) -> TrainConfig:
    """The loop settings of the post-training runs (as in tests/test_sft.py): log every step, no
    periodic eval or checkpoint (the loops still evaluate at 0 and at the end and save once)."""
    base: dict[str, Any] = dict(
        lr=3e-3,
        warmup_steps=2,
        max_steps=20,
        schedule="constant",
        eval_interval=0,
        log_interval=1,
        checkpoint_interval=0,
        keep_last_n=0,
        out_dir=str(out),
        device="cpu",
        progress=False,
        plot=False,
    )
    return TrainConfig(**{**base, **kw})


def _checkpoint(out: Path, cfg: ModelConfig, *, seed: int, sharpen: float = 1.0) -> str:
    """A hybridlm training checkpoint of a freshly initialised `cfg` (as tests/test_dpo.py and
    tests/test_distill.py save them); `sharpen` scales the LM head (a teacher far from
    uniform)."""
    from hybridlm.model.model import build_model

    model = build_model(cfg, seed=seed, device=torch.device("cpu"))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    meta = {"run_config": {"model": cfg.to_dict(), "data": {"tokenizer": "byte"}}}
    return str(save_checkpoint(out, step=0, model=model, optimizer=None, meta=meta))


# ---------------------------------------------------------------------------- 1. pretrain
def pretrain(tmp: Path) -> Result:
    """`run_pretrain` of `tiny_train_model` (Mamba, LatentMoE, attention; MTP depth 2) on
    generated text (`tiny_run`): the WSD schedule through warm-up, stable and decay, two
    micro-batches per step (the accumulated MoE balancing loss), the MoE bias step after every
    update, held-out evals at 10 and 20."""
    from hybridlm.train.stages.pretrain import run_pretrain

    cfg = tiny_run(
        tmp,
        "pretrain",
        max_steps=20,
        warmup_steps=3,
        grad_accum=2,
        eval_interval=10,
        checkpoint_interval=0,
        device="cpu",
    )
    run_pretrain(cfg)
    return plain(cfg.to_dict(), tmp), metrics_rows(Path(cfg.train.out_dir) / "metrics.jsonl")


# ---------------------------------------------------------------------------- 2. SFT
def sft(tmp: Path) -> Result:
    """`run_sft` of `tiny_train_model` on generated arithmetic chats (as tests/test_sft.py):
    the two-stage loss normalisation (token for 10 steps, then sample), the MTP loss with
    weight 0.3, the MoE balancing loss and bias step; held-out NLL at 0 and 20."""
    from hybridlm.train.post_training import ChatSource, SFTDataConfig
    from hybridlm.train.stages.sft import SFTConfig, SFTRunConfig, run_sft

    cfg = SFTRunConfig(
        model=tiny_train_model(),
        data=SFTDataConfig(
            sources=[ChatSource(kind="arithmetic", max_rows=120, digits=1, seed=3)],
            seq_len=256,
            batch_size=4,
            held_out=8,
        ),
        train=_train(tmp / "sft"),
        sft=SFTConfig(eval_generate=0, loss_norm="two_stage", stage2_start=0.5),
    )
    run_sft(cfg)
    return plain(cfg.to_dict(), tmp), metrics_rows(tmp / "sft" / "metrics.jsonl")


# ---------------------------------------------------------------------------- 3. DPO
def dpo(tmp: Path) -> Result:
    """`run_dpo` (length-normalised `dpo_norm`, beta 5) of `tiny_train_model` with its own
    initial weights as the reference, on generated preference pairs, two micro-batches of 2
    pairs per step; held-out preference metrics at 0 and 20."""
    from hybridlm.train.pairs import PairDataConfig
    from hybridlm.train.stages.dpo import DPOConfig, DPORunConfig, run_dpo

    pairs = tmp / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_pairs(48, seed=2)))
    init = _checkpoint(tmp / "dpo_init", tiny_train_model(), seed=0)
    cfg = DPORunConfig(
        data=PairDataConfig(path=str(pairs), max_len=256, batch_size=2, held_out=8),
        train=_train(
            tmp / "dpo", lr=1e-3, warmup_steps=1, weight_decay=0.0, grad_accum=2, init_from=init
        ),
        dpo=DPOConfig(loss="dpo_norm"),
    )
    run_dpo(cfg)
    settings = plain(cfg.to_dict(), tmp)
    settings["init"] = {"model": tiny_train_model().to_dict(), "seed": 0}
    settings["pairs"] = {"kind": "arithmetic_pairs", "n": 48, "seed": 2}
    return settings, metrics_rows(tmp / "dpo" / "metrics.jsonl")


# ---------------------------------------------------------------------------- 4. distill
def distill(tmp: Path) -> Result:
    """Offline `run_distill` (top-k forward KL 0.9 + CE 0.1) of a fresh `tiny_train_model`
    student without MTP from a differently initialised (seed 5), sharpened (LM head x30)
    `tiny_train_model` teacher on generated arithmetic chats (as tests/test_distill.py); linear
    decay; the teacher's reference row, held-out NLL and KL at 0 and 20."""
    from hybridlm.train.distillation import DistillConfig, DistillRunConfig
    from hybridlm.train.post_training import ChatSource, SFTDataConfig
    from hybridlm.train.stages.distill import run_distill

    teacher = _checkpoint(tmp / "teacher", tiny_train_model(), seed=5, sharpen=30.0)
    cfg = DistillRunConfig(
        model=tiny_train_model(mtp=False),
        data=SFTDataConfig(
            sources=[ChatSource(kind="arithmetic", max_rows=80, digits=1, seed=3)],
            seq_len=128,
            batch_size=4,
            held_out=8,
        ),
        train=_train(
            tmp / "distill",
            lr=1e-2,
            min_lr=3e-4,
            schedule="linear",
            warmup_steps=1,
            weight_decay=0.0,
        ),
        distill=DistillConfig(teacher=teacher, eval_generate=0),
    )
    run_distill(cfg)
    settings = plain(cfg.to_dict(), tmp)
    settings["teacher"] = {"model": tiny_train_model().to_dict(), "seed": 5, "sharpen": 30.0}
    return settings, metrics_rows(tmp / "distill" / "metrics.jsonl")


# ---------------------------------------------------------------------------- 5. RL
def rl(tmp: Path) -> Result:
    """`run_rl`: GRPO with the inline rollout executor (the engine in this process, no Ray) from
    a fresh `tiny_train_model` without MTP; 4 groups of 8 four-token samples per step, active
    sampling, one-step policy lag, truncated importance sampling; greedy held-out evals at 0,
    10 and 20."""
    from hybridlm.rl.learner import RLConfig, RLDataConfig, RLRunConfig, RLTrainConfig, run_rl

    policy = tmp / "policy"
    save_pretrained(HybridLM(tiny_train_model(mtp=False), seed=0), policy)
    cfg = RLRunConfig(
        train=RLTrainConfig(
            init_from=str(policy), out_dir=str(tmp / "rl"), max_steps=20, lr=1e-2, eval_interval=10
        ),
        data=RLDataConfig(eval_problems=8),
        rl=RLConfig(
            groups_per_step=4,
            group_size=8,
            max_draws=12,
            max_new_tokens=4,
            executor="inline",
            micro_batch_size=16,
        ),
    )
    run_rl(
        cfg,
        env=MixtureEnvironment([lowercase_first_env()]),
        eval_env=MixtureEnvironment([lowercase_first_env(name="held")]),
        progress=False,
    )
    settings = plain(cfg.to_dict(), tmp)
    settings["policy"] = {"model": tiny_train_model(mtp=False).to_dict(), "seed": 0}
    settings["env"] = {"train": "LowercaseFirst(64, 'lower')", "eval": "LowercaseFirst(64, 'held')"}
    return settings, metrics_rows(tmp / "rl" / "metrics.jsonl")


# ---------------------------------------------------------------------------- 6. MTP boost
def mtp_boost(tmp: Path) -> Result:
    """`run_mtp_boost` of the MTP head (depth 2) of a fresh `tiny_train_model` on 16 of its own
    sampled continuations of random byte prompts (as tests/test_mtp_boost.py): frozen backbone,
    NLL + KL to the backbone, hidden-state mixing at depth 2, the head's MoE bias step, logged
    every step; speculative acceptance before and after (greedy and T=1)."""
    from hybridlm.train.mtp_boost import (
        MTPBoostConfig,
        MTPBoostDataConfig,
        MTPBoostRunConfig,
        MTPBoostTrainConfig,
        run_mtp_boost,
    )

    model = HybridLM(tiny_train_model(), seed=0)
    tok = ByteTokenizer()
    g = torch.Generator().manual_seed(0)
    prompts = [[tok.bos_id, *torch.randint(32, 127, (7,), generator=g).tolist()] for _ in range(10)]
    cfg = MTPBoostRunConfig(
        train=MTPBoostTrainConfig(
            max_steps=20,
            lr=3e-3,
            min_lr=0.1 * 3e-3,  # what the boost's decay floor was before it was a setting
            warmup_steps=5,
            log_interval=1,
            out_dir=str(tmp / "mtp_boost"),
        ),
        data=MTPBoostDataConfig(
            batch_size=8, num_sequences=16, gen_len=24, gen_temperature=1.0, eval_prompts=2
        ),
        mtp_boost=MTPBoostConfig(eval_new_tokens=12, draft_len=2, eval_temperatures=[0.0, 1.0]),
    )
    run_mtp_boost(model, tok, prompts[:8], prompts[8:], cfg, progress=False)
    settings = plain(cfg, tmp)
    settings["model"] = {"config": tiny_train_model().to_dict(), "seed": 0}
    settings["prompts"] = (
        "10 x [bos] + 7 bytes in [32, 127) from Generator(seed 0); 8 train, 2 eval"
    )
    return settings, metrics_rows(tmp / "mtp_boost" / "metrics.jsonl")


STAGES: dict[str, Callable[[Path], Result]] = {
    "pretrain": pretrain,
    "sft": sft,
    "dpo": dpo,
    "distill": distill,
    "rl": rl,
    "mtp_boost": mtp_boost,
}


def run_stage(name: str, tmp: Path) -> Result:
    """Run one stage in `isolated()` under the scratch directory `tmp`."""
    with isolated():
        return STAGES[name](Path(tmp))


def split_rows(rows: list[Row]) -> tuple[list[Row], list[Row]]:
    """(per-step rows of kind "train" without their kind, every other row in log order)."""
    steps = [{k: v for k, v in r.items() if k != "kind"} for r in rows if r.get("kind") == "train"]
    return steps, [r for r in rows if r.get("kind") != "train"]


# ---------------------------------------------------------------------------- comparison
def difference(a: Any, b: Any, residual: bool = False) -> float:
    """How far replayed `b` is from recorded `a`: for numbers |a - b| / max(|a|, |b|), so a
    value agrees iff this is <= RTOL (a `residual` field: |a - b| / max(|a|, |b|, ATOL / RTOL),
    within ATOL near zero); counts (two ints), flags, strings and None must be equal (0 or
    inf); lists element-wise."""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return max((difference(x, y, residual) for x, y in zip(a, b, strict=True)), default=0.0)
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, numbers):
        return 0.0 if a == b and type(a) is type(b) else math.inf
    if not isinstance(b, numbers):
        return math.inf
    if isinstance(a, int) and isinstance(b, int):
        return 0.0 if a == b else math.inf
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:  # also equal infinities
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), ATOL / RTOL if residual else 0.0)


def mismatches(
    section: str,
    recorded: list[Row],
    replayed: list[Row],
    rtol: float = RTOL,
    residuals: frozenset[str] = frozenset(),
) -> list[str]:
    """Every recorded value of `section` that the replay does not reproduce within `rtol`, in
    order: step by step, field by field (the stage's `residuals` with the ATOL floor). Fields
    the replay adds are not compared (a new metric is no change of behaviour); a recorded field
    the replay lacks is a mismatch."""
    out = []
    if len(recorded) != len(replayed):
        out.append(f"{section}: {len(recorded)} rows recorded, {len(replayed)} replayed")
    for i, (rec, got) in enumerate(zip(recorded, replayed, strict=False)):
        where = f"{section}[{i}] (step {rec.get('step')}, kind {rec.get('kind', 'train')})"
        for key, want in rec.items():
            if key not in got:
                out.append(f"{where} field {key!r}: recorded {want!r}, missing in the replay")
                continue
            d = difference(want, got[key], key in residuals)
            if d > rtol:
                floor = f", abs {ATOL * rtol / RTOL:g}" if key in residuals else ""
                out.append(
                    f"{where} field {key!r}: recorded {want!r}, replayed {got[key]!r} "
                    f"(difference {d:.3g}; tolerance rel {rtol:g}{floor})"
                )
    return out


def replay_mismatches(recorded: dict[str, Any], rows: list[Row], rtol: float) -> list[str]:
    """`mismatches` of a replay's rows from a recording, steps then other rows."""
    steps, other = split_rows(rows)
    res = RESIDUALS.get(recorded["stage"], frozenset())
    return mismatches("steps", recorded["steps"], steps, rtol, res) + mismatches(
        "other_rows", recorded["other_rows"], other, rtol, res
    )


def largest_difference(recorded: dict[str, Any], rows: list[Row]) -> tuple[float, str]:
    """The largest `difference` of any recorded value of a golden from a replay's rows, and
    where (`steps[3].loss`): what `record.py --check` reports."""
    steps, other = split_rows(rows)
    res = RESIDUALS.get(recorded["stage"], frozenset())
    worst, where = 0.0, ""
    for section, rec_rows, got_rows in (
        ("steps", recorded["steps"], steps),
        ("other_rows", recorded["other_rows"], other),
    ):
        if len(rec_rows) != len(got_rows):
            return math.inf, f"{section}: {len(rec_rows)} rows recorded, {len(got_rows)} now"
        for i, (rec, got) in enumerate(zip(rec_rows, got_rows, strict=True)):
            for key, value in rec.items():
                d = difference(value, got[key], key in res) if key in got else math.inf
                if d > worst:
                    worst, where = d, f"{section}[{i}].{key}"
    return worst, where


def rows_of(recorded: dict[str, Any]) -> list[Row]:
    """A recording's numbers as the rows of a run (for `largest_difference` between two
    recordings)."""
    return [{"kind": "train", **r} for r in recorded["steps"]] + list(recorded["other_rows"])


def settings_diff(recorded: Any, current: Any, prefix: str = "") -> list[str]:
    """Dotted paths where the current settings differ from the recorded ones."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        out = []
        for k in dict.fromkeys([*recorded, *current]):
            if k not in recorded or k not in current:
                out.append(f"{prefix}{k}")
            else:
                out += settings_diff(recorded[k], current[k], f"{prefix}{k}.")
        return out
    return [] if recorded == current else [prefix.rstrip(".")]
