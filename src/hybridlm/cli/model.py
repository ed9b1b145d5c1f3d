"""`hybridlm info | config | generate | export-hf | serve | chat`: one model, inspected or served.

A model comes from `--preset NAME`, `--config FILE.yaml|json` or `--checkpoint DIR` (a transformers
NemotronH / Olmo3 directory, a training checkpoint or a run directory), with `--set a.b=value`
overrides for the first two.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from ..choices import KV_CACHE_DTYPES, SSM_PRECISIONS
from ..config import ModelConfig
from ..presets import PRESETS, get_preset
from .args import add_overrides_arg, add_server_args, check_port, require_extra


def _add_model_args(p: argparse.ArgumentParser, *, checkpoint: bool = True) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), help="a named model configuration")
    src.add_argument("--config", help="a YAML or JSON ModelConfig file")
    if checkpoint:
        src.add_argument(
            "--checkpoint",
            help="a transformers NemotronH / Olmo3 directory, a training checkpoint "
            "(runs/X/checkpoints/step_N) or a run directory (its newest checkpoint)",
        )
    add_overrides_arg(p, "moe.top_k=8")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="weight init (random models) and sampling")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + reply in tokens (default: the model's max_seq_len)",
    )
    _add_cache_args(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the Mamba / MoE decode steps with torch.compile (slow first steps)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the model runs (auto: cuda when available); on CUDA it runs in bf16",
    )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, decode with eager steps over the growing cache instead of captured "
        "steps over static slots (infer.graphs)",
    )


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    """`--ssm-precision` and `--kv-cache-dtype`: how the inference cache stores its states."""
    p.add_argument(
        "--ssm-precision",
        choices=SSM_PRECISIONS,
        default="fp32",
        help="storage precision of the Mamba state cache",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="attention KV cache storage: auto = the format the checkpoint declares "
        "(kv_cache_quant_algo), else unquantised; fp8 / nvfp4 need a checkpoint with KV scales "
        "(`hybridlm quantize MODEL OUT --kv-cache fp8`)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add the model commands to the CLI's sub-command parsers."""
    p = sub.add_parser("info", help="parameter counts, FLOPs, cache and state sizes of a model")
    _add_model_args(p, checkpoint=False)
    p.add_argument("--seq-len", type=int, default=8192)
    p.set_defaults(fn=cmd_info, uses_torch=False)

    p = sub.add_parser("config", help="print a model config as YAML (with overrides applied)")
    _add_model_args(p, checkpoint=False)
    p.set_defaults(fn=cmd_config, uses_torch=False)

    p = sub.add_parser(
        "generate",
        help="generate text from a preset or checkpoint (the checkpoint's own tokenizer; the "
        "byte tokenizer for a preset or config)",
        description="Continue --prompt with a model from --preset, --config or --checkpoint. The "
        "prompt is encoded with the tokenizer the checkpoint was trained with "
        "(hybridlm.io.load_tokenizer_for: its run's data.tokenizer or its tokenizer.json); "
        "presets and config files have the byte tokenizer.",
    )
    _add_model_args(p)
    p.add_argument("--prompt", default="To be, or not to be")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the Mamba / MoE decode steps with torch.compile (slow first steps)",
    )
    p.add_argument("--seed", type=int, default=0)
    _add_cache_args(p)
    p.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="draft K tokens per step with the MTP head (greedy output equals plain greedy; "
        "sampled output follows the model's distribution by rejection sampling)",
    )
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("export-hf", help="write a transformers checkpoint directory")
    _add_model_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_export_hf)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the [serve] extra)")
    _add_model_args(p)
    _add_engine_args(p)
    add_server_args(p, port=8000)
    p.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together")
    p.add_argument(
        "--spec-max-batch",
        type=int,
        default=None,
        help="speculate only while at most this many requests run (default: always)",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="the model id clients send (default: the preset/checkpoint name)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body accepted; bigger ones get a 413 (default: 4 MiB)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="clients must send this bearer token, the openai client's api_key (default: "
        "$HYBRIDLM_API_KEY; none: no authentication)",
    )
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("chat", help="interactive chat on stdin/stdout with the chat template")
    _add_model_args(p)
    _add_engine_args(p)
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply")
    p.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="draft K tokens per step with the MTP head",
    )
    p.add_argument(
        "--max-thinking-tokens",
        type=int,
        default=None,
        metavar="N",
        help="reasoning budget: close a reply's <think> block after N tokens",
    )
    p.set_defaults(fn=cmd_chat, model_name=None)


# ---------------------------------------------------------------------------- helpers
def _tokenizer(args: argparse.Namespace, model: Any) -> Any:
    """The checkpoint's own tokenizer; the byte tokenizer for presets and configs."""
    from ..data.tokenizer import ByteTokenizer

    if getattr(args, "checkpoint", None):
        from ..io import load_tokenizer_for

        tok = load_tokenizer_for(args.checkpoint)
    else:
        tok = ByteTokenizer()
    if model.config.vocab_size < tok.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.vocab_size} ids but the model only {model.config.vocab_size}"
        )
    return tok


def _config(args: argparse.Namespace, default: str = "tiny-super") -> ModelConfig:
    if args.config:
        cfg = ModelConfig.load(args.config)
    else:
        cfg = get_preset(args.preset or default)
    return cfg.override(args.overrides) if args.overrides else cfg


def _model(args: argparse.Namespace) -> Any:
    if getattr(args, "checkpoint", None):
        if args.overrides:
            raise ValueError("--set applies to --preset / --config, not to --checkpoint")
        from ..io import load_model

        return load_model(args.checkpoint)
    from ..model.model import HybridLM

    return HybridLM(_config(args), seed=args.seed)


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------- handlers
def cmd_info(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = _config(args)
    n = cfg.num_params()
    table = Table(title=args.preset or args.config or "tiny-super", show_header=False)
    counts = {c: cfg.pattern.count(c) for c in "M*E-"}
    table.add_row(
        "layers",
        f"{len(cfg.pattern)}  (M {counts['M']}, * {counts['*']}, E {counts['E']}, - {counts['-']})",
    )
    table.add_row("pattern", cfg.pattern if len(cfg.pattern) <= 96 else cfg.pattern[:93] + "...")
    table.add_row("params total", f"{_fmt_count(n.total)}  ({n.total:,})")
    table.add_row("params active", f"{_fmt_count(n.active)}  ({n.active:,})")
    table.add_row("params embedding", f"{_fmt_count(n.embedding)}")
    if cfg.mtp.pattern:
        table.add_row(
            "MTP module",
            f"{_fmt_count(n.mtp_total)} total, {_fmt_count(n.mtp_active)} active "
            f"(pattern {cfg.mtp.pattern}, depth {cfg.mtp.depth})",
        )
    seq = args.seq_len
    table.add_row(f"FLOPs/token fwd @ {seq}", f"{cfg.flops_per_token(seq) / 1e9:.2f} GFLOP")
    table.add_row(
        f"FLOPs/token train @ {seq}", f"{cfg.flops_per_token(seq, training=True) / 1e9:.2f} GFLOP"
    )
    table.add_row("KV cache / token (bf16)", _fmt_bytes(cfg.kv_cache_bytes_per_token(2)))
    table.add_row(
        "Mamba state / sequence (fp32)", _fmt_bytes(cfg.mamba_state_bytes_per_sequence(4))
    )
    Console().print(table)


def cmd_config(args: argparse.Namespace) -> None:
    import yaml

    sys.stdout.write(yaml.safe_dump(_config(args).to_dict(), sort_keys=False))


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from ..infer.generate import generate

    model = _model(args)
    tok = _tokenizer(args, model)
    ids = torch.tensor([tok.encode(args.prompt)])
    if args.compile:
        model.compile_decode()
    t0 = time.perf_counter()
    stats = None
    if args.speculative:
        from ..infer.speculative import speculative_generate

        if args.ssm_precision != "fp32":
            raise ValueError("--speculative keeps an fp32 state cache (per-position rollback)")
        out, stats = speculative_generate(
            model,
            ids,
            args.max_new_tokens,
            draft_len=args.speculative,
            eos_id=tok.eos_id,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    else:
        out = generate(
            model,
            ids,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_id=tok.eos_id,
            seed=args.seed,
            ssm_precision=args.ssm_precision,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    dt = time.perf_counter() - t0
    print(args.prompt + tok.decode(out[0].tolist()))
    print(
        f"[{out.shape[1]} tokens in {dt:.2f}s, {out.shape[1] / dt:.1f} tok/s; "
        f"{model.count_params():,} parameters]",
        file=sys.stderr,
    )
    if stats is not None:
        by_pos = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position())
        print(
            f"[speculative k={args.speculative}: acceptance length {stats.acceptance_length:.2f}, "
            f"acceptance by draft position {by_pos}]",
            file=sys.stderr,
        )


def cmd_export_hf(args: argparse.Namespace) -> None:
    from ..interop.hf import save_pretrained

    if getattr(args, "checkpoint", None):
        from ..io import load_tokenizer_for, resolve
        from ..io.checkpoint import is_sharded_checkpoint, read_meta

        where, kind = resolve(args.checkpoint)
        if kind == "checkpoint" and is_sharded_checkpoint(read_meta(where)):
            # consolidated offline, tensor by tensor: memory holds one tensor, not the model
            import torch

            from ..io.checkpoint import checkpoint_model_config
            from ..io.sharded import export_pretrained
            from ..model.model import HybridLM

            if args.overrides:
                raise ValueError("--set applies to --preset / --config, not to --checkpoint")
            export_pretrained(where, args.out, tokenizer=load_tokenizer_for(where))
            with torch.device("meta"):
                n = HybridLM(checkpoint_model_config(where)).count_params()
            print(f"wrote {args.out} ({n:,} parameters, streamed from the sharded {where})")
            return
    model = _model(args)
    save_pretrained(model, args.out, tokenizer=_tokenizer(args, model))
    print(f"wrote {args.out} ({model.count_params():,} parameters)")


def _engine(args: argparse.Namespace, *, max_batch_size: int) -> Any:
    """The model of `--preset/--config/--checkpoint` behind a continuous-batching Engine."""
    import torch

    from ..infer.engine import Engine

    model = _model(args)
    tok = _tokenizer(args, model)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: this machine has no CUDA device")
        model = model.to("cuda", torch.bfloat16)
    if getattr(args, "speculative", 0):
        model.check_drafter("--speculative")
    if args.compile:
        model.compile_decode()
    return Engine(
        model,
        tok,
        max_batch_size=max_batch_size,
        max_model_len=args.max_model_len,
        ssm_precision=args.ssm_precision,
        kv_cache_dtype=args.kv_cache_dtype,
        spec_max_batch=getattr(args, "spec_max_batch", None),
        cuda_graphs=None if args.cuda_graphs else False,
    )


def _model_name(args: argparse.Namespace) -> str:
    from pathlib import Path

    if args.model_name:
        return args.model_name
    if getattr(args, "checkpoint", None):
        return Path(args.checkpoint).resolve().name
    if args.config:
        return Path(args.config).stem
    return args.preset or "tiny-super"


def cmd_serve(args: argparse.Namespace) -> None:
    # uvicorn too: it is imported only when the server starts, after the model is loaded
    require_extra("serve", "serve", "fastapi", "uvicorn")
    from ..infer.protocol import DEFAULT_MAX_BODY_BYTES
    from ..infer.server import serve

    check_port(args.port)
    max_body = DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes
    if max_body < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {max_body}")
    engine = _engine(args, max_batch_size=args.max_batch_size)
    name = _model_name(args)
    print(
        f"serving {name!r} ({engine.model.count_params():,} parameters, max_model_len "
        f"{engine.max_model_len}) at http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    serve(
        engine,
        name,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        max_body_bytes=max_body,
        api_key=args.api_key or os.environ.get("HYBRIDLM_API_KEY") or None,
    )


def cmd_chat(args: argparse.Namespace) -> None:
    """A REPL: each stdin line is a user turn; the reply streams to stdout as it is generated."""
    from dataclasses import replace

    from ..data import chat as chat_template
    from ..infer.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        stop=[chat_template.STOP],
        speculative=args.speculative,
        max_thinking_tokens=args.max_thinking_tokens,
    ).validate()
    engine = _engine(args, max_batch_size=1)
    tok = engine.tokenizer
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print("[type a message; /reset clears the conversation, /exit quits]", file=sys.stderr)
    turn = 0
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return
        if not line:  # end of input
            return
        text = line.rstrip("\r\n")
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            messages = list(base)
            print("[conversation reset]", file=sys.stderr)
            continue
        if command.startswith("/"):
            print(f"[unknown command {command}; commands: /reset, /exit]", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        ids = tok.encode(chat_template.render(messages))
        seed = None if args.seed is None else args.seed + turn
        try:
            rid = engine.add_request(ids, replace(params, seed=seed))
        except ValueError as err:
            messages.pop()
            print(f"[error: {err}; /reset starts a new conversation]", file=sys.stderr)
            continue
        turn += 1
        final = None
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    sys.stdout.write(out.delta_text)
                    sys.stdout.flush()
                    final = out if out.finished else final
        except KeyboardInterrupt:  # stop this reply, keep the conversation
            engine.abort(rid)
            while engine.has_unfinished():
                for out in engine.step():
                    final = out if out.finished else final
        sys.stdout.write("\n")
        sys.stdout.flush()
        reply = final.text if final is not None else ""
        messages.append({"role": "assistant", "content": reply})
        if final is not None and final.spec_stats is not None:
            st = final.spec_stats
            by_pos = " ".join(f"{a:.2f}" for a in st.acceptance_by_position())
            print(
                f"[speculative k={args.speculative}: acceptance length "
                f"{st.acceptance_length:.2f}, by draft position {by_pos}]",
                file=sys.stderr,
            )
