"""A @triton.jit kernel's compile-time arguments passed by name, checked once against its signature.

Why: the grouped GEMM takes 17 constexpr switches. As a positional tuple kept in order by a
comment, two swapped flags of one type compile another kernel without an error. A spec is a
namedtuple type whose fields are the kernel's constexpr parameters in the kernel's order: a launch
names every value (a missing or unknown name is a TypeError from Python's argument binding), and
what it builds is still the plain tuple `CachedLaunch.split` keys on, so the cached fast path is
unchanged (building it by keyword costs well under a microsecond).
"""

from __future__ import annotations

import inspect
from collections import namedtuple


def _is_constexpr(annotation: object) -> bool:
    # `from __future__ import annotations` leaves "tl.constexpr" as a string (Triton reads it so too)
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return text.split(".")[-1] == "constexpr"


def _parameters(kernel) -> list[tuple[str, bool]]:
    """(name, is constexpr) of each parameter: a JITFunction's `params`, else (the interpreter's
    InterpretedFunction) the annotations of the Python function it wraps."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return [(p.name, bool(p.is_constexpr)) for p in params]
    fn = getattr(kernel, "fn", kernel)
    return [(name, _is_constexpr(p.annotation)) for name, p in inspect.signature(fn).parameters.items()]


def constexpr_spec(kernel, names: str | tuple[str, ...]) -> type[tuple]:
    """The spec type of `kernel`'s constexprs; `names` are those its launcher passes.

    Checked here, once: `names` must be exactly the kernel's constexpr parameters, and these must
    be its last parameters (`CachedLaunch.split` passes them after the runtime arguments).

    Raises:
        TypeError: a name the kernel does not have, a constexpr left out, or a constexpr followed
            by a runtime parameter.
    """
    given = tuple(names.split()) if isinstance(names, str) else tuple(names)
    kernel_name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
    params = _parameters(kernel)
    constexprs = tuple(name for name, is_const in params if is_const)
    unknown = sorted(set(given) - set(constexprs))
    missing = sorted(set(constexprs) - set(given))
    if unknown or missing or len(set(given)) != len(given):
        problems = [f"not constexprs of the kernel: {unknown}"] * bool(unknown)
        problems += [f"constexprs not given: {missing}"] * bool(missing)
        raise TypeError(f"constexpr spec of {kernel_name}: {'; '.join(problems + [f'names given: {list(given)}'])} "
                        f"(the kernel's constexprs: {list(constexprs)})")
    trailing = tuple(name for name, _ in params[len(params) - len(constexprs):])
    if trailing != constexprs:
        raise TypeError(f"constexpr spec of {kernel_name}: the constexprs {list(constexprs)} must be the "
                        f"kernel's last parameters (CachedLaunch.split's order), got {[n for n, _ in params]}")
    return namedtuple(f"{kernel_name}_constexprs", constexprs)
