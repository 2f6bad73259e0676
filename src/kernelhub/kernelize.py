"""kernelize: give each module the kernel for the device *it* lives on.

Hugging Face `kernels` takes the first parameter's device for the whole model and the current
device's capability for every module; with layers split over GPUs of different generations
that binds sm90 kernels on an sm80 card. Here each module is resolved on its own device index,
and a kernelized forward re-resolves when its input arrives on another device.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernelhub.config import KernelhubConfig, load_config
from kernelhub.device import as_torch_device, device_capability, module_device
from kernelhub.layer import (
    KERNEL_FUNCS,
    _validate_layer,
    condition_skips,
    keyword_renames,
    layer_problem,
    layer_verdict,
    validate_layer_has_mode,
)
from kernelhub.matching import match_layer
from kernelhub.mode import MODE_PRIORITY, Mode
from kernelhub.registry import get_kernel_mapping, mapping_in_effect, resolve_repository

__all__ = [
    "KernelizeEntry",
    "KernelizeReport",
    "describe_repository",
    "kernelize",
    "kernelize_report",
    "unkernelize",
]


@dataclass(frozen=True)
class KernelizeEntry:
    """What kernelize decided for one module (`fallback_reason` is None when a kernel was bound)."""

    module_name: str
    module_class: str
    layer_name: str
    device: torch.device | None
    capability: int | None
    repository: str | None
    layer: str | None
    fallback_reason: str | None


class KernelizeReport:
    """The decisions of one kernelize call, one entry per kernelizable module; prints as a table."""

    def __init__(self, entries: list[KernelizeEntry], mode: Mode):
        self.entries = entries
        self.mode = mode

    def __iter__(self) -> Iterator[KernelizeEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def kernelized(self) -> list[KernelizeEntry]:
        return [e for e in self.entries if e.fallback_reason is None]

    @property
    def fallbacks(self) -> list[KernelizeEntry]:
        return [e for e in self.entries if e.fallback_reason is not None]

    def __str__(self) -> str:
        header = ("module", "class", "layer", "device", "sm", "kernel", "from / why not")
        rows = []
        for e in self.entries:
            sm = "-" if e.capability is None else str(e.capability)
            dev = "(from input)" if e.device is None else str(e.device)
            kernel = e.layer if e.fallback_reason is None else "eager"
            source = e.repository if e.fallback_reason is None else e.fallback_reason
            rows.append((e.module_name or "(root)", e.module_class, e.layer_name, dev, sm, kernel, source))
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        widths[-1] = len(header[-1])

        def fmt(row: tuple[str, ...]) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

        lines = [
            f"kernelize report: mode={self.mode}, {len(self.kernelized)} of {len(self.entries)} modules kernelized",
            fmt(header),
            fmt(tuple("-" * w for w in widths)),
        ]
        lines += [fmt(r) for r in rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"KernelizeReport({len(self.kernelized)}/{len(self.entries)} kernelized, mode={self.mode})"


def describe_repository(repo: Any) -> str:
    """A repository in one short line for the report (`hub:org/name@v1/Layer`, `local:path/Layer`)."""
    describe = getattr(repo, "describe", None)
    if callable(describe):
        return str(describe())
    path = getattr(repo, "path", None)
    if path is not None:
        return f"local:{path}"
    repo_id = getattr(repo, "repo_id", None)
    return f"hub:{repo_id}" if repo_id else repr(repo)


_layer_cache: dict[Any, type[nn.Module]] = {}
_layer_cache_lock = threading.Lock()


def _load_layer(repo: Any) -> type[nn.Module]:
    check_trust = getattr(repo, "check_trust", None)
    if check_trust is not None:  # a Hub repository: trust is decided per use, cached layer or not
        check_trust()
    try:
        hash(repo)
        key: Any = repo
    except TypeError:
        key = id(repo)
    layer = _layer_cache.get(key)
    if layer is None:
        layer = repo.load()
        with _layer_cache_lock:
            _layer_cache[key] = layer
    return layer


def _resolve_config(config: Any) -> Any:
    if config is None:
        return load_config(None)
    if isinstance(config, (str, Path)):
        return load_config(config)
    if isinstance(config, dict):
        return KernelhubConfig.from_dict(config)
    if callable(getattr(config, "repository_for", None)):
        return config
    raise TypeError(
        "kernelize: `config` must be None, a path, a dict or a KernelhubConfig, "
        f"got {type(config).__name__}"
    )


@dataclass(frozen=True)
class _Choice:
    device: torch.device | None
    capability: int | None
    repository: Any | None
    layer: type[nn.Module] | None
    reason: str | None


def choose_layer(
    host: nn.Module,
    layer_name: str,
    device: torch.device | None,
    mode: Mode,
    config: Any,
    *,
    strict_mapping: bool = False,
    strict_load: bool = False,
) -> _Choice:
    """Resolve one module on one device: registry, then config override, then layer checks.

    What cannot be bound is a fallback reason, except, as Hugging Face `kernels` raises at kernelize:
    with `strict_mapping`, a layer registered for a mode it cannot serve (ValueError); with
    `strict_load`, a repository that fails to load (its error) or a layer that may not replace the
    module's forward (TypeError).
    """
    if device is None:
        return _Choice(None, None, None, None, "module has no parameters; resolved from its input")
    # the mapping before the device: a layer nothing maps keeps its forward on any device, including
    # "cuda" asked of a torch without CUDA (whose capability cannot be read)
    if layer_name not in mapping_in_effect() and not _config_names(config, layer_name):
        return _Choice(device, None, None, None, f"no kernel mapping for layer {layer_name!r}")
    capability, unreadable = _capability(device)
    if unreadable is not None:
        return _Choice(device, None, None, None, unreadable)
    resolution = resolve_repository(layer_name, device, capability, mode)
    repo, repo_mode = resolution.repository, resolution.mode
    if config is not None:
        override = config.repository_for(layer_name, device, capability, repo)
        if override is not None and override is not repo:
            repo, repo_mode = override, None
    if repo is None:
        return _Choice(device, capability, None, None, resolution.reason)
    try:
        layer = _load_layer(repo)
    except Exception as e:
        if strict_load:
            raise
        return _Choice(device, capability, repo, None, f"could not load {describe_repository(repo)}: {e}")
    try:
        validate_layer_has_mode(layer_name, layer, repo, repo_mode)
    except ValueError as e:
        if strict_mapping:
            raise
        return _Choice(device, capability, repo, None, str(e))
    if strict_load and layer_verdict(layer, host) is None:
        _validate_layer(check_cls=type(host), cls=layer, repo=repo)
    problem = layer_problem(layer, host, mode, repo)
    if problem is not None:
        return _Choice(device, capability, repo, None, problem)
    return _Choice(device, capability, repo, layer, None)


def _config_names(config: Any, layer_name: str) -> bool:
    """Whether the kernelhub config has an entry for this layer (it can bind one with no mapping)."""
    named = getattr(config, "layers", None)
    return isinstance(named, dict) and layer_name in named


def _capability(device: torch.device) -> tuple[int | None, str | None]:
    """(capability, None) of a CUDA device, (None, why not) where this torch cannot read it (no
    CUDA in this build, no such index): such a device binds no kernel, as in `kernels`."""
    if device.type != "cuda":
        return None, None
    try:
        return device_capability(device), None
    except (AssertionError, RuntimeError) as e:  # what torch.cuda raises for a device it does not have
        return None, f"the capability of {device} cannot be read here: {e}"


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            return a
    return None


def _renamed_call(fn: Callable, renames: dict[str, str], *args: Any, **kwargs: Any) -> Any:
    if kwargs:
        kwargs = {renames.get(k, k): v for k, v in kwargs.items()}
    return fn(*args, **kwargs)


def _bind_layer(layer: type[nn.Module], host: nn.Module) -> Callable:
    """layer.forward with the host as `self`; keywords named as the host names them reach it too."""
    fn = types.MethodType(layer.forward, host)
    renames = keyword_renames(layer, host)
    return functools.partial(_renamed_call, fn, renames) if renames else fn


@dataclasses.dataclass(frozen=True)
class _ClassForward:
    """A pickled binding's original forward: the host class's method of this name."""

    name: str


class _KernelizedForward:
    """The forward installed on a kernelized module: one resolved forward per input device.

    Copies: `copy.deepcopy(model)` keeps every binding, bound to the copy's modules. Pickling
    (`torch.save(model)`) keeps the binding but not the kernels it resolved (layer classes of
    dynamically loaded kernel packages): the loaded model resolves again on its first call.
    """

    def __init__(self, host: nn.Module, layer_name: str, mode: Mode, config: Any, original: Callable,
                 had_instance_forward: bool, use_fallback: bool, attr: str = "forward"):
        self.host_ref = host
        self.attr = attr  # the attribute it was bound as ("forward", or accelerate's "_old_forward")
        self.layer_name = layer_name
        self.mode = mode
        self.config = config
        self.original = original
        self.had_instance_forward = had_instance_forward
        self.use_fallback = use_fallback
        self.device: torch.device | None = None
        self.fn: Callable = original
        self._per_device: dict[torch.device, Callable] = {}
        self._lock = threading.Lock()

    def _forward_for(self, choice: _Choice) -> Callable:
        return self.original if choice.layer is None else _bind_layer(choice.layer, self.host_ref)

    def bind(self, choice: _Choice) -> None:
        fn = self._forward_for(choice)
        if choice.device is not None:
            self._per_device[choice.device] = fn
        self.device, self.fn = choice.device, fn

    def _for_device(self, device: torch.device) -> Callable:
        fn = self._per_device.get(device)
        if fn is None:
            choice = choose_layer(self.host_ref, self.layer_name, device, self.mode, self.config)
            if choice.reason is not None and not self.use_fallback:
                raise ValueError(
                    f"kernelize: no kernel for {type(self.host_ref).__name__} on {device} and "
                    f"use_fallback=False: {choice.reason}"
                )
            fn = self._forward_for(choice)
            with self._lock:
                self._per_device[device] = fn
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = _first_tensor(args, kwargs)
        if x is None or x.device == self.device:
            return self.fn(*args, **kwargs)
        return self._for_device(x.device)(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _KernelizedForward:
        new = object.__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key != "_lock":  # the bound methods follow the host to its copy through `memo`
                setattr(new, key, copy.deepcopy(value, memo))
        new._lock = threading.Lock()
        return new

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_per_device", "fn", "device")}
        original = self.original
        # the host class's own forward is kept by name: pickled as a bound method it is re-read with
        # getattr(host, "forward") on load, which yields this binding where the host's attributes
        # are restored first (e.g. `pickle.dumps((model.mlp.forward, model))`): a loop, not the eager forward
        if getattr(original, "__self__", None) is self.host_ref and getattr(
                type(self.host_ref), getattr(original, "__name__", ""), None) is getattr(original, "__func__", None):
            state["original"] = _ClassForward(original.__name__)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if isinstance(self.original, _ClassForward):
            self.original = getattr(type(self.host_ref), self.original.name).__get__(self.host_ref)
        self.device, self.fn, self._per_device = None, self.original, {}
        self._lock = threading.Lock()


def _check_mode(mode: Any) -> Mode:
    if not isinstance(mode, Mode):
        raise TypeError(f"kernelize: `mode` must be a Mode, got {type(mode).__name__}")
    if mode == Mode.FALLBACK:
        raise ValueError("kernelize: `mode` Mode.FALLBACK can only be used to register kernel mappings")
    if mode not in MODE_PRIORITY:
        raise ValueError(
            "kernelize: `mode`: kernelize mode must contain Mode.INFERENCE or Mode.TRAINING "
            f"(optionally | Mode.TORCH_COMPILE), got {mode}"
        )
    return mode


def _explicit_device(device: object) -> torch.device:
    """kernelize's `device` argument as a torch.device. A torch without CUDA keeps "cuda" as given:
    resolving its index asks torch.cuda, which asserts there; such a device binds no kernel."""
    if isinstance(device, str) and device.partition(":")[0] == "rocm":
        device = "cuda" + device[len("rocm"):]  # ROCm builds of torch call their GPUs cuda
    if not torch.cuda.is_available() and not isinstance(device, bool):
        if isinstance(device, int) and device >= 0:
            return torch.device("cuda", device)
        if isinstance(device, (str, torch.device)):
            try:
                dev = torch.device(device)
            except RuntimeError:
                dev = None
            if dev is not None and dev.type == "cuda":
                return dev
    return as_torch_device(device)


# id(model) -> (weak reference to the model, its last kernelize's report): the model holds no
# reference to it (its state_dict, pickle and deepcopy are unchanged) and a dropped model takes its
# report with it. By id, not a WeakKeyDictionary: a module class's own __eq__ must not matter.
_REPORTS: dict[int, tuple[weakref.ref, KernelizeReport]] = {}


def _keep_report(model: nn.Module, report: KernelizeReport) -> None:
    key = id(model)
    _REPORTS[key] = (weakref.ref(model, lambda _ref: _REPORTS.pop(key, None)), report)


def kernelize_report(model: nn.Module) -> KernelizeReport:
    """The report of the last `kernelize` of `model`: per kernelizable module, what was bound or why not."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"kernelize_report: `model` must be a torch.nn.Module, got {type(model).__name__}")
    kept = _REPORTS.get(id(model))
    report = kept[1] if kept is not None and kept[0]() is model else None
    if report is None:
        raise ValueError(
            f"kernelize_report: `model` ({type(model).__name__}) has not been kernelized (call kernelize first)"
        )
    return report


def kernelize(
    model: nn.Module,
    *,
    mode: Mode = Mode.INFERENCE,
    device: torch.device | str | int | None = None,
    use_fallback: bool = True,
    config: Any = None,
    verbose: bool = False,
) -> nn.Module:
    """Replace the forward of every kernelizable module with the kernel for its own device.

    Called as Hugging Face `kernels`' kernelize is (`model = kernelize(model, mode=Mode.INFERENCE)`);
    `config` and `verbose` are kernelhub's.

    Args:
        model: the model (any nn.Module); modified in place.
        mode: what the model will be used for; TRAINING needs layers with a backward.
        device: resolve every module for this device instead of its own (its index is kept).
        use_fallback: keep a module's own forward when no kernel fits (reason in the report);
            when False, raise instead (ValueError). Modules that only look like a layer (an MLP
            with another activation or other maths) are reported and kept either way.
        config: kernelhub config (path, dict or KernelhubConfig); None looks for `kernelhub.toml`
            or `[tool.kernelhub]` in `pyproject.toml` in the working directory.
        verbose: print the report (what was bound per module, or why not).

    Returns:
        The same model. `kernelize_report(model)` gives the KernelizeReport of this call: one
        KernelizeEntry per kernelizable module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"kernelize: `model` must be a torch.nn.Module, got {type(model).__name__}")
    mode = _check_mode(mode)
    if not isinstance(use_fallback, bool):
        raise TypeError(f"kernelize: `use_fallback` must be True or False, got {use_fallback!r}")
    if not isinstance(verbose, bool):
        raise TypeError(f"kernelize: `verbose` must be True or False, got {verbose!r}")
    explicit = _explicit_device(device) if device is not None else None
    cfg = _resolve_config(config)
    entries: list[KernelizeEntry] = []
    saved: list[tuple[nn.Module, dict[str, Any]]] = []  # forwards as they were, should this call raise
    try:
        _kernelize_modules(model, mode, explicit, cfg, use_fallback, entries, saved)
    except BaseException:
        for module, attrs in reversed(saved):  # (all or nothing: no half-kernelized model)
            for attr in _FORWARD_ATTRS:
                module.__dict__.pop(attr, None)
            module.__dict__.update(attrs)
        raise
    _warn_unknown_layers(cfg, entries)
    _warn_unmapped_layers(entries)
    report = KernelizeReport(entries, mode)
    _keep_report(model, report)
    if verbose:
        print(report)
    return model


_FORWARD_ATTRS = ("forward", "_old_forward")
# the report's reason for a module whose class's `condition` (use_kernel_forward_from_hub) said no
CONDITION_SKIPPED = "skipped: the layer's kernel_condition returned False for this module"


def _with_kernel_funcs(model: nn.Module) -> Iterator[tuple[str, str, nn.Module]]:
    """(name, parent name, module) of every module, then of the functions attached to it with
    `use_kernelized_func` (each function once: several modules may list one function)."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        yield name, name.rpartition(".")[0], module
        for fname, fn in module.__dict__.get(KERNEL_FUNCS, {}).items():
            if isinstance(fn, nn.Module) and id(fn) not in seen:
                seen.add(id(fn))
                yield f"{name}.{fname}" if name else fname, name, fn


def _kernelize_modules(model: nn.Module, mode: Mode, explicit: torch.device | None, cfg: Any, use_fallback: bool,
                       entries: list[KernelizeEntry], saved: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    inherited: dict[str, torch.device | None] = {}
    for name, parent, module in _with_kernel_funcs(model):
        own = (_execution_device(module) or module_device(module)) if explicit is None else explicit
        dev = own if own is not None else inherited.get(parent)
        inherited.setdefault(name, dev)
        match = match_layer(module)
        if match is None:
            continue
        saved.append((module, {a: module.__dict__[a] for a in _FORWARD_ATTRS if a in module.__dict__}))
        _unbind(module)
        if condition_skips(module):  # (before any lookup, as `kernels`: no mapping, no use_fallback check)
            entries.append(KernelizeEntry(name, type(module).__name__, match.layer_name, dev, None, None, None,
                                          CONDITION_SKIPPED))
            continue
        if match.unsupported_reason is not None:
            capability = _capability(dev)[0] if dev is not None else None
            choice = _Choice(dev, capability, None, None, match.unsupported_reason)
        else:
            # a module marked with a layer name is kernelized as Hugging Face `kernels` does it: what
            # the mapping names must load and fit; one recognised by its class falls back instead
            marked = getattr(module, "kernel_layer_name", None) is not None
            choice = choose_layer(module, match.layer_name, dev, mode, cfg, strict_mapping=True, strict_load=marked)
        if (
            not use_fallback
            and match.unsupported_reason is None
            and choice.reason is not None
            and choice.device is not None
        ):
            raise ValueError(
                f"kernelize: no kernel for module {name!r} ({type(module).__name__}) on "
                f"{choice.device} and use_fallback=False: {choice.reason}"
            )
        if match.unsupported_reason is None:
            attr = _forward_attribute(module)
            binding = _KernelizedForward(
                module, match.layer_name, mode, cfg, getattr(module, attr), attr in module.__dict__, use_fallback,
                attr,
            )
            binding.bind(choice)
            setattr(module, attr, binding)
        entries.append(
            KernelizeEntry(
                module_name=name,
                module_class=type(module).__name__,
                layer_name=match.layer_name,
                device=choice.device,
                capability=choice.capability,
                repository=describe_repository(choice.repository) if choice.repository is not None else None,
                layer=choice.layer.__name__ if choice.layer is not None else None,
                fallback_reason=choice.reason,
            )
        )


def _warn_unmapped_layers(entries: list[KernelizeEntry]) -> None:
    """As Hugging Face `kernels` does: a module marked with a layer name that no mapping has keeps
    its forward, with a warning (once per layer name)."""
    mapping = mapping_in_effect()
    unmapped = sorted({e.layer_name for e in entries if e.fallback_reason not in (None, CONDITION_SKIPPED)
                       and e.layer_name not in mapping})
    for layer_name in unmapped:
        warnings.warn(
            f"kernelize: No kernel mapping found for layer `{layer_name}`. Check if the layer name matches one "
            "of the kernels in the mapping or add the kernel you want to use to the mapping. Defaulting to "
            "original forward implementation.",
            UserWarning,
            stacklevel=3,
        )


def _warn_unknown_layers(cfg: Any, entries: list[KernelizeEntry]) -> None:
    """A config entry for a layer that nothing knows is most likely a typo (`SwiGLUMlp`): say so,
    since it would otherwise change nothing without a word."""
    named = getattr(cfg, "layers", None)
    if not isinstance(named, dict) or not named:
        return
    known = set(get_kernel_mapping()) | {e.layer_name for e in entries}
    unknown = sorted(set(named) - known)
    if unknown:
        warnings.warn(
            f"kernelize: the kernelhub config names layer(s) {unknown} that neither the kernel mapping "
            f"nor any module of this model has (a typo?); known layers: {sorted(known)}",
            UserWarning,
            stacklevel=3,
        )


# Hugging Face accelerate (device_map with offloading, cpu_offload, ...) hooks a module by
# replacing its forward with one that runs the hook's pre_forward (load offloaded weights onto the
# execution device, move the inputs there), then `module._old_forward`, then post_forward. A
# kernel bound over that forward would skip the hook and meet weights on "meta"; bound as
# `_old_forward` it runs inside the hook, as the module's own forward did.


def _forward_attribute(module: nn.Module) -> str:
    hooked = "_old_forward" in module.__dict__ and getattr(module, "_hf_hook", None) is not None
    return "_old_forward" if hooked else "forward"


def _execution_device(module: nn.Module) -> torch.device | None:
    """The device accelerate's hooks run the module on (its weights may sit on "meta"): its own
    hook's, else the first in its subtree (a Llama MLP's hooks sit on its Linear layers)."""
    for sub in module.modules():
        hook = sub.__dict__.get("_hf_hook")
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            device = getattr(h, "execution_device", None)
            if device is not None:
                return as_torch_device(device)
    return None


def _unbind(module: nn.Module) -> bool:
    for attr in _FORWARD_ATTRS:  # accelerate may have moved it since (add/remove_hook)
        binding = module.__dict__.get(attr)
        if isinstance(binding, _KernelizedForward):
            # where the binding was put over the class's forward, that attribute goes; where it
            # sits elsewhere now (a hook added after kernelize keeps it as `_old_forward` and
            # calls that), the original forward goes in its place
            if binding.had_instance_forward or attr != getattr(binding, "attr", attr):
                setattr(module, attr, binding.original)
            else:
                delattr(module, attr)
            return True
    return False


def unkernelize(model: nn.Module) -> int:
    """Restore every forward that kernelize replaced; returns how many modules were restored."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"unkernelize: `model` must be a torch.nn.Module, got {type(model).__name__}")
    return sum(_unbind(m) for _, _, m in _with_kernel_funcs(model))
