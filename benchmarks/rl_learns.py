"""GRPO that learns, against the random-reward control, single-turn and multi-turn.

    hybridlm speedrun --only sft           # or any chat model: runs/speedrun/sft is the default
    python benchmarks/rl_learns.py [--base runs/speedrun/sft] [--out runs/rl_learns] [--tasks ...]

Each task starts from a short SFT of the base model that leaves it a choice the reward can teach,
then trains it twice with the same settings: once rewarded by the verifier (GRPO), once by a fair
coin (`reward: random`: no information about the task, so no gain may follow). Before and after,
every model is evaluated on the same held-out problems (another seed than training):

- **single** (default): 2-digit addition / subtraction. The SFT chats answer half the questions
  with the column-wise reasoning and half at once, with nothing in the prompt saying which
  (`mixed_modes`; reasoning-on and reasoning-off SFT data of Nemotron 3 Super §4.4 without the
  mode flag). Sampled at T = 1 the model reasons about half the time, and is mostly wrong when
  it does not; greedy it always reasons. GRPO has to find that reasoning pays. Reported: sampled
  pass@1 (T = 1, `--samples` per problem), greedy accuracy, and how often the sampled replies
  reason.
- **multi**: products of `--tool-digits`-digit numbers (default 2: the model cannot multiply in
  its head) with the calculator tool, after a short SFT on the environment's solved episodes,
  half of them calling the tool and half giving the answer at once. Sampled at T = 1 the model
  calls the tool about half the time and copies the operands and the result right when it does.
  Reported: episode success sampled (T = 1) and greedy, the tool-call rate and the turns per
  episode.

A gain is the mean over problems of the per-problem change (paired), its standard error the
standard deviation of those changes over sqrt(problems); the target is a gain >= 3 standard
errors for GRPO with the control not improving. Prints one line per model and verdict lines,
writes `OUT/results.json` (with the command, commit and versions) and `OUT/rl_learns.png` (per
task: the training draws' sampled success and the held-out greedy success by step of both runs;
for the tool task also the tool calls and turns per episode), from the runs' `metrics.jsonl`.
Finished runs in OUT are reused unless `--rerun`.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridlm.data.sft import arithmetic_conversations
from hybridlm.infer.engine import Engine
from hybridlm.infer.sampling import SamplingParams
from hybridlm.io import load, read_meta, resolve_checkpoint
from hybridlm.provenance import git_state
from hybridlm.report.plot import pyplot, save_figure
from hybridlm.rl.env_config import EnvConfig, build_environment
from hybridlm.rl.environments import ToolUseEnvironment
from hybridlm.rl.episodes import run_episodes
from hybridlm.rl.learner import RLConfig, RLDataConfig, RLRunConfig, RLTrainConfig, run_rl
from hybridlm.train.config import TrainConfig
from hybridlm.train.post_training import ChatSource, SFTDataConfig
from hybridlm.train.stages.sft import SFTConfig, SFTRunConfig, run_sft

TASKS = ("single", "multi")


# ---------------------------------------------------------------------- evaluation
def evaluate(
    model_path: str | Path,
    spec: EnvConfig,
    *,
    problems: int,
    samples: int,
    max_new_tokens: int,
    max_episode_tokens: int | None,
    seed: int,
) -> dict[str, Any]:
    """Sampled (T = 1, `samples` per problem) and greedy success of `model_path` on the first
    `problems` held-out problems of `spec`, as episodes (a single-turn environment's episode is
    one reply): per-problem success rates, tool calls and turns per episode."""
    loaded = load(model_path)
    model = loaded.model.float().eval()
    env = build_environment(spec, tokenizer=loaded.tokenizer)
    held = env.sample(problems, seed=seed)
    max_turns = spec.max_turns if isinstance(env, ToolUseEnvironment) else 1
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for mode, n, temperature in (("sampled", samples, 1.0), ("greedy", 1, 0.0)):
        engine = Engine(model, loaded.tokenizer, max_batch_size=64)
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed)
        reps = [p for p in held for _ in range(n)]
        with torch.no_grad():
            res = run_episodes(
                engine,
                env,
                reps,
                params,
                max_turns=max_turns,
                max_episode_tokens=max_episode_tokens,
            )
        per = [sum(r.reward >= 1.0 for r in res[i * n : (i + 1) * n]) / n for i in range(len(held))]
        out[mode] = {
            "success": sum(per) / len(per),
            "per_problem": per,
            "tool_calls": sum(r.info.get("tool_calls", 0) for r in res) / len(res),
            "turns": sum(r.turns for r in res) / len(res),
            "truncated": sum(r.truncated for r in res) / len(res),
            "reasons": sum(r.text.lstrip().startswith("<think>") for r in res) / len(res),
        }
    out["seconds"] = time.perf_counter() - t0
    return out


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean per-problem change and its standard error."""
    d = [a - b for a, b in zip(after, before, strict=True)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1)
    return mean, math.sqrt(var / len(d))


# ---------------------------------------------------------------------- runs
def tokenizer_spec(model_path: str | Path) -> str:
    """The tokenizer a run directory / checkpoint was trained with (`data.tokenizer`)."""
    meta = read_meta(resolve_checkpoint(Path(model_path)))
    return (meta["run_config"].get("data") or {}).get("tokenizer", "byte")


def short_sft(
    base: str, out: Path, name: str, conversations: list, *, steps: int, lr: float
) -> Path:
    """`base` briefly trained on `conversations` (written to `OUT/<name>.jsonl`); the run
    directory `OUT/<name>`."""
    path = out / f"{name}.jsonl"
    with path.open("w") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": messages}) + "\n")
    cfg = SFTRunConfig(
        model="tiny-super",  # unused: init_from
        data=SFTDataConfig(
            sources=[ChatSource(kind="file", path=str(path))],
            tokenizer=tokenizer_spec(base),
            seq_len=1024,
            batch_size=8,
            overflow="drop",
            held_out=16,
            seed=0,
        ),
        train=TrainConfig(
            lr=lr,
            min_lr=lr / 10,
            schedule="linear",
            warmup_steps=10,
            weight_decay=0.0,
            max_steps=steps,
            eval_interval=steps,
            log_interval=10,
            checkpoint_interval=0,
            keep_last_n=1,
            out_dir=str(out / name),
            init_from=base,
            seed=0,
        ),
        sft=SFTConfig(eval_generate=0, loss_norm="token"),
    )
    run_sft(cfg, overwrite=True)
    return out / name


def tool_sft(base: str, out: Path, args: argparse.Namespace) -> Path:
    """The short tool-use SFT: `base` trained on the calculator environment's solved episodes, a
    fraction `args.tool_rate` of them calling the tool and the rest giving the same answer at
    once (as if multiplied in the head, which the model cannot do)."""
    env = build_environment(tool_spec(args, seed=0))
    assert isinstance(env, ToolUseEnvironment)
    rng = random.Random(0)
    demos = []
    for messages in env.demonstrations(args.tool_demos, seed=0):
        if rng.random() >= args.tool_rate:  # system, user, then the final reply alone
            messages = [*messages[:2], {"role": "assistant", "content": messages[-1]["content"]}]
        demos.append(messages)
    return short_sft(base, out, "tool_sft", demos, steps=args.tool_steps, lr=args.tool_lr)


def mixed_modes(n: int, *, digits: int, think: float, seed: int) -> list[list[dict]]:
    """`n` arithmetic chats (`data.sft.arithmetic_conversations`, training seed), a fraction
    `think` of them with the column-wise reasoning and the rest answered at once, with nothing
    in the prompt saying which: a model trained on them reasons at T = 1 about `think` of the
    time and answers in its head otherwise, where it is mostly wrong."""
    rng = random.Random(seed)
    out = []
    for user, reply in arithmetic_conversations(n, digits=digits, seed=seed):
        if rng.random() >= think:
            reply = {"role": "assistant", "content": reply["content"]}
        out.append([user, reply])
    return out


def mode_sft(base: str, out: Path, args: argparse.Namespace) -> Path:
    """The single-turn task's SFT model: `base` briefly trained on `mixed_modes` chats."""
    chats = mixed_modes(args.mode_chats, digits=args.digits, think=args.think, seed=0)
    return short_sft(base, out, "mode_sft", chats, steps=args.mode_steps, lr=args.mode_lr)


def tool_spec(args: argparse.Namespace, *, seed: int) -> EnvConfig:
    return EnvConfig(
        kind="calculator",
        digits=args.tool_digits,
        num_problems=4000,
        seed=seed,
        max_turns=args.max_turns,
    )


def single_spec(args: argparse.Namespace, *, seed: int) -> EnvConfig:
    return EnvConfig(kind="sft_arithmetic", digits=args.digits, num_problems=4000, seed=seed)


def rl_config(
    base: str, out: Path, reward: str, task: str, args: argparse.Namespace
) -> RLRunConfig:
    spec = single_spec if task == "single" else tool_spec
    return RLRunConfig(
        train=RLTrainConfig(
            init_from=base,
            out_dir=str(out),
            max_steps=args.steps if task == "single" else args.tool_rl_steps,
            lr=args.lr,
            eval_interval=args.eval_interval,
            seed=0,
        ),
        data=RLDataConfig(
            envs=[spec(args, seed=1)],
            eval_envs=[spec(args, seed=2)],
            eval_problems=args.curve_problems,
        ),
        rl=RLConfig(
            reward=reward,
            groups_per_step=args.groups,
            group_size=args.group_size,
            max_draws=3 * args.groups,
            max_new_tokens=args.max_new_tokens,
            max_episode_tokens=args.max_episode_tokens if task == "multi" else 0,
            overlong_filter=task == "multi",
            freeze_router=args.freeze_router,
            temperature=1.0,
            executor=args.executor,
            num_workers=1,
            max_policy_lag=1,
            micro_batch_size=16,
        ),
    )


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


# ---------------------------------------------------------------------- report
def smooth(points: list[tuple[int, float]], k: int = 5) -> list[tuple[int, float]]:
    """Trailing mean over `k` steps."""
    ys = [y for _, y in points]
    windows = [ys[max(0, i - k + 1) : i + 1] for i in range(len(ys))]
    return [(x, sum(w) / len(w)) for (x, _), w in zip(points, windows, strict=True)]


def plot(results: dict[str, Any], out: Path, png: Path) -> None:
    """Per task: the training draws' sampled success (the verifier's verdict on every drawn
    sample, T = 1; trailing mean of 5 steps) and the held-out greedy success by step; for the
    tool task also the tool calls and turns per episode of the trained batches."""
    labels = {"grpo": "GRPO (verifier reward)", "control": "random reward (control)"}
    tasks = [t for t in TASKS if t in results]
    panels = 2 * len(tasks) + ("multi" in tasks)
    plt = pyplot()
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8), squeeze=False)
    axes = list(axes[0])
    for task in tasks:
        name = "single-turn" if task == "single" else "tool use"
        draws, held = axes.pop(0), axes.pop(0)
        for run, label in labels.items():
            got = rows(out / task / run)
            train = [(r["step"], r["draw_solved"]) for r in got if "draw_solved" in r]
            ev = [(r["step"], r["all/solved"]) for r in got if r["kind"] == "eval"]
            if train:
                draws.plot(*zip(*smooth(train), strict=True), label=label)
            if ev:
                held.plot(*zip(*ev, strict=True), marker="o", label=label)
        draws.set(title=f"{name}: training draws, sampled (T = 1)", ylabel="fraction solved")
        held.set(title=f"{name}: held-out, greedy", ylabel="fraction solved")
        for ax in (draws, held):
            ax.set(xlabel="GRPO step", ylim=(-0.02, 1.02))
            ax.legend(fontsize=8)
    if "multi" in tasks:
        ax = axes.pop(0)
        for run, label in labels.items():
            train = [r for r in rows(out / "multi" / run) if r["kind"] == "train"]
            for key, style, what in (("tool_calls", "-", "tool calls"), ("turns", "--", "turns")):
                pts = [
                    (r["step"], r[f"batch/calculator/{key}"])
                    for r in train
                    if f"batch/calculator/{key}" in r
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), linestyle=style, label=f"{what}, {label}")
        ax.set(title="tool use: trained batches", xlabel="GRPO step", ylabel="per episode")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    save_figure(fig, png)


def run_task(task: str, base: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    spec = (single_spec if task == "single" else tool_spec)(args, seed=2)
    kw = dict(
        problems=args.problems,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        max_episode_tokens=args.max_episode_tokens if task == "multi" else None,
        seed=12345,
    )
    res: dict[str, Any] = {"base": base, "before": evaluate(base, spec, **kw)}
    for run, reward in (("grpo", "verifier"), ("control", "random")):
        path = out / task / run
        if args.rerun or not (path / "model").is_dir():
            t0 = time.perf_counter()
            run_rl(rl_config(base, path, reward, task, args), progress=True, overwrite=True)
            res[f"{run}_train_s"] = time.perf_counter() - t0
        res[run] = evaluate(path / "model", spec, **kw)
    for run in ("grpo", "control"):
        for mode in ("sampled", "greedy"):
            gain, se = paired_gain(
                res["before"][mode]["per_problem"], res[run][mode]["per_problem"]
            )
            res[run][mode]["gain"], res[run][mode]["gain_se"] = gain, se
    return res


def line(task: str, name: str, r: dict[str, Any]) -> str:
    s, g = r["sampled"], r["greedy"]
    text = f"[{task}] {name}: sampled pass@1 {s['success']:.3f} | greedy {g['success']:.3f}"
    if "gain" in s:
        z = s["gain"] / s["gain_se"] if s["gain_se"] > 0 else float("nan")
        text += (
            f" | sampled gain {s['gain']:+.3f} ± {s['gain_se']:.3f} ({z:+.1f} SE)"
            f" | greedy gain {g['gain']:+.3f} ± {g['gain_se']:.3f}"
        )
    if task == "multi":
        text += f" | tool calls {s['tool_calls']:.2f} | turns {s['turns']:.2f}"
    else:
        text += f" | reasons (T = 1) {s['reasons']:.2f}"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="runs/speedrun/sft", help="the SFT model (run directory)")
    p.add_argument("--out", default="runs/rl_learns")
    p.add_argument("--tasks", default="single,multi")
    p.add_argument("--digits", type=int, default=2, help="single-turn operands' digits")
    p.add_argument("--tool-digits", type=int, default=2, help="calculator operands' digits")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps, single-turn")
    p.add_argument("--tool-rl-steps", type=int, default=20, help="GRPO steps, tool use")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--groups", type=int, default=8, help="prompts per GRPO step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-episode-tokens", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--problems", type=int, default=256, help="held-out problems evaluated")
    p.add_argument("--samples", type=int, default=8, help="samples per problem for pass@1")
    p.add_argument("--curve-problems", type=int, default=64, help="problems of the curves")
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--tool-demos", type=int, default=2000)
    p.add_argument("--tool-rate", type=float, default=0.5, help="of the demos calling the tool")
    p.add_argument("--mode-chats", type=int, default=3000, help="single-turn SFT chats")
    p.add_argument("--think", type=float, default=0.5, help="of them with reasoning")
    p.add_argument("--mode-steps", type=int, default=100, help="single-turn SFT steps")
    p.add_argument("--mode-lr", type=float, default=3e-4)
    p.add_argument("--tool-steps", type=int, default=300, help="tool-use SFT steps")
    p.add_argument("--tool-lr", type=float, default=1e-3)
    p.add_argument("--executor", default="ray", choices=["ray", "inline"])
    p.add_argument(
        "--freeze-router",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="MoE routers fixed during RL",
    )
    p.add_argument("--rerun", action="store_true")
    args = p.parse_args(argv)
    if not Path(args.base).exists():
        p.error(f"--base {args.base}: no such model; run `hybridlm speedrun --only sft` first")
    tasks = [t for t in args.tasks.split(",") if t]
    if set(tasks) - set(TASKS):
        raise SystemExit(f"--tasks: choose from {TASKS}")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "commit": git_state(Path(__file__).resolve().parent).get("commit") or "unknown",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for task in tasks:
        name, build = ("mode_sft", mode_sft) if task == "single" else ("tool_sft", tool_sft)
        base = out / name
        if args.rerun or not (base / "checkpoints").is_dir():
            base = build(args.base, out, args)
        base = str(base)
        results[task] = run_task(task, base, out, args)
        for name in ("before", "grpo", "control"):
            print(line(task, name, results[task][name]), flush=True)
    results["seconds"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out, out / "rl_learns.png")
    for task in tasks:
        g, c = results[task]["grpo"]["sampled"], results[task]["control"]["sampled"]
        # a gain, >= 3 standard errors (no change at all is not one), the control not improving
        met = g["gain"] > 0 and g["gain"] >= 3 * g["gain_se"] and c["gain"] <= 0 + 1e-12
        diff, diff_se = paired_gain(c["per_problem"], g["per_problem"])
        print(
            f"[verdict] {task}: GRPO sampled gain {g['gain']:+.3f} = "
            f"{g['gain'] / max(g['gain_se'], 1e-12):+.1f} SE; control {c['gain']:+.3f} "
            f"± {c['gain_se']:.3f}; GRPO - control {diff:+.3f} ± {diff_se:.3f}; "
            f"target (>= 3 SE, control not improving): {'met' if met else 'MISSED'}"
        )
    print(f"[rl_learns] {results['seconds'] / 60:.1f} min | {out / 'rl_learns.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
