"""`kernelhub` command line: build, publish, fetch, lock and inspect kernels.

One module per subcommand; each exposes `add_parser(subparsers)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import sys

from kernelhub._env import env_flag
from kernelhub.cli import build, check, download, lock, report, upload, variants
from kernelhub.cli.download import download_kernels  # `kernels.cli`'s names, for code written against it
from kernelhub.cli.lock import lock_kernels

__all__ = ["build_parser", "download_kernels", "lock_kernels", "main"]

_COMMANDS = (check, build, upload, download, lock, variants, report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernelhub",
        description="Build kernel repositories and publish them to the Hugging Face Hub, download and lock them, "
        "and report which kernel each module of a model gets on each GPU.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kernelhub` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        version = getattr(args, "version", None)
        if version is not None and version < 1:
            # branches start at v1; the library leaves v0 to the Hub to refuse, as `kernels` does
            raise ValueError(f"--version: `version` must be an int >= 1, got {version}")
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a CLI prints the reason, not a traceback; KERNELHUB_DEBUG=1 shows it
        if env_flag("KERNELHUB_DEBUG"):
            raise
        print(f"kernelhub {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
