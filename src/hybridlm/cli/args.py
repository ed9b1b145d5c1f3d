"""Command-line arguments shared by several sub-commands."""

from __future__ import annotations

import argparse
import importlib

from ..choices import LOG_LEVELS


def add_overrides_arg(parser: argparse.ArgumentParser, example: str) -> None:
    """`--set KEY=VALUE` (repeatable) on a command line, collected into `args.overrides` for
    `Config.override`; `example` shows a key of that command."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"dotted override, e.g. --set {example} (repeatable)",
    )


def add_server_args(parser: argparse.ArgumentParser, port: int) -> None:
    """`--host`, `--port` and `--log-level` of an HTTP server (`serve`, `env-serve`)."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: localhost only)"
    )
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="debug also logs every request with its id",
    )


def check_port(port: int) -> None:
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {port}")


def require_extra(command: str, extra: str, *modules: str) -> None:
    """Import `modules` (what pyproject.toml's `extra` installs) before a command does any work,
    or stop with one line that names the extra to install (a missing package is not a bug)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ValueError(
                f"`hybridlm {command}` needs {name}, which the [{extra}] extra installs: pip "
                f'install -e ".[{extra}]" ({err})'
            ) from None
