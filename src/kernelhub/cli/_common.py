"""Argument plumbing shared by the subcommands."""

from __future__ import annotations

import argparse


def add_subcommand(sub, name: str, help: str, doc: str | None) -> argparse.ArgumentParser:
    """A subcommand whose --help shows its module docstring as written."""
    return sub.add_parser(
        name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_ref_arguments(p: argparse.ArgumentParser) -> None:
    """--version N (branch vN) or --revision REF, not both."""
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--version", type=int, help="version N (branch vN)")
    ref.add_argument("--revision", help="branch, tag or commit")
