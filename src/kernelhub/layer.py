"""Marking modules (and functions) as kernelizable, and checking that a layer class may replace a
module's forward, with Hugging Face `kernels`' decorators, rules and key phrases."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from kernelhub.mode import Mode

__all__ = [
    "LAYER_FLAGS",
    "condition_skips",
    "keyword_renames",
    "layer_problem",
    "layer_verdict",
    "replace_kernel_forward_from_hub",
    "use_kernel_forward_from_hub",
    "use_kernelized_func",
    "validate_layer_has_mode",
]

M = TypeVar("M", bound=type[nn.Module])

# What a layer class may define besides what nn.Module has (forward included): the two flags
# Hugging Face `kernels` allows, and kernelhub's hooks: `unsupported_reason(host)` (this layer cannot
# serve that module) and `mismatch_reason(module)` (that module is not this layer; matching.py asks it).
LAYER_FLAGS = frozenset({"can_torch_compile", "has_backward", "mismatch_reason", "unsupported_reason"})
KERNEL_FUNCS = "_kernel_funcs"  # in a host module's __dict__, as `kernels` keeps them


def _check_layer_name(func: str, layer_name: object) -> str:
    if not isinstance(layer_name, str) or not layer_name:
        raise ValueError(f"{func}: `layer_name` must be a non-empty str, got {layer_name!r}")
    return layer_name


def _check_condition(func: str, condition: object) -> None:
    if condition is not None and not callable(condition):
        raise TypeError(f"{func}: `condition` must be a callable taking the module, or None, got {condition!r}")


def _mark(cls: type, layer_name: str, condition: Callable[[nn.Module], bool] | None) -> None:
    cls.kernel_layer_name = layer_name
    # a staticmethod, as in `kernels`: read through an instance it must not bind the module twice;
    # always set, so a subclass marked without a condition does not inherit its parent's
    cls.kernel_condition = staticmethod(condition if condition is not None else _always)


def _always(module: nn.Module) -> bool:
    return True


def replace_kernel_forward_from_hub(
    cls: type, layer_name: str, condition: Callable[[nn.Module], bool] | None = None
) -> None:
    """Make instances of `cls` (a third-party layer class) kernelizable as layer `layer_name`.

    `condition(module)`, as in Hugging Face `kernels`: asked for every instance at kernelize; an
    instance it returns False for is skipped and keeps its own forward.
    """
    _check_layer_name("replace_kernel_forward_from_hub", layer_name)
    _check_condition("replace_kernel_forward_from_hub", condition)
    if not isinstance(cls, type):
        raise TypeError(f"replace_kernel_forward_from_hub: `cls` must be a class, got {cls!r}")
    _mark(cls, layer_name, condition)


def use_kernel_forward_from_hub(
    layer_name: str, condition: Callable[[nn.Module], bool] | None = None
) -> Callable[[Any], Any]:
    """Decorator: a module class's instances are kernelized as layer `layer_name`.

    On a plain function it returns an `nn.Module` instance calling that function (as in Hugging
    Face `kernels`); kernelize finds it where a module lists it with `use_kernelized_func`.
    `condition(module)` is asked for every instance at kernelize; False skips that instance.
    """
    _check_layer_name("use_kernel_forward_from_hub", layer_name)
    _check_condition("use_kernel_forward_from_hub", condition)

    def decorate(obj: Any) -> Any:
        if inspect.isfunction(obj):
            func_module = create_func_module(obj)
            _mark(func_module, layer_name, condition)
            return func_module()
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            _mark(obj, layer_name, condition)
            return obj
        raise TypeError(
            "use_kernel_forward_from_hub: can only be applied to classes (nn.Module subclasses) or "
            f"functions, got {obj!r}"
        )

    return decorate


def use_kernelized_func(*funcs: Callable) -> Callable[[M], M]:
    """Class decorator: attach functions decorated with `use_kernel_forward_from_hub` to every
    instance (a plain attribute, not a submodule) so that kernelize replaces them too."""
    for fn in funcs:
        if not hasattr(fn, "kernel_layer_name"):
            name = getattr(fn, "__name__", repr(fn))
            raise ValueError(
                f"use_kernelized_func: Function `{name}` is not decorated with @use_kernel_forward_from_hub "
                "and cannot be used with @use_kernelized_func"
            )

    def decorate(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"use_kernelized_func: decorates nn.Module classes, got {cls!r}")
        original_init = cls.__init__

        @functools.wraps(original_init)
        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            # in __dict__ directly: registered as a submodule it would be shared state of every host
            hidden = self.__dict__.setdefault(KERNEL_FUNCS, {})
            for fn in funcs:
                name = getattr(fn, "__name__", None) or type(fn).kernel_layer_name
                hidden[name] = fn

        cls.__init__ = __init__
        return cls

    return decorate


def create_func_module(func: Callable) -> type[nn.Module]:
    """A stateless layer class whose forward calls `func` (same signature, plus `self`)."""

    class Func(nn.Module):
        can_torch_compile = getattr(func, "can_torch_compile", False)
        has_backward = getattr(func, "has_backward", True)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

    name = getattr(func, "__name__", "Func")
    Func.__name__ = Func.__qualname__ = name
    signature = inspect.signature(func)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *signature.parameters.values()]
    # layer validation compares this signature with the host's
    Func.forward.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return Func


def condition_skips(module: nn.Module) -> bool:
    """Whether the `condition` its class was marked with turns kernelize away from this module."""
    condition = getattr(type(module), "kernel_condition", None)
    return condition is not None and not condition(module)


def _forward_params(fn: Callable) -> list[inspect.Parameter]:
    fn = inspect.unwrap(fn)
    return list(inspect.signature(fn).parameters.values())[1:]  # drop self


def keyword_renames(layer: type, host: nn.Module) -> dict[str, str]:
    """{host's parameter name: the layer's} where the two forwards name a parameter differently.

    Layers are matched by their parameters' number and kinds, as Hugging Face `kernels` does
    (transformers MLPs call their input x, hidden_state or hidden_states); a caller that passes
    the input by the host's keyword still reaches the layer through this map.
    """
    try:
        pairs = zip(_forward_params(type(host).forward), _forward_params(layer.forward))
    except (TypeError, ValueError):
        return {}
    return {h.name: m.name for h, m in pairs
            if h.name != m.name and h.kind is not inspect.Parameter.POSITIONAL_ONLY}


def _module_members() -> set[str]:
    # read on every check, not cached: libraries add members to nn.Module itself after import
    # (transformers' `smart_apply`), and those are no layer's own state
    return set(dir(nn.Module))


def extra_members(layer: type) -> list[str]:
    """Members of a layer class beyond nn.Module's and LAYER_FLAGS (state a kernel layer must not have).

    Names torch.compile itself sets on classes it has traced (`___needs_generation_tag_patch`) are not
    the layer's: a layer compiled once would otherwise be refused by the next kernelize.
    """
    names = {name for name, _ in inspect.getmembers(layer) if not name.startswith("___")}
    return sorted(names - _module_members() - LAYER_FLAGS)


def repository_label(repo: Any) -> str:
    """A repository as Hugging Face `kernels` names it in messages: "`org/name` (revision: r), layer `L`"."""
    name = getattr(repo, "layer_name", None) or getattr(repo, "func_name", None)
    kind = "layer" if getattr(repo, "layer_name", None) else "function"
    repo_id = getattr(repo, "repo_id", None)
    if repo_id is not None:
        version = getattr(repo, "version", None)
        revision = getattr(repo, "revision", None) or (f"v{version}" if version is not None else "latest")
        return f"`{repo_id}` (revision: {revision}), {kind} `{name}`"
    path = getattr(repo, "path", None)
    if path is not None:
        return f"`{path}` ({kind} `{name}`)"
    return str(repo)


def _validate_layer(*, check_cls: type, cls: Any, repo: Any) -> None:
    """Hugging Face `kernels`' layer check, by its name: TypeError where `cls` may not replace
    `check_cls.forward` (not a module, a constructor, other members, another forward signature)."""
    problem = _structure_problem(cls, check_cls, repository_label(repo))
    if problem is not None:
        raise TypeError(problem)


def _structure_problem(layer: Any, host_cls: type, label: str) -> str | None:
    if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        return f"Layer `{getattr(layer, '__name__', layer)!s}` is not a Torch layer (not an nn.Module class)."
    if layer.__init__ is not nn.Module.__init__:
        return (f"{label} must not override nn.Module constructor: layer {layer.__name__} defines __init__; "
                "kernel layers must be stateless")
    extra = extra_members(layer)
    if extra:
        return (f"{label} must not contain additional members compared to `{host_cls.__name__}` "
                f"(found {extra}; kernel layers must be stateless)")
    try:
        mine = _forward_params(layer.forward)
        theirs = _forward_params(host_cls.forward)
    except (TypeError, ValueError):
        return None
    what = f"Forward signature of {label} does not match `{host_cls.__name__}`"
    detail = (f"(layer {layer.__name__}.forward{[p.name for p in mine]} does not match "
              f"{host_cls.__name__}.forward{[p.name for p in theirs]})")
    if len(mine) != len(theirs):
        return f"{what}: different number of arguments {detail}"
    for p, q in zip(mine, theirs):
        if p.kind != q.kind:
            return f"{what}: different kind of arguments ({p} ({p.kind}) and {q} ({q.kind})) {detail}"
    return None


def layer_verdict(layer: type, host: nn.Module) -> str | None:
    """The layer's own `unsupported_reason(host)` (kernelhub's): why it cannot serve this module."""
    check = getattr(layer, "unsupported_reason", None)
    if callable(check):
        reason = check(host)
        if reason:
            return f"layer {layer.__name__}: {reason}"
    return None


def layer_problem(layer: object, host: nn.Module, mode: Mode, repo: Any = None) -> str | None:
    """Why `layer` cannot replace `host.forward` in `mode`, or None if it can.

    A layer must be a stateless nn.Module (its forward runs with the host as `self`, so any state
    of its own would be silently missing): no __init__ and no members but forward and LAYER_FLAGS.
    It takes the parameters of the host's forward (number and kinds; names may differ, see
    `keyword_renames`). As in Hugging Face `kernels`, a layer without `has_backward` has a backward,
    and only `can_torch_compile = True` serves TORCH_COMPILE.
    """
    label = repository_label(repo) if repo is not None else f"layer {getattr(layer, '__name__', layer)}"
    if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        return f"layer {layer!r} is not an nn.Module class"
    if layer.__init__ is nn.Module.__init__:
        # The layer's own verdict first: it names the real difference (e.g. GPT-OSS weight layout).
        verdict = layer_verdict(layer, host)
        if verdict is not None:
            return verdict
    problem = _structure_problem(layer, type(host), label)
    if problem is not None:
        return problem
    if Mode.TRAINING in mode and not getattr(layer, "has_backward", True):
        return f"layer {layer.__name__} does not support mode {mode}: has_backward is False"
    if Mode.TORCH_COMPILE in mode and getattr(layer, "can_torch_compile", False) is not True:
        return (f"layer {layer.__name__} does not support mode {mode}: it does not support torch.compile "
                "(can_torch_compile is not True)")
    return None


def validate_layer_has_mode(layer_name: str, layer: type, repo: Any, repo_mode: Mode | None) -> None:
    """ValueError where a mapping registered `layer` for a mode it cannot serve (as `kernels`): a
    layer with `has_backward = False` for TRAINING, one without `can_torch_compile` for TORCH_COMPILE."""
    if repo_mode is None:
        return
    label = repository_label(repo)
    if Mode.TRAINING in repo_mode and not getattr(layer, "has_backward", True):
        raise ValueError(
            f"kernelize: Function/layer from repo {label} does not support backward (has_backward is False). "
            f"Was registered for `{layer_name}` with mode `{repo_mode}`"
        )
    if Mode.TORCH_COMPILE in repo_mode and not getattr(layer, "can_torch_compile", False):
        raise ValueError(
            f"kernelize: Function/layer from repo {label} does not support torch.compile. "
            f"Was registered for `{layer_name}` with mode `{repo_mode}`"
        )
