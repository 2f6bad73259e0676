"""MoE routing on one GPU: get_fused_mapping, expand_to_fused, reduce_fused against the floor and peers.

Shape (DeepSeek-V3 layer): T=16384 tokens, K=8, E=256 experts, H=7168, bf16, alignment 128.
Floors: expand/reduce move T*H + P*H elements; their ratio is to the device copy bandwidth
measured in this run. Peers in the same run: torch gather / index_add, and Liger-Kernel's
`compute_routing_metadata` (import guarded; bring its wheel, see benchmarks/README.md).

Usage: PYTHONPATH=src python benchmarks/bench_moe_routing.py   (env OUT, default /tmp; SWEEP=0 to
skip the block-size sweep). Prints one line per measurement, appends JSON lines to
$OUT/bench_moe_routing.jsonl. Runs in about a minute.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

from kernelhub.hub import get_local_kernel

REPO = Path(__file__).resolve().parents[1]
moe = get_local_kernel(REPO / "kernels_repo" / "moe")
checks = moe._routing_checks
kernels = moe._routing_kernels
ref = moe.reference_routing

OUT = os.environ.get("OUT", "/tmp")
LOG = open(os.path.join(OUT, "bench_moe_routing.jsonl"), "a")  # noqa: SIM115
DEV = torch.device("cuda", torch.cuda.current_device())
T, K, E, H, ALIGN = 16384, 8, 256, 7168, 128
STAMP = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def emit(**row):
    row = {"date": STAMP, "device": torch.cuda.get_device_name(DEV), **row}
    LOG.write(json.dumps(row) + "\n")
    LOG.flush()
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          flush=True)


def bench(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    a = torch.randn(1 << 29, device=DEV, dtype=torch.bfloat16)  # 1 GiB
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    bw = 2 * a.numel() * a.element_size() / (ms * 1e-3)
    emit(kind="ceiling", what="d2d_copy_GBps", value=bw / 1e9)
    return bw


def use_variant(name: str):
    cfg = kernels.SM90 if name == "sm90" else kernels.SM80
    sms = checks.get_num_sms(DEV)
    checks.select_config = lambda device: (cfg, sms)


def mapping(idx: torch.Tensor) -> int:
    p2e, *_ = moe.get_fused_mapping(idx, E, 0, ALIGN)
    num_pos = p2e.numel()
    want = ref.get_fused_mapping_ref(idx, E, num_pos, ALIGN)
    got = moe.get_fused_mapping(idx, E, num_pos, ALIGN)
    ok = all(torch.equal(g, w) for g, w in zip(got[:7], want, strict=True))
    for name in ("sm90", "sm80"):
        use_variant(name)
        moe.get_fused_mapping(idx, E, num_pos, ALIGN)
        us = bench(lambda: moe.get_fused_mapping(idx, E, num_pos, ALIGN)) * 1e3
        us_graph = do_bench_cudagraph(lambda: moe.get_fused_mapping(idx, E, num_pos, ALIGN),
                                      rep=100, return_mode="median") * 1e3
        us_sync = bench(lambda: moe.get_fused_mapping(idx, E, 0, ALIGN)) * 1e3
        emit(kind="get_fused_mapping", impl="kernelhub", variant=name, T=T, K=K, E=E, P=num_pos,
             us_explicit_P=us, us_explicit_P_cudagraph=us_graph, us_host_sync=us_sync, exact=ok)
    try:
        from liger_kernel.ops.fused_moe import compute_routing_metadata
    except Exception as e:  # noqa: BLE001
        print("liger compute_routing_metadata unavailable:", e)
    else:
        idx32 = idx.to(torch.int32)
        compute_routing_metadata(idx32, E)
        us = bench(lambda: compute_routing_metadata(idx32, E)) * 1e3
        emit(kind="get_fused_mapping", impl="liger_compute_routing_metadata", T=T, K=K, E=E, us=us)
    return num_pos


def expand_reduce(idx: torch.Tensor, copy_bw: float, sweep: bool):
    p2e, p2t, _, inv, *_ = moe.get_fused_mapping(idx, E, 0, ALIGN)
    num_pos = p2e.numel()
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(T, K, device=DEV)
    nbytes = (T + num_pos) * H * x.element_size()
    y_ref = ref.expand_to_fused_ref(x, inv, num_pos)
    z = torch.randn(num_pos, H, device=DEV, dtype=torch.bfloat16)
    r_ref = ref.reduce_fused_ref(z, w, inv)

    def run(impl, what, fn, check):
        out = fn()
        ok = check(out)
        ms = bench(fn)
        gbps = nbytes / (ms * 1e-3)
        emit(kind=what, impl=impl, T=T, K=K, E=E, H=H, P=num_pos, us=ms * 1e3, GBps=gbps / 1e9,
             frac_copy=gbps / copy_bw, correct=ok)

    exact = lambda out: torch.equal(out.view(torch.int16), y_ref.view(torch.int16))  # noqa: E731
    close = lambda out: ((out.float() - r_ref).norm() / r_ref.norm()).item() < 1e-2  # noqa: E731
    for name in ("sm90", "sm80"):
        use_variant(name)
        run(f"kernelhub_{name}", "expand_to_fused", lambda: moe.expand_to_fused(x, inv, p2e), exact)
        run(f"kernelhub_{name}", "reduce_fused", lambda: moe.reduce_fused(z, w, inv), close)
    if sweep:  # block sizes and warps, to choose the per-capability configs
        sms = checks.get_num_sms(DEV)
        for bh, nw in [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)]:
            cfg = kernels.RoutingConfig(**{**kernels.SM90.__dict__, "name": f"bh{bh}w{nw}",
                                           "copy_block_h": bh, "copy_warps": nw,
                                           "reduce_block_h": bh, "reduce_warps": nw})
            checks.select_config = lambda device, cfg=cfg: (cfg, sms)
            run(f"sweep_{cfg.name}", "expand_to_fused", lambda: moe.expand_to_fused(x, inv, p2e), exact)
            run(f"sweep_{cfg.name}", "reduce_fused", lambda: moe.reduce_fused(z, w, inv), close)
    # torch peers: a gather with padding rows zeroed; a weighted gather-sum over the K rows.
    src = p2t.long().clamp(min=0)
    pad = (p2e < 0).unsqueeze(1)

    def torch_expand():
        return x.index_select(0, src).masked_fill_(pad, 0)

    def torch_reduce():
        g = z[inv.long().clamp(min=0)].float() * (w * (inv >= 0)).unsqueeze(-1)
        return g.sum(1).to(z.dtype)

    run("torch", "expand_to_fused", torch_expand, exact)
    run("torch", "reduce_fused", torch_reduce, close)


def main():
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    scores = torch.randn(T, E, device=DEV)
    idx = torch.topk(scores, K, dim=1).indices  # int64 [T, K], distinct experts per token
    mapping(idx)
    expand_reduce(idx, copy_bw, sweep=os.environ.get("SWEEP", "1") == "1")


if __name__ == "__main__":
    main()
