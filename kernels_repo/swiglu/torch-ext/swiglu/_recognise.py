"""Whether a gate/up/down MLP is SwiGLU: a SiLU activation, and a forward that computes exactly it.

kernelhub finds transformers v5 MLPs by shape (they name no layer) and asks this package whether
one really is SwiGLUMLP. Shape is not enough: transformers 5.24 has gate/up/down MLPs that scale
(FalconH1MLP's multipliers), clamp (Glm5NextTextMLP, Step3p7MLP, DeepseekV4MLP) or normalise
(BitNetMLP) on the way, and binding the plain SwiGLU to them would silently change the model. So an
MLP is only taken when its forward's source says `down_proj(act_fn(gate_proj(x)) * up_proj(x))`
and nothing else (the activation held as `act_fn`, or as `activation_fn` like Llama4TextMLP).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATION_ATTRS", "activation_of", "is_silu", "mlp_mismatch_reason"]

# where transformers MLPs keep their activation (Llama4TextMLP: activation_fn)
ACTIVATION_ATTRS = ("act_fn", "activation_fn")
# transformers' ACT2FN["silu"] is SiLUActivation; torch's is nn.SiLU (a "swish" class may take a beta)
_SILU_NAMES = frozenset({"SiLU", "SiLUActivation"})
_LAYER = "SwiGLUMLP"


def is_silu(act: object) -> bool:
    """Whether `act` computes silu: nn.SiLU, F.silu, or a class named SiLU / SiLUActivation."""
    return isinstance(act, nn.SiLU) or act is F.silu or type(act).__name__ in _SILU_NAMES


def activation_of(module: object) -> tuple[str, object] | None:
    """(attribute name, activation) of a gated MLP, or None if it holds none under a known name."""
    for attr in ACTIVATION_ATTRS:
        act = getattr(module, attr, None)
        if act is not None:
            return attr, act
    return None


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
        return f"{cls.__name__}.forward does not take one input x; {_LAYER} computes {expected}"
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
            f"a norm or dropout on the way); kept as is (a class that is SwiGLU after all can say so "
            f"with @use_kernel_forward_from_hub('{_LAYER}'))")


_forward_problems: dict[tuple[type, str], str | None] = {}


def _forward_problem_cached(cls: type, act: str) -> str | None:
    """`_forward_problem`, parsed once per (class, activation attribute)."""
    key = (cls, act)
    if key not in _forward_problems:
        _forward_problems[key] = _forward_problem(cls, act)
    return _forward_problems[key]


def mlp_mismatch_reason(module: object) -> str | None:
    """Why a module with SwiGLUMLP's shape (gate_proj, up_proj, down_proj) is not SwiGLUMLP, or None."""
    name = type(module).__name__
    missing = [a for a in ("gate_proj", "up_proj", "down_proj") if not callable(getattr(module, a, None))]
    if missing:
        return f"{name} has no {', '.join(missing)}; {_LAYER} reads gate_proj, up_proj and down_proj"
    found = activation_of(module)
    if found is None:
        return f"{name} has no act_fn (or activation_fn); {_LAYER} needs a SiLU gate"
    attr, act = found
    if not is_silu(act):
        return f"{attr} is {type(act).__name__}, {_LAYER} needs SiLU"
    return _forward_problem_cached(type(module), attr)
