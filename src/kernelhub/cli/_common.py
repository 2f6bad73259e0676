"""Argument plumbing shared by the subcommands.

Option spellings mean one thing in every subcommand: `--kernelhub-config` is the kernelhub config
(kernelhub.toml / pyproject.toml), `--model-config` a transformers config.json. `--config`, which
meant one in `download`/`lock` and the other in `report`, still works there with a deprecation note.
"""

from __future__ import annotations

import argparse
import sys


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


class _DeprecatedSpelling(argparse.Action):
    """An earlier spelling of an option: still works, with a note on stderr naming the current one."""

    def __init__(self, option_strings, dest, *, current: str, **kwargs):
        self.current = current
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: note: `{option_string}` is deprecated (it meant different configs in different "
              f"subcommands); use `{self.current}`", file=sys.stderr)
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_option", option_string)


def add_deprecated_spelling(p, old: str, current: str, dest: str) -> None:
    """`old` keeps working as `current` (same `dest`); `args.<dest>_option` records the spelling used."""
    p.add_argument(old, dest=dest, action=_DeprecatedSpelling, current=current,
                   help=f"deprecated spelling of {current}")


def add_kernelhub_config_arguments(p: argparse.ArgumentParser, help: str) -> None:
    """--kernelhub-config (the kernelhub config, as in every subcommand), and --config, its earlier spelling."""
    p.add_argument("--kernelhub-config", dest="kernelhub_config", help=help)
    add_deprecated_spelling(p, "--config", "--kernelhub-config", "kernelhub_config")
