"""`hybridlm <stage> ...`: the command line of every stage.

    hybridlm info --preset nemotron-3-super-120b-a12b
    hybridlm config --preset tiny-super --set moe.top_k=8 > my.yaml
    hybridlm generate --preset tiny-super --prompt "To be, or not to be"
    hybridlm export-hf --preset tiny-super --out ckpt/    # or --checkpoint dir (any HF dir)
    hybridlm serve --preset tiny-super --port 8000        # OpenAI-compatible server on localhost
    hybridlm chat --preset tiny-super --system "Be brief."
    hybridlm plan --preset nemotron-3-super-120b-a12b --gpus 512 --tp 2 --ep 64 --seq 8192 \
        --micro-batch 1                                  # memory / communication per device

A model comes from `--preset NAME`, `--config FILE.yaml|json` or `--checkpoint DIR` (a transformers
NemotronH / Olmo3 directory), with `--set a.b=value` overrides for the first two.

One module per stage group (model, speedrun, train, plan, rl, eval, precision, data) defines its
sub-commands' arguments and handlers; a handler imports the library when it runs, so building the
parser imports no torch and `hybridlm --help` or a mistyped flag answers at once.

Expected failures end a command with one line `hybridlm <command>: error: ...` on stderr instead
of a traceback: a `ValueError` (bad config, input or file contents, including JSON and UTF-8
decode errors and an unusable checkpoint) exits with 2; an I/O error (`OSError`: a missing or
unreadable file, a full disk), a corrupt file caught by its reader (safetensors, zip, gzip) or
a machine where the code sandbox cannot isolate (`SandboxUnavailable`) exits with 1. Anything
else is a bug and keeps its traceback.

Under torchrun (`torchrun --nproc_per_node=N -m hybridlm.cli pretrain ...`) rank 0's message is
the one the user sees, and every rank exits non-zero:

- a failure every rank meets (a bad config, no intact checkpoint to resume) is printed once, by
  rank 0; the others exit without a word. Checks rank 0 makes for all (checkpoint integrity,
  the output directory, the layout) reach the other ranks as its verdict; a failure each rank
  finds by itself is left to rank 0 when rank 0 reports the same text within 10 s
  (`train.distributed.parallel.REPORT_WAIT_S`);
- a failure of one other rank alone is printed by that rank: `hybridlm pretrain: error: rank 3:
  ...`;
- a rank whose collective fails because another rank left (gloo's "Connection closed by peer",
  torch.distributed's DistError) exits without a word: the rank that left says why;
- a bug keeps its traceback on whichever rank it happens.

The reporting rank's line (or traceback) also goes to torchrun's error file, so torchrun's
closing `ChildFailedError` summary names it as the "Root Cause" instead of "To enable traceback
see: ..."; the quiet ranks record there that they stopped because of it. That summary, the
traceback torchrun prints above it (its own `raise ChildFailedError`), its log lines and its
exit status (1) are torchrun's.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
import zipfile

# stage groups, in the order `hybridlm --help` lists their commands
_GROUPS = ("model", "speedrun", "train", "plan", "rl", "eval", "precision", "data")


def _thread_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _add_threads_arg(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument(
        "--threads",
        type=_thread_count,
        default=default,
        metavar="N",
        help="CPU threads for torch (default: automatic, the cores other processes leave free)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridlm", description=__doc__.split("\n\n")[0])
    _add_threads_arg(parser, None)
    sub = parser.add_subparsers(dest="command", required=True)
    for group in _GROUPS:
        importlib.import_module(f".{group}", __name__).register(sub)
    # every sub-command takes --threads too (`hybridlm pretrain --threads 2`); SUPPRESS keeps a
    # value given before the sub-command (`hybridlm --threads 2 pretrain`) when it is absent here
    for p in sub.choices.values():
        _add_threads_arg(p, argparse.SUPPRESS)
    return parser


def _exit_status(err: Exception) -> int | None:
    """The exit status of an expected failure (module docstring), None for anything else."""
    if isinstance(err, ValueError):
        return 2
    if isinstance(err, (OSError, EOFError, zipfile.BadZipFile)):
        return 1
    safetensors = sys.modules.get("safetensors")  # not imported: not its error
    if safetensors is not None and isinstance(err, safetensors.SafetensorError):
        return 1
    sandbox = sys.modules.get("hybridlm.rl.sandbox")
    if sandbox is not None and isinstance(err, sandbox.SandboxUnavailable):
        return 1  # this machine cannot isolate code rewards: says how to opt in
    return None


def _one_line(err: Exception) -> str:
    text = " ".join(part.strip() for part in str(err).splitlines() if part.strip())
    if isinstance(err, (ValueError, OSError)) and text:
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.threads_info = None
        # commands that compute nothing with torch (info, config) skip the automatic choice,
        # which samples the machine for 0.2 s and imports torch; --threads is always applied
        if args.threads is not None or getattr(args, "uses_torch", True):
            from ..threads import configure_threads, describe

            # before a handler imports torch: OMP_NUM_THREADS sizes the pool torch starts
            args.threads_info = configure_threads(args.threads)
            print(f"hybridlm {args.command}: {describe(args.threads_info)}", file=sys.stderr)
        args.fn(args)
    except Exception as err:
        status = _exit_status(err)
        if _under_torchrun():
            return _end_rank(args.command, err, status)
        if status is None:
            raise
        print(f"hybridlm {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return status
    return 0


def _under_torchrun() -> bool:
    """A rank of a torchrun job (also a job of one process: torchrun reads its error file)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_ERROR_FILE" in os.environ


def _end_rank(command: str, err: Exception, status: int | None) -> int:
    """How one rank of a torchrun job ends after `err` (module docstring); its exit status."""
    from ..train.distributed import parallel

    rank = parallel.launch_rank()
    if isinstance(err, parallel.MainFailed):  # rank 0 raised it too and reports it
        parallel.main_failure()  # leave after rank 0 has
        parallel.leave_quietly(f"rank {rank}: stopped by rank 0's failure")
        return _exit_status(err.cause) or 1
    if parallel.lost_peer(err):
        parallel.leave_quietly(f"rank {rank}: stopped because another rank left the job")
        return 1
    if status is None:  # a bug: its traceback, printed before the other ranks are told
        text = _one_line(err)
        parallel.record_failure(text, "".join(traceback.format_exception(err)))
        sys.excepthook(type(err), err, err.__traceback__)
        sys.stderr.flush()
        parallel.announce_failure(text)
        return 1
    text = _one_line(err)
    if rank and parallel.main_failure() == text:  # every rank found it: rank 0 says it
        parallel.leave_quietly(f"rank {rank}: stopped by rank 0's failure (the same)")
        return status
    line = f"hybridlm {command}: error: {f'rank {rank}: ' if rank else ''}{text}"
    parallel.record_failure(line)
    print(line, file=sys.stderr, flush=True)
    parallel.announce_failure(text)
    return status
