"""Cached teacher top-k against the online teacher: training speed, memory per token, and the
cost of the one teacher pass (`hybridlm distill-cache`, `distill.teacher_cache`).

    python benchmarks/teacher_cache.py [--data chat|text] [--steps 30] [--rounds 2]
        [--out runs/teacher_cache_bench]

Teacher: `tiny-super` (Nemotron 3 Super's shape at ~10 M parameters, vocabulary 4,096,
initialised from a seed: speed and memory do not depend on its weights). Student: a 1.6 M
parameter hybrid (`MEM*EME`, the speedrun's pretrain shape) with the same vocabulary. Top-128
forward KL + CE (0.9 / 0.1), 8 x 256-token packed rows, byte tokenizer (the models' 4,096-wide
output layers set the cost). Data:
- `chat`: offline distillation (`hybridlm distill`) on 1,000 generated arithmetic chats;
- `text`: pretraining by distillation (`hybridlm pretrain` with a `distill` section) on the
  source files of `--files` standard-library modules, the cache aligned with the data shards.

Measured in this run, on this machine:
- training tokens / s of the online run and of the cached run, `--rounds` alternating pairs of
  `--steps` steps each (the median step of each run; the ratio cached / online per round);
- the cache pass: tokens / s and bytes per token on disk (float32 and bfloat16 log-probs);
- memory per token the teacher needs during training: online, its parameters plus the fp32
  logits of a micro-batch ([rows, seq, vocab]) per token; cached, the k ids and log-probs read.
Writes `OUT/results.json` (`OUT/results_text.json` for text; command, commit, versions, CPU)
and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import yaml

from hybridlm.config import ModelConfig
from hybridlm.data.config import DataConfig, SourceConfig
from hybridlm.io.checkpoint import save_checkpoint
from hybridlm.model.model import HybridLM, build_model
from hybridlm.presets import get_preset
from hybridlm.provenance import command_line, cpu_info, git_state, library_versions
from hybridlm.report.plot import read_metrics
from hybridlm.train.config import RunConfig, TeacherConfig, TrainConfig
from hybridlm.train.distillation import DistillConfig, DistillRunConfig
from hybridlm.train.post_training import ChatSource, SFTDataConfig
from hybridlm.train.stages.distill import cache_teacher, run_distill
from hybridlm.train.stages.pretrain import cache_text_teacher, run_pretrain

VOCAB, K, ROWS, SEQ = 4096, 128, 8, 256
ROOT = Path(__file__).resolve().parents[1]


def student_config() -> ModelConfig:
    """The speedrun's pretrain model (configs/speedrun.yaml) at the teacher's vocabulary."""
    spec = yaml.safe_load((ROOT / "configs" / "speedrun.yaml").read_text())["pretrain"]["model"]
    return ModelConfig.from_dict({**spec, "vocab_size": VOCAB})


def train_config(work: Path, name: str, steps: int) -> TrainConfig:
    return TrainConfig(
        lr=1e-3,
        warmup_steps=1,
        max_steps=steps,
        eval_interval=0,
        log_interval=1,
        checkpoint_interval=0,
        keep_last_n=0,
        out_dir=str(work / name),
        device="cpu",
        progress=False,
        plot=False,
        intra_doc_masking=True,  # the teacher sees each document piece alone (the cache's view)
    )


def run_config(
    data: str, work: Path, name: str, teacher: str, steps: int, files: int
) -> DistillRunConfig | RunConfig:
    if data == "text":
        return RunConfig(
            model=student_config(),
            data=DataConfig(
                sources=[SourceConfig(name="code", kind="stdlib", max_files=files)],
                tokenizer="byte",
                shards_dir=str(work / "shards"),
                seq_len=SEQ,
                batch_size=ROWS,
                eval_fraction=0.0,
                num_workers=0,
            ),
            train=train_config(work, name, steps),
            distill=TeacherConfig(teacher=teacher, top_k=K),
        )
    return DistillRunConfig(
        model=student_config(),
        data=SFTDataConfig(
            sources=[ChatSource(kind="arithmetic", max_rows=1000, digits=3, seed=0)],
            tokenizer="byte",
            seq_len=SEQ,
            batch_size=ROWS,
            held_out=16,
        ),
        train=train_config(work, name, steps),
        distill=DistillConfig(teacher=teacher, top_k=K, eval_generate=0),
    )


def build_cache(run: DistillRunConfig | RunConfig) -> dict:
    if isinstance(run, RunConfig):
        return cache_text_teacher(run, progress=False)
    return cache_teacher(run, progress=False)


def train(run: DistillRunConfig | RunConfig) -> None:
    if isinstance(run, RunConfig):
        run_pretrain(run)
    else:
        run_distill(run)


def median_rate(run: DistillRunConfig) -> float:
    rows = read_metrics(Path(run.train.out_dir) / "metrics.jsonl")
    rates = [r["tokens_per_s"] for r in rows if r["kind"] == "train" and r["step"] > 2]
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/teacher_cache_bench"))
    ap.add_argument("--data", choices=("chat", "text"), default="chat")
    ap.add_argument("--files", type=int, default=8, help="text: standard-library modules read")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hybridlm-tcache-") as tmp:
        work = Path(tmp)
        tcfg = get_preset("tiny-super")
        teacher_model = build_model(tcfg, seed=0, device=torch.device("cpu"))
        meta = {"run_config": {"model": tcfg.to_dict(), "data": {"tokenizer": "byte"}}}
        teacher = str(
            save_checkpoint(
                work / "teacher", step=0, model=teacher_model, optimizer=None, meta=meta
            )
        )
        teacher_bytes = sum(p.numel() * p.element_size() for p in teacher_model.parameters())

        cache_runs = {}
        for dtype in ("float32", "bfloat16"):
            run = run_config(args.data, work, f"cached_{dtype}", teacher, args.steps, args.files)
            run.distill.teacher_cache = str(work / f"cache_{dtype}")
            run.distill.teacher_cache_dtype = dtype
            built = build_cache(run)
            disk = sum(f.stat().st_size for f in Path(run.distill.teacher_cache).rglob("*.npy"))
            cache_runs[dtype] = {
                **built,
                "tokens_per_s": built["tokens"] / built["seconds"],
                "disk_bytes_per_token": disk / built["tokens"],
            }
        rounds = []
        for r in range(args.rounds):
            online = run_config(args.data, work, f"online_{r}", teacher, args.steps, args.files)
            cached = run_config(args.data, work, f"cached_{r}", teacher, args.steps, args.files)
            cached.distill.teacher_cache = str(work / "cache_float32")
            cached.distill.teacher = ""  # the cache stands in for the teacher
            train(online)
            train(cached)
            a, b = median_rate(online), median_rate(cached)
            rounds.append({"online_tokens_per_s": a, "cached_tokens_per_s": b, "ratio": b / a})
            print(f"round {r}: online {a:.0f} tok/s, cached {b:.0f} tok/s, ratio {b / a:.2f}")
    logits_per_token = VOCAB * 4  # the fp32 logits row of each token of a micro-batch
    report = {
        "command": command_line(),
        "git": git_state(Path(__file__).resolve().parent),
        "versions": library_versions(),
        "cpu": cpu_info(),
        "data": args.data,
        "teacher": "tiny-super",
        "teacher_params": teacher_model.count_params(),
        "student_params": HybridLM(student_config(), seed=0).count_params(),
        "k": K,
        "vocab": VOCAB,
        "rounds": rounds,
        "cache_pass": cache_runs,
        "memory": {
            "online_teacher_param_bytes": teacher_bytes,
            "online_logit_bytes_per_token": logits_per_token,
            "cached_bytes_per_token": {d: c["bytes_per_token"] for d, c in cache_runs.items()},
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "results.json" if args.data == "chat" else f"results_{args.data}.json"
    (args.out / name).write_text(json.dumps(report, indent=2))
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(
        f"training speed cached / online: {ratio:.2f}x (median of {len(rounds)} rounds); "
        f"cache pass {cache_runs['float32']['tokens_per_s']:.0f} tok/s; "
        f"on disk {cache_runs['float32']['disk_bytes_per_token']:.0f} B/token (float32), "
        f"{cache_runs['bfloat16']['disk_bytes_per_token']:.0f} (bfloat16); teacher in memory "
        f"{teacher_bytes / 2**20:.1f} MiB + {logits_per_token} B/token of logits online"
    )
    print(f"results: {args.out / name}")
    return report


if __name__ == "__main__":
    main()
