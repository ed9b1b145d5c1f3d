"""Command-line arguments shared by several sub-commands."""

from __future__ import annotations

import argparse


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
