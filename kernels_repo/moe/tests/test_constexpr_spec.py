"""`_constexpr_spec`: a kernel's constexprs by name, checked once against its @triton.jit signature."""

from __future__ import annotations

import importlib

import pytest
import triton
import triton.language as tl
from _experts_helpers import kern, launch, moe

spec = importlib.import_module(moe.__name__ + "._constexpr_spec")


@triton.jit
def _two_flags_kernel(x_ptr, n, FLAG_A: tl.constexpr, BLOCK: tl.constexpr):
    pass


@triton.jit
def _constexpr_in_the_middle_kernel(x_ptr, FLAG_A: tl.constexpr, n, BLOCK: tl.constexpr):
    pass


def test_a_spec_orders_named_values_as_the_kernel_does():
    Spec = spec.constexpr_spec(_two_flags_kernel, "BLOCK FLAG_A")  # any order: the kernel's decides
    assert Spec._fields == ("FLAG_A", "BLOCK")
    assert Spec(BLOCK=64, FLAG_A=True) == (True, 64)  # the plain tuple CachedLaunch.split keys on
    with pytest.raises(TypeError, match="BLOCK"):
        Spec(FLAG_A=True)  # every constexpr must be named at the launch


@pytest.mark.parametrize(("names", "words"), [
    ("FLAG_A", r"constexprs not given: \['BLOCK'\]"),
    ("FLAG_A BLOCK FLAG_B", r"not constexprs of the kernel: \['FLAG_B'\]"),
    ("FLAG_A BLOCK n", r"not constexprs of the kernel: \['n'\]"),  # a runtime parameter
    ("FLAG_A BLOCK BLOCK", r"names given: \['FLAG_A', 'BLOCK', 'BLOCK'\]"),
])
def test_a_spec_that_does_not_match_the_signature_is_a_clear_error(names, words):
    with pytest.raises(TypeError, match=r"constexpr spec of _two_flags_kernel: .*" + words):
        spec.constexpr_spec(_two_flags_kernel, names)


def test_constexprs_must_be_the_kernels_last_parameters():
    with pytest.raises(TypeError, match="must be the kernel's last parameters"):
        spec.constexpr_spec(_constexpr_in_the_middle_kernel, "FLAG_A BLOCK")


def test_every_launch_spec_matches_its_kernel():
    """The specs of `_experts_launch` (checked at import) hold the kernels' constexprs in order."""
    for spec_type, kernel in ((launch.GemmConstexprs, kern._grouped_gemm_kernel),
                              (launch.WgradConstexprs, kern._grouped_wgrad_kernel),
                              (launch.CombineConstexprs, kern._combine_kernel)):
        names = list(kernel.arg_names)
        assert list(spec_type._fields) == names[len(names) - len(spec_type._fields):]
    assert len(launch.GemmConstexprs._fields) == 17
