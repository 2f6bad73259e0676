"""Stateless layers whose `forward` replaces that of a transformers v5 `*Experts` module.

kernelize binds `forward` to the host module, so `self.gate_up_proj` ([E, 2I, H]), `self.down_proj`
([E, H, I]) and `self.config` are the host's. Checked against transformers 5.24.0:
Qwen3MoeExperts, MixtralExperts, Qwen2MoeExperts, DeepseekV3Experts and OlmoeExperts all store
[gate; up] concatenated, no bias, SiLU, ids == E skipped (the EP sentinel). GptOssExperts differs
(transposed [E, H, 2I], interleaved gate/up, biases, clamped gate, alpha): `unsupported_reason`
says so, and kernelize should keep its forward.

transformers' `FP8Experts` (fp8 block-quantized checkpoints, `FineGrainedFP8Config`) holds the same
layout in float8_e4m3fn with `gate_up_proj_scale_inv` / `down_proj_scale_inv`: the layer
`MoEExpertsFP8*` serves it, and each layer's `mismatch_reason` turns the other kind down, so fp8
weights never reach the 16-bit kernels nor 16-bit weights the fp8 ones.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from ._fp8_validate import BLOCK
from ._variants import declared_layers
from .experts import fused_experts

_SILU_NAMES = ("silu", "swish")


def _is_silu(act_fn: object) -> bool:
    return (isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"
            or act_fn is torch.nn.functional.silu)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why `fused_experts` cannot replace this experts module's forward, or None if it can."""
    name = type(module).__name__
    gu = getattr(module, "gate_up_proj", None)
    dn = getattr(module, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor):
        return f"{name}: needs tensors `gate_up_proj` and `down_proj` (separate up_proj is not supported)"
    if _holds_fp8(module):
        return f"{name}: fp8 expert weights ({gu.dtype}) are served by layer MoEExpertsFP8, not MoEExperts"
    if getattr(module, "is_transposed", False):
        return f"{name}: transposed expert weights ([E, H, 2I]) are not supported"
    if not getattr(module, "is_concatenated", True):
        return f"{name}: interleaved gate/up rows are not supported (needs [gate; up] concatenated)"
    if getattr(module, "has_bias", False):
        return f"{name}: expert biases are not supported"
    if not getattr(module, "has_gate", True):
        return f"{name}: non-gated experts are not supported"
    if getattr(module, "has_post_expert_norm", False):
        return f"{name}: a post-expert norm is not supported"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        return f"{name}: custom gating `_apply_gate` (e.g. clamped SwiGLU) is not supported"
    act_fn = getattr(module, "act_fn", None)
    if act_fn is not None:  # the function the eager forward calls decides, whatever the config says
        if not _is_silu(act_fn):
            return f"{name}: activation {type(act_fn).__name__} is not SiLU"
    else:
        act = getattr(getattr(module, "config", None), "hidden_act", None)
        if act not in _SILU_NAMES:
            return f"{name}: activation {act!r} is not SiLU"
    if (gu.dim() != 3 or dn.dim() != 3 or gu.shape[0] != dn.shape[0] or gu.shape[1] != 2 * dn.shape[2]
            or gu.shape[2] != dn.shape[1]):
        # (LongcatFlashExperts: gate_up_proj also covers "zero-compute" identity experts, ids >= E)
        return f"{name}: weight shapes {tuple(gu.shape)}, {tuple(dn.shape)} are not [E, 2I, H], [E, H, I]"
    return None


_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
                    if hasattr(torch, n))
_SCALES = ("gate_up_proj_scale_inv", "down_proj_scale_inv")


def _holds_fp8(module: nn.Module) -> bool:
    """Expert weights in an 8-bit float format, or block scales beside them (transformers `FP8Experts`)."""
    weights = (getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None))
    return (any(isinstance(w, torch.Tensor) and w.dtype in _FP8_DTYPES for w in weights)
            or any(isinstance(getattr(module, s, None), torch.Tensor) for s in _SCALES))


def _routing_mismatch(module: nn.Module, layer: str) -> str | None:
    """Why the module's forward does not take the routing as transformers v5 `*Experts` do,
    (hidden_states, top_k_index, top_k_weights), or None. Llama4TextExperts takes hidden states
    already sorted per expert and no routing; binding the layer there would misread its inputs."""
    cls = type(module)
    try:
        every = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return None  # no signature to read (a C extension): the layer's own checks decide
    params = [p for p in every if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    if len(params) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in every):
        return None
    names = ", ".join(p.name for p in params)
    return (f"{cls.__name__}.forward({names}) takes no routing; {layer} replaces "
            "forward(hidden_states, top_k_index, top_k_weights)")


def mismatch_reason(module: nn.Module) -> str | None:
    """Why a module kernelhub found by its shape (an `*Experts` class with stacked 3-D weights) is not
    MoEExperts, or None: its forward must take the routing, and its weights must not be fp8 (an
    `FP8Experts` module is layer MoEExpertsFP8: the 16-bit kernels would read its bytes as numbers)."""
    if _holds_fp8(module):
        return (f"{type(module).__name__}: fp8 expert weights with block scales are layer MoEExpertsFP8, "
                "not MoEExperts")
    return _routing_mismatch(module, "MoEExperts")


def fp8_mismatch_reason(module: nn.Module) -> str | None:
    """Why a module found by its shape is not MoEExpertsFP8, or None: float8 `gate_up_proj` /
    `down_proj` with `*_scale_inv` tensors beside them (transformers `FP8Experts`), and a forward
    that takes the routing. 16-bit experts are MoEExperts."""
    name = type(module).__name__
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not all(isinstance(w, torch.Tensor) and w.dtype in _FP8_DTYPES for w in (gu, dn)):
        dtypes = "/".join(str(getattr(w, "dtype", None)) for w in (gu, dn))
        return (f"{name}: expert weights {dtypes} are not fp8 (16-bit experts are layer MoEExperts; "
                "4-bit packed ones have no kernel)")
    missing = [s for s in _SCALES if not isinstance(getattr(module, s, None), torch.Tensor)]
    if missing:
        return f"{name}: fp8 weights without block scales {missing} are not MoEExpertsFP8 (FP8Experts)"
    return _routing_mismatch(module, "MoEExpertsFP8")


# `unsupported_reason` reads ~15 attributes, most of them absent (an AttributeError each through
# nn.Module.__getattr__): ~9 us a call on a CPU host. Besides the weights' shapes it reads a module's
# fixed configuration, so each module keeps its answer (in its __dict__, not its state) per shapes.
_SUPPORT_ATTR = "_kernelhub_moe_support"


def _support(module: nn.Module) -> str | None:
    """`unsupported_reason(module)`, remembered per module while its weight shapes stay."""
    params = module._parameters
    gu, dn = params.get("gate_up_proj"), params.get("down_proj")
    if gu is None or dn is None:  # not parameters (an unusual layout): the full check every call
        return unsupported_reason(module)
    shapes = (gu.shape, dn.shape)
    hit = module.__dict__.get(_SUPPORT_ATTR)
    if hit is not None and hit[0] == shapes:
        return hit[1]
    reason = unsupported_reason(module)
    module.__dict__[_SUPPORT_ATTR] = (shapes, reason)
    return reason


def _check_inputs(fn: str, module: nn.Module, hidden_states, top_k_index, top_k_weights) -> tuple[int, int]:
    """(T, K) of a layer call; errors name the layer's arguments, not those of `fused_experts`."""
    named = (("hidden_states", hidden_states), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if hidden_states.dim() == 0:
        raise ValueError(f"{fn}: `hidden_states` must be [..., H], got a 0-d tensor")
    if not hidden_states.is_floating_point():  # a cast would round and return integers
        raise TypeError(f"{fn}: `hidden_states` must be floating point, got {hidden_states.dtype}")
    H = module.gate_up_proj.shape[-1]
    if hidden_states.shape[-1] != H:
        raise ValueError(f"{fn}: `hidden_states` must be [..., H={H}] (the module's hidden size), "
                         f"got shape {tuple(hidden_states.shape)}")
    for name, t in named[1:]:
        if t.device != hidden_states.device:
            raise ValueError(f"{fn}: `{name}` must be on {hidden_states.device} like `hidden_states`, got {t.device}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: `top_k_index` must be int32 or int64, got {top_k_index.dtype}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"{fn}: `top_k_weights` must be floating point, got {top_k_weights.dtype}")
    if top_k_index.dim() == 0:
        raise ValueError(f"{fn}: `top_k_index` must be [..., K], got a 0-d tensor")
    T, K = math.prod(hidden_states.shape[:-1]), top_k_index.shape[-1]
    if math.prod(top_k_index.shape[:-1]) != T:
        raise ValueError(f"{fn}: `top_k_index` must have one row per token of `hidden_states` ({T}), "
                         f"got shape {tuple(top_k_index.shape)}")
    if top_k_weights.dim() == 0 or top_k_weights.shape[-1] != K or math.prod(top_k_weights.shape[:-1]) != T:
        raise ValueError(f"{fn}: `top_k_weights` must have the shape of `top_k_index` ({T} rows of K={K}), "
                         f"got shape {tuple(top_k_weights.shape)}")
    return T, K


def _run(fn: str, module: nn.Module, hidden_states, top_k_index, top_k_weights, variant: str | None,
         checked: bool = False, fp8: bool = False):
    """The layer forward: `module`'s experts on the call's routing, in the call's shape and dtype.
    fp8: a transformers `FP8Experts` module (its scales and block size go along; the activations stay
    16/32-bit, quantized in the kernels)."""
    if not checked:
        reason = (_fp8_support if fp8 else _support)(module)
        if reason is not None:
            raise ValueError(f"{fn}: {reason}")
    T, K = _check_inputs(fn, module, hidden_states, top_k_index, top_k_weights)
    # transformers skips ids == E (and EP sentinels >= E): fused_experts (every variant) drops ids
    # outside [0, E) itself, sync-free, so they pass through unmapped.
    # [..., H] -> [T, H] (a view when it can); sizes spelled out, as -1 is ambiguous for an empty batch.
    # 2-D arguments (what transformers' MoE blocks pass) are [T, H] and [T, K] already (checked above):
    # used as they are, saving a view each (~1 us of host time apiece in a host-bound decode step)
    flat = hidden_states.dim() == 2
    x = hidden_states if flat else hidden_states.reshape(T, hidden_states.shape[-1])
    gu = module.gate_up_proj
    extra = {}
    if fp8:
        extra = dict(gate_up_proj_scale_inv=module.gate_up_proj_scale_inv,
                     down_proj_scale_inv=module.down_proj_scale_inv, block_size=tuple(module.block_size))
    elif x.dtype != gu.dtype:  # autocast / fp32 activations with bf16 weights
        x = x.to(gu.dtype)
    if torch._C._are_functorch_transforms_active():  # (vmap, grad, ...: the kernels cannot run there)
        variant = "reference"
    idx = top_k_index if top_k_index.dim() == 2 else top_k_index.reshape(T, K)
    weights = top_k_weights if top_k_weights.dim() == 2 else top_k_weights.reshape(T, K)
    out = fused_experts(x, gu, module.down_proj, idx, weights, variant=variant, check_indices=False, **extra)
    if out.dtype != hidden_states.dtype:
        out = out.to(hidden_states.dtype)
    return out if flat else out.view(hidden_states.shape)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers `ExpertsInterface` implementation "kernelhub": (module, hidden, idx, weights).

    Register once, before `from_pretrained(..., experts_implementation="kernelhub")`:
    `transformers.integrations.moe.ExpertsInterface.register("kernelhub", experts_forward)`.
    Modules `fused_experts` cannot serve (e.g. GptOssExperts) run their eager forward, which
    `use_experts_implementation` keeps as `type(module).forward.__wrapped__`.
    """
    reason = _support(self)
    if reason is not None:
        return _eager("experts_forward", reason, self, hidden_states, top_k_index, top_k_weights)
    return _run("experts_forward", self, hidden_states, top_k_index, top_k_weights, None, checked=True)


def _eager(fn: str, reason: str, module: nn.Module, hidden_states, top_k_index, top_k_weights):
    """The module's own forward (`use_experts_implementation` keeps it as `forward.__wrapped__`)."""
    eager = getattr(type(module).forward, "__wrapped__", None)
    if eager is None:
        raise ValueError(f"{fn}: {reason}; no eager forward to fall back to")
    return eager(module, hidden_states, top_k_index, top_k_weights)


def fp8_unsupported_reason(module: nn.Module) -> str | None:
    """Why `fused_experts` cannot serve this transformers `FP8Experts` module, or None if it can:
    float8_e4m3fn [gate; up] and down weights with 2-D block scales, dynamic activation scales,
    plain SiLU-gated experts without bias."""
    name = type(module).__name__
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor):
        return f"{name}: needs tensors `gate_up_proj` and `down_proj` (separate up_proj is not supported)"
    if gu.dtype != torch.float8_e4m3fn or dn.dtype != torch.float8_e4m3fn:
        return f"{name}: expert weights {gu.dtype}/{dn.dtype} are not float8_e4m3fn (e.g. fp4-packed)"
    for attr in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):
        if not isinstance(getattr(module, attr, None), torch.Tensor):
            return f"{name}: needs tensor `{attr}`"
    block = getattr(module, "block_size", None)
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        return f"{name}: block_size {block!r} is not a 2-D block (per-tensor/per-row scales are not supported)"
    if tuple(block) != BLOCK:  # (the reference takes any block, but a GPU binds a Triton variant)
        return f"{name}: block_size {tuple(block)!r} is not supported (the Triton kernels take {BLOCK} blocks)"
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return f"{name}: static activation scales are not supported (dynamic only)"
    if getattr(module, "has_bias", False) or not getattr(module, "has_gate", True):
        return f"{name}: expert biases and non-gated experts are not supported"
    for attr in ("swiglu_alpha", "swiglu_limit", "limit", "gate_softcap", "up_softcap"):
        if getattr(module, attr, None) is not None:
            return f"{name}: `{attr}` (a modified SwiGLU) is not supported"
    act_fn = getattr(module, "act_fn", None)
    if not _is_silu(act_fn):
        return f"{name}: activation {type(act_fn).__name__} is not SiLU"
    if gu.dim() != 3 or dn.dim() != 3 or gu.shape[1] != 2 * dn.shape[2] or gu.shape[2] != dn.shape[1]:
        return f"{name}: weight shapes {tuple(gu.shape)}, {tuple(dn.shape)} are not [E, 2I, H], [E, H, I]"
    # transformers allocates gate_up's scales >= 2 block rows (for I <= 64 not the [gate; up] blocks)
    E, two_i, H = gu.shape
    for attr, rows, cols in (("gate_up_proj_scale_inv", two_i, H), ("down_proj_scale_inv", H, two_i // 2)):
        want = [E, -(-rows // BLOCK[0]), -(-cols // BLOCK[1])]
        got = list(getattr(module, attr).shape)
        if got != want:
            return f"{name}: `{attr}` {got} is not the {BLOCK} block layout of its weight, {want}"
    return None


_FP8_SUPPORT_ATTR = "_kernelhub_moe_fp8_support"


def _fp8_support(module: nn.Module) -> str | None:
    """`fp8_unsupported_reason(module)`, remembered per module while its weights' shapes and dtypes,
    its scales' shapes and its block size stay (as `_support`: a decode step must not re-read a
    dozen attributes)."""
    params = module._parameters
    gu, dn = params.get("gate_up_proj"), params.get("down_proj")
    if gu is None or dn is None:  # not parameters (an unusual layout): the full check every call
        return fp8_unsupported_reason(module)
    block = getattr(module, "block_size", None)
    if isinstance(block, list):  # (a copy: the same list changed in place must not match itself)
        block = tuple(block)
    scales = tuple(getattr(params.get(n), "shape", None) for n in _SCALES)
    key = (gu.shape, gu.dtype, dn.shape, dn.dtype, block, scales)
    hit = module.__dict__.get(_FP8_SUPPORT_ATTR)
    if hit is not None and hit[0] == key:
        return hit[1]
    reason = fp8_unsupported_reason(module)
    module.__dict__[_FP8_SUPPORT_ATTR] = (key, reason)
    return reason


def fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers `FP8ExpertsInterface` implementation "kernelhub" for `FP8Experts` modules
    (`FineGrainedFP8Config` or pre-quantized checkpoints), variant by the input device's capability
    ([dispatch_fp8]). Register once, before `from_pretrained(..., experts_implementation="kernelhub")`:
    `transformers.integrations.finegrained_fp8.ALL_FP8_EXPERTS_FUNCTIONS.register("kernelhub",
    fp8_experts_forward)`. Modules it cannot serve run their eager forward."""
    fn = "fp8_experts_forward"
    reason = _fp8_support(self)
    if reason is not None:
        return _eager(fn, reason, self, hidden_states, top_k_index, top_k_weights)
    return _run(fn, self, hidden_states, top_k_index, top_k_weights, None, checked=True, fp8=True)


class MoEExperts(nn.Module):
    """fused_experts for a transformers `*Experts` module; variant by the input device's capability."""

    # kernelize asks the layer whether it can serve a module before binding it ...
    unsupported_reason = staticmethod(unsupported_reason)
    # ... and, for a module it found by shape, whether the module is MoEExperts at all.
    mismatch_reason = staticmethod(mismatch_reason)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _run("MoEExperts.forward", self, hidden_states, top_k_index, top_k_weights, None)


class MoEExpertsSm90(MoEExperts):
    """Hopper: TMA weight tiles, larger tiles (configs/sm90.json)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _run("MoEExperts.forward", self, hidden_states, top_k_index, top_k_weights, "sm90")


class MoEExpertsSm80(MoEExperts):
    """Ampere and other GPUs: pointer loads, multi-stage pipelining (configs/sm80.json)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _run("MoEExperts.forward", self, hidden_states, top_k_index, top_k_weights, "sm80")


class MoEExpertsReference(MoEExperts):
    """Torch reference (CPU, or any device without a Triton path)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _run("MoEExperts.forward", self, hidden_states, top_k_index, top_k_weights, "reference")


class MoEExpertsFP8(nn.Module):
    """fused_experts on a transformers `FP8Experts` module's fp8 weights and block scales; variant by
    the input device's capability as kernel.toml's [dispatch_fp8] says."""

    unsupported_reason = staticmethod(fp8_unsupported_reason)
    mismatch_reason = staticmethod(fp8_mismatch_reason)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _run("MoEExpertsFP8.forward", self, hidden_states, top_k_index, top_k_weights, None, fp8=True)


class MoEExpertsFP8Sm90(MoEExpertsFP8):
    """fp8 tensor cores (sm89 and later): activations quantized per token and 128-column group."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _run("MoEExpertsFP8.forward", self, hidden_states, top_k_index, top_k_weights, "sm90", fp8=True)


class MoEExpertsFP8Sm80(MoEExpertsFP8):
    """W8A16 (GPUs without fp8 tensor cores): fp8 weights converted to 16 bits in registers."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _run("MoEExpertsFP8.forward", self, hidden_states, top_k_index, top_k_weights, "sm80", fp8=True)


class MoEExpertsFP8Reference(MoEExpertsFP8):
    """Torch reference on the dequantized weights (CPU, or any device without a Triton path)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _run("MoEExpertsFP8.forward", self, hidden_states, top_k_index, top_k_weights, "reference", fp8=True)


def _declare_attributes() -> None:
    """has_backward / can_torch_compile of each class, as kernel.toml's [layers.<class>] declares
    them (true: under torch.compile `fused_experts` is one custom op, forward and backward, so
    Dynamo traces no launch code and the graph does not break)."""
    for name, spec in declared_layers():
        cls = globals()[name]
        cls.has_backward, cls.can_torch_compile = spec["has_backward"], spec["can_torch_compile"]


_declare_attributes()
