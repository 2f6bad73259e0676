"""Routing alignment of fused_experts: (token, k) pairs grouped by expert, padded to block_m.

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by the root conftest).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _experts_helpers import (
    moe,
)


@pytest.mark.parametrize("small", [True, False], ids=["one_triton_program", "mapping_kernels"])
def test_alignment_groups_pairs_by_expert_in_token_order(small, monkeypatch):
    routing = importlib.import_module(moe.__name__ + "._experts_routing")
    if not small:
        monkeypatch.setattr(routing, "SMALL_PAIRS", 0)
    idx = torch.tensor([[2, 0], [0, -1], [2, 5], [7, 0]])
    r = routing.align_rows(idx, num_experts=6, block_m=4)  # 7 is out of range: dropped
    assert r.num_rows % 4 == 0 and r.num_rows >= 4
    rows = r.rows.tolist()
    for t in range(4):
        for k in range(2):
            p = int(r.token_topk_to_pos[t, k])
            e = int(idx[t, k])
            if 0 <= e < 6:
                assert rows[p] == t * 2 + k
                assert int(r.row_expert[p]) == e
                assert int(r.expert_start[e]) <= p < int(r.expert_start[e]) + int(r.expert_count[e])
            else:
                assert p == -1
    assert r.expert_count.tolist() == [3, 0, 2, 0, 0, 1]
    assert rows[int(r.expert_start[0]):int(r.expert_start[0]) + 3] == [1, 2, 7]  # token order kept
    assert sum(1 for v in rows if v >= 0) == 6


def test_small_alignment_kernel_equals_torch_alignment(monkeypatch):
    routing = importlib.import_module(moe.__name__ + "._experts_routing")
    g = torch.Generator().manual_seed(4)
    for T, K, E, block_m in [(1, 8, 128, 16), (9, 3, 7, 32), (20, 2, 40, 16)]:
        idx = torch.randint(-1, E + 1, (T, K), generator=g)
        small = routing._align_small(idx, E, block_m)
        monkeypatch.setattr(routing, "SMALL_PAIRS", 0)
        full = routing.align_rows(idx, E, block_m)
        monkeypatch.undo()
        for field in ("rows", "row_expert", "expert_start", "expert_count", "token_topk_to_pos"):
            assert torch.equal(getattr(small, field), getattr(full, field)), field
        assert small.num_rows == full.num_rows

