"""`kernelhub variants [ORG/NAME]`: which build variants this system runs, and why others are rejected.

Without a repository: describe this system and the variant names it accepts, best first. With one:
list the variants of that revision, marking the one `get_kernel` would download and the reason each
other variant is rejected.
"""

from __future__ import annotations

from kernelhub.cli._common import add_ref_arguments, add_subcommand
from kernelhub.variants import SystemInfo, rank_variants

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = add_subcommand(
        sub, "variants", "show the build variants this system accepts (or a repository's, ranked)", __doc__
    )
    p.add_argument("repo_id", nargs="?", help="ORG/NAME on the Hub")
    add_ref_arguments(p)
    p.set_defaults(run=run)


def _system_variants(s: SystemInfo) -> list[str]:
    t = f"torch{s.torch_version[0]}{s.torch_version[1]}"
    abi = "" if s.cxx11_abi is None else ("cxx11-" if s.cxx11_abi else "cxx98-")
    names = []
    if s.backend == "cuda" and s.backend_version:
        names += [
            f"{t}-{abi}cu{s.backend_version[0]}{m}-{s.cpu}-{s.os}"
            for m in range(s.backend_version[1], -1, -1)
        ]
    elif s.backend_version:
        names.append(f"{t}-{abi}{s.backend}{''.join(map(str, s.backend_version))}-{s.cpu}-{s.os}")
    else:
        names.append(f"{t}-{abi}{s.backend}-{s.cpu}-{s.os}")
    return names + [f"torch-{s.backend}", "torch-universal"]


def run(args) -> int:
    system = SystemInfo.current()
    print(f"system: {system.describe()}")
    if not args.repo_id:
        for name in rank_variants(_system_variants(system), system)[0]:
            print(f"  {name}")
        return 0
    from kernelhub._fetch import list_variants

    ref, commit, names = list_variants(args.repo_id, revision=args.revision, version=args.version)
    usable, rejected = rank_variants(names, system)
    print(f"{args.repo_id} {ref} ({commit}):")
    for i, name in enumerate(usable):
        print(f"  {name}: {'selected' if i == 0 else 'usable'}")
    for name, reason in sorted(rejected.items()):
        print(f"  {name}: rejected: {reason}")
    if not names:
        print("  (no build/ variants)")
    return 0 if usable else 3
