"""Which layer a module is: by `kernel_layer_name`, or by class for Hugging Face transformers v5.

transformers v5 sets no `kernel_layer_name` when Hugging Face `kernels` is not installed, so its
modules are recognised by shape: stacked-expert modules and SiLU-gated MLPs. Shape is not enough
for an MLP: transformers 5.24 has gate/up/down MLPs that scale (FalconH1MLP's multipliers), clamp
(Glm5NextTextMLP, Step3p7MLP, DeepseekV4MLP) or normalise (BitNetMLP) on the way, and binding the
plain SwiGLU to them would silently change the model. So an MLP found by shape is only taken when
its forward's source says `down_proj(act_fn(gate_proj(x)) * up_proj(x))` and nothing else (the
activation held as `act_fn`, or as `activation_fn` like Llama4TextMLP).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from torch import nn

__all__ = ["LayerMatch", "match_layer"]

MOE_EXPERTS = "MoEExperts"
SWIGLU_MLP = "SwiGLUMLP"
_SILU_NAMES = {"SiLU", "SiLUActivation", "SwishActivation", "Swish"}
# where transformers MLPs keep their activation (Llama4TextMLP: activation_fn); the layer reads the same
ACTIVATION_ATTRS = ("act_fn", "activation_fn")


@dataclass(frozen=True)
class LayerMatch:
    layer_name: str
    # Set when the module looks like the layer but cannot use it (kernelize reports it).
    unsupported_reason: str | None = None


def _is_silu(act: object) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    return type(act).__name__ in _SILU_NAMES


class _Inline(ast.NodeTransformer):
    """Replaces the names assigned so far by the expressions assigned to them."""

    def __init__(self, env: dict[str, ast.expr]):
        self.env = env

    def visit_Name(self, node: ast.Name) -> ast.expr:
        value = self.env.get(node.id)
        return node if value is None else _copy(value)


def _copy(node: ast.expr) -> ast.expr:
    return ast.parse(ast.unparse(node), mode="eval").body


def _self_call(node: ast.expr, attr: str, arg_ok) -> bool:
    """`self.<attr>(arg)` with one positional argument that satisfies `arg_ok`."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
        and len(node.args) == 1
        and not node.keywords
        and arg_ok(node.args[0])
    )


def activation_of(module: nn.Module) -> tuple[str, object] | None:
    """(attribute name, activation) of a gated MLP, or None if it holds none under a known name."""
    for attr in ACTIVATION_ATTRS:
        act = getattr(module, attr, None)
        if act is not None:
            return attr, act
    return None


def _is_swiglu(expr: ast.expr, x: str, act: str) -> bool:
    def is_x(n: ast.expr) -> bool:
        return isinstance(n, ast.Name) and n.id == x

    def gate(n: ast.expr) -> bool:
        return _self_call(n, act, lambda a: _self_call(a, "gate_proj", is_x))

    def up(n: ast.expr) -> bool:
        return _self_call(n, "up_proj", is_x)

    def product(n: ast.expr) -> bool:
        return (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)
                and ((gate(n.left) and up(n.right)) or (up(n.left) and gate(n.right))))

    return _self_call(expr, "down_proj", product)


def _forward_problem(cls: type, act: str) -> str | None:
    """None if `cls.forward` computes exactly down_proj(<act>(gate_proj(x)) * up_proj(x))."""
    expected = f"down_proj({act}(gate_proj(x)) * up_proj(x))"
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
        fn = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return f"{cls.__name__}.forward has no readable source to check that it computes {expected}"
    if not isinstance(fn, ast.FunctionDef) or len(fn.args.args) != 2:
        return f"{cls.__name__}.forward does not take one input x; SwiGLUMLP computes {expected}"
    x = fn.args.args[1].arg
    env: dict[str, ast.expr] = {}
    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)):
            env[stmt.targets[0].id] = _Inline(env).visit(stmt.value)
            continue
        if isinstance(stmt, ast.Return) and stmt.value is not None:
            if _is_swiglu(_Inline(env).visit(stmt.value), x, act):
                return None
            break
        break
    return (f"{cls.__name__}.forward computes something other than {expected} (scaling, clamping, "
            "a norm or dropout on the way); kept as is (a class that is SwiGLU after all can say so "
            "with @use_kernel_forward_from_hub('SwiGLUMLP'))")


def _experts_forward_problem(cls: type) -> str | None:
    """None if `cls.forward` takes the routing as transformers v5 `*Experts` do: (hidden_states,
    top_k_index, top_k_weights). Llama4TextExperts takes hidden states already sorted per expert
    and no routing; binding MoEExperts there would misread its inputs whatever the weight shapes."""
    try:
        every = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return None  # no signature to read (a C extension): the layer's own checks decide
    params = [p for p in every if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    if len(params) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in every):
        return None
    names = ", ".join(p.name for p in params)
    return (f"{cls.__name__}.forward({names}) takes no routing; MoEExperts replaces "
            "forward(hidden_states, top_k_index, top_k_weights)")


_forward_problems: dict[tuple[type, str], str | None] = {}


def swiglu_forward_problem(cls: type, act: str = "act_fn") -> str | None:
    """`_forward_problem`, parsed once per (class, activation attribute)."""
    key = (cls, act)
    if key not in _forward_problems:
        _forward_problems[key] = _forward_problem(cls, act)
    return _forward_problems[key]


def match_layer(module: nn.Module) -> LayerMatch | None:
    """The kernel layer `module` corresponds to, or None if it is not one we kernelize."""
    name = getattr(type(module), "kernel_layer_name", None) or getattr(module, "kernel_layer_name", None)
    if isinstance(name, str) and name:
        return LayerMatch(name)
    cls_name = type(module).__name__
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if cls_name.endswith("Experts") and isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter):
        if gate_up.dim() == 3 and down.dim() == 3:
            return LayerMatch(MOE_EXPERTS, _experts_forward_problem(type(module)))
    projections = [getattr(module, a, None) for a in ("gate_proj", "up_proj", "down_proj")]
    if all(isinstance(p, nn.Linear) for p in projections):
        found = activation_of(module)
        if found is None:
            return LayerMatch(SWIGLU_MLP, f"{cls_name} has no act_fn (or activation_fn); SwiGLUMLP needs a SiLU gate")
        attr, act = found
        if not _is_silu(act):
            return LayerMatch(SWIGLU_MLP, f"{attr} is {type(act).__name__}, SwiGLUMLP needs SiLU")
        return LayerMatch(SWIGLU_MLP, swiglu_forward_problem(type(module), attr))
    return None
