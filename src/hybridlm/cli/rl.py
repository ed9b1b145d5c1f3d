"""`hybridlm rl`: GRPO with verifiable rewards (rl/learner.py); `hybridlm tool-demos`: solved
tool-use episodes of an environment as SFT data (the short tool-use SFT before agentic RL)."""

from __future__ import annotations

import argparse

from .args import add_overrides_arg, add_server_args, check_port, require_extra
from .train import add_resume_args


def register(sub: argparse._SubParsersAction) -> None:
    """Add `hybridlm rl` to the CLI's sub-command parsers."""
    p = sub.add_parser("rl", help="GRPO with verifiable rewards and asynchronous rollouts")
    p.add_argument("--config", default="", help="an RL YAML (default: configs/rl.yaml if present)")
    p.add_argument("--checkpoint", default="", help="the starting policy (overrides the config)")
    add_resume_args(p)
    add_overrides_arg(p, "train.max_steps=20 --set rl.grpo.eps_high=0.28")
    p.set_defaults(fn=cmd_rl)
    p = sub.add_parser(
        "tool-demos", help="write solved tool-use episodes as SFT chat data (JSONL: messages)"
    )
    p.add_argument("--env", default="calculator", help="a tool-use environment kind")
    p.add_argument("--num", type=int, default=2000, help="conversations to write")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    add_overrides_arg(p, "digits=5 --set seed=0 (fields of an RL config's envs[] entry)")
    p.set_defaults(fn=cmd_tool_demos)
    p = sub.add_parser(
        "env-serve", help="serve an RL environment over HTTP (rl/remote.py's protocol)"
    )
    p.add_argument("--env", default="calculator", help="an environment kind (envs[].kind)")
    add_server_args(p, port=8010)
    p.add_argument("--max-episodes", type=int, default=4096, help="live episodes kept")
    p.add_argument(
        "--token",
        default=None,
        help="clients must send 'Authorization: Bearer TOKEN' (default: $HYBRIDLM_ENV_TOKEN; "
        "neither: no authentication)",
    )
    p.add_argument(
        "--verify-timeout",
        type=float,
        default=10.0,
        help="seconds a completion may take to verify; past it, reward 0 (0: no deadline)",
    )
    p.add_argument("--verify-workers", type=int, default=1, help="verification processes")
    p.add_argument(
        "--debug-rewards",
        action="store_true",
        help="add each verdict's detail (which may hold the ground truth) to replies",
    )
    add_overrides_arg(p, "digits=5 --set seed=0 (fields of an RL config's envs[] entry)")
    p.set_defaults(fn=cmd_env_serve)


def cmd_rl(args: argparse.Namespace) -> None:
    from pathlib import Path

    from ..rl.learner import RLRunConfig, run_rl
    from ..train.distributed import parallel

    path = Path(args.config or "configs/rl.yaml")
    if args.config and not path.is_file():
        raise ValueError(f"rl config {path} not found")
    cfg = RLRunConfig.load(path) if path.is_file() else RLRunConfig()
    if args.checkpoint:
        cfg.train.init_from = args.checkpoint
    cfg = cfg.override(args.overrides)
    res = run_rl(cfg, resume=args.resume, overwrite=args.overwrite)
    if not parallel.is_main():  # under torchrun rank 0 reports; every rank leaves together
        parallel.destroy()
        return
    first, last = res["eval"][0], res["eval"][-1]
    tr = res["train"]
    print(
        f"[rl] {len(tr)} steps | train reward {tr[0]['reward_mean']:.3f} -> "
        f"{tr[-1]['reward_mean']:.3f} | held-out solved {first['all/solved']:.3f} -> "
        f"{last['all/solved']:.3f} ({int(first['all/count'])} problems, greedy)"
    )
    print(f"metrics: {res['metrics']}\nplot:    {res['plot']}\nmodel:   {res['model']}")
    parallel.destroy()


def cmd_tool_demos(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from ..config import apply_overrides
    from ..rl.env_config import EnvConfig, build_environment
    from ..rl.environments import ToolUseEnvironment

    spec = apply_overrides(EnvConfig(kind=args.env), args.overrides)
    env = build_environment(spec)
    if not isinstance(env, ToolUseEnvironment):
        raise ValueError(f"environment {args.env!r} has no tools; use calculator or search_qa")
    if args.num < 1:
        raise ValueError(f"--num must be >= 1, got {args.num}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    convs = env.demonstrations(args.num, seed=spec.seed)
    with out.open("w") as f:
        for messages in convs:
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"[tool-demos] {len(convs)} solved {env.name} episodes -> {out}")


def cmd_env_serve(args: argparse.Namespace) -> None:
    import os

    require_extra("env-serve", "serve", "fastapi", "uvicorn")
    from ..config import apply_overrides
    from ..infer.server import run_app
    from ..rl.env_config import EnvConfig, build_environment
    from ..rl.remote import TOKEN_ENV, create_env_app

    if args.env == "http":
        raise ValueError("env-serve serves a local environment; 'http' is the client of one")
    check_port(args.port)
    if args.verify_timeout < 0 or args.verify_workers < 1:
        raise ValueError("--verify-timeout must be >= 0 and --verify-workers >= 1")
    token = args.token or os.environ.get(TOKEN_ENV) or None
    env = build_environment(apply_overrides(EnvConfig(kind=args.env), args.overrides))
    app = create_env_app(
        env,
        max_episodes=args.max_episodes,
        token=token,
        verify_timeout_s=args.verify_timeout,
        verify_workers=args.verify_workers,
        debug_rewards=args.debug_rewards,
    )
    auth = "token required" if token else "no authentication"
    print(
        f"[env-serve] {env.name}: {len(env)} problems on http://{args.host}:{args.port} "
        f"({auth}; verification deadline {args.verify_timeout:g} s)"
    )
    run_app(app, args.host, args.port, args.log_level)
