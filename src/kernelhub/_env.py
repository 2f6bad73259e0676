"""Environment variables read one way everywhere: a boolean switch that is misspelt must not be "off".

`KERNELHUB_REQUIRE_TRUSTED=ON` silently meaning "not set" turned a refusal into an import, so every
boolean variable goes through `env_flag`, which refuses a value it does not understand.
"""

from __future__ import annotations

import os

__all__ = ["FALSE_VALUES", "TRUE_VALUES", "env_flag"]

TRUE_VALUES = frozenset({"1", "true", "yes", "on"})
FALSE_VALUES = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean value of environment variable `name` (read now, not at import).

    Unset or empty: `default`. 1/true/yes/on and 0/false/no/off in any case, surrounding spaces ignored.

    Raises:
        ValueError: any other value, naming the variable and the accepted spellings.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r} is not a boolean: use one of "
        f"{sorted(TRUE_VALUES)} to turn it on or {sorted(FALSE_VALUES)} to turn it off"
    )
