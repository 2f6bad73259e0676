# expand_to_fused: with T == 0 (no tokens) but a mapping of P > 0 rows (explicit
# num_expanded_tokens, or force_no_sync's upper bound), every row is padding and must be zero,
# but the Triton path returns torch.empty memory untouched.
import os; os.environ["TRITON_INTERPRET"] = "1"
import torch
from kernelhub import get_local_kernel
moe = get_local_kernel("/work/main/kernels_repo/moe")

_empty = torch.empty
def poisoned_empty(*a, **k):          # make uninitialised memory visible (as the project's tests do)
    t = _empty(*a, **k)
    if t.is_floating_point(): t.fill_(float("nan"))
    return t
torch.empty = poisoned_empty

idx = torch.empty((0, 4), dtype=torch.int64)
p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 8, 0, 16, force_no_sync=True)   # P = 112, all padding
print("P =", p2e.numel(), "all padding:", bool((p2e == -1).all()))
x = torch.randn(0, 32)
y = moe.expand_to_fused(x, inv, p2e)
print("expected all zeros; got all zeros:", bool((y == 0).all()), "NaNs:", int(y.isnan().sum()))
torch.empty = _empty
# reference path for comparison
print("reference:", bool((moe.reference_routing.expand_to_fused_ref(x, inv, p2e.numel()) == 0).all()))
