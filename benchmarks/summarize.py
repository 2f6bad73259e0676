"""Markdown tables from the benchmarks' JSON lines (as pasted into docs/performance.md).

    python benchmarks/summarize.py swiglu benchmarks/results/2026-12-05-s14-call6/swiglu_bench.jsonl
    python benchmarks/summarize.py moe benchmarks/results/2026-12-05-s13-call3/bench_moe.jsonl [more.jsonl]
    python benchmarks/summarize.py slice $OUT/bench_model_slice.jsonl
    python benchmarks/summarize.py fp8 $OUT/bench_fp8.jsonl
"""

from __future__ import annotations

import json
import sys


def rows(paths: list[str]) -> list[dict]:
    return [json.loads(line) for p in paths for line in open(p) if line.strip()]


SWIGLU_IMPLS = ["ours", "ours_sm80", "ours_sm90", "ours[compiled]", "ours[reduce-overhead]", "eager", "compile",
                "compile[reduce-overhead]", "liger", "liger[compiled]", "liger[reduce-overhead]"]


def swiglu_peer(name: str) -> bool:
    return not name.startswith("ours")


def swiglu(data: list[dict]) -> None:
    """Fraction of copy bandwidth per implementation, eager call / graph replay (reduce-overhead has
    no graph column: it replays its own), then per call the fastest of ours and of every peer."""
    copy = next(r["value"] for r in data if r.get("what") == "d2d_copy_GBps") * 1e9
    impls = SWIGLU_IMPLS
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s\n")
    present = [i for i in impls if any(r.get("impl") == i for r in data)]
    print("| T x I | pass | " + " | ".join(f"{i} eager / graph" for i in present)
          + " | ours best per call (which) | best peer per call (which) | speed-up |")
    print("| --- | --- |" + " --- |" * (len(present) + 3))
    shapes = dict.fromkeys((r["T"], r["I"]) for r in data if r.get("kind") == "swiglu")  # in run order
    for T, I in shapes:
        for p, tensors in (("fwd", 3), ("fwdbwd", 8)):
            cells, timed = [], []
            for i in present:
                r = next((r for r in data if r.get("kind") == "swiglu" and r["impl"] == i and r["T"] == T
                          and r["I"] == I and r["pass_"] == p), None)
                if r is None:
                    cells.append("-")
                    continue
                timed.append(r)
                nbytes = tensors * T * I * 2
                eager, graph = (None if r.get(k) is None else nbytes / (r[k] * 1e-6) / copy
                                for k in ("eager_us", "graph_us"))
                cells.append(f"{eager:.2f} / " + ("-" if graph is None else f"{graph:.2f}"))
            if not timed:
                continue
            ours = min((r for r in timed if not swiglu_peer(r["impl"])), key=lambda r: r["eager_us"], default=None)
            peer = min((r for r in timed if swiglu_peer(r["impl"])), key=lambda r: r["eager_us"], default=None)
            for r in (ours, peer):
                cells.append("-" if r is None else f"{r['eager_us']:.1f} us ({r['impl']})")
            cells.append("-" if ours is None or peer is None else f"{peer['eager_us'] / ours['eager_us']:.2f}x")
            print(f"| {T}x{I} | {p} | " + " | ".join(cells) + " |")
    print("\nhost time per eager call, T=1 x I=128 (us):",
          ", ".join(f"{r['impl']} {r['pass_']} {r['host_us']:.1f}" for r in data if r.get("kind") == "host_overhead"))
    inter = [r for r in data if r.get("kind") == "swiglu_interleaved"]
    if inter:  # host-bound shapes, implementations interleaved over rounds (bench_swiglu.interleaved_eager)
        names = [i for i in impls if any(r["impl"] == i for r in inter)]
        print(f"\nper eager call, interleaved ({inter[0]['rounds']} rounds, median us; min-max):\n")
        print("| shape | pass | " + " | ".join(names) + " |")
        print("| --- | --- |" + " --- |" * len(names))

        def shape(r: dict) -> tuple:  # [T, I], or [1, T, I] (a model's layout); older logs: T x I
            return tuple(r.get("shape", (r["T"], r["I"])))

        keys = {(shape(r), r["pass_"]) for r in inter}
        for sh, p in sorted(keys, key=lambda k: (-k[0][-2] * k[0][-1], len(k[0]), k[1])):
            cells = []
            for i in names:
                r = next((r for r in inter if (r["impl"], shape(r), r["pass_"]) == (i, sh, p)), None)
                cells.append("-" if r is None else
                             f"{r['eager_us']:.1f} ({r['eager_us_min']:.0f}-{r['eager_us_max']:.0f})")
            print(f"| {'x'.join(map(str, sh))} | {p} | " + " | ".join(cells) + " |")


def moe_config(r: dict) -> tuple[str, str]:
    """(implementation, configuration) of a row; rows from before the compiled peers carry neither
    field (`kernelhub_compiled` was kernelhub under torch.compile, `kernelhub_graph` its CUDA graph)."""
    if "base" in r:
        return r["base"], r["config"]
    name = r["impl"]
    if name == "kernelhub_compiled":
        return "kernelhub", "compiled"
    if name.endswith("_graph"):
        return name[: -len("_graph")], "graph"
    return name, "eager"


def moe(data: list[dict]) -> None:
    """One row per (shape, T, pass): kernelhub eager / compiled / reduce-overhead, kernelhub's best
    configuration and the best peer configuration (the fastest of every peer, eager or compiled);
    best peer / floor is the most any implementation could lead that peer by."""
    print("| shape | T | pass | kernelhub eager ms (floor frac) | compiled | reduce-overhead "
          "| kernelhub best (which) | best peer ms (which) | best peer / kernelhub eager "
          "| best peer / kernelhub best | best peer / floor | slower compiled / eager |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    keys = sorted({(r["shape"], r["T"], r["kind"]) for r in data if r.get("kind") in ("moe_fwd", "moe_fwdbwd")},
                  key=lambda k: (k[0], k[1], k[2]))
    for shape, T, kind in keys:
        rs = [r for r in data if (r.get("shape"), r.get("T"), r.get("kind")) == (shape, T, kind)]
        ours = [r for r in rs if moe_config(r)[0] == "kernelhub"]
        by_config = {moe_config(r)[1]: r for r in ours}
        eager = by_config.get("eager")
        peers = [r for r in rs if moe_config(r)[0] != "kernelhub"]
        if eager is None or not peers:
            continue
        best = min(peers, key=lambda r: r["ms"])
        mine = min(ours, key=lambda r: r["ms"])

        def cell(config: str, by_config: dict = by_config) -> str:
            r = by_config.get(config)
            return "-" if r is None else f"{r['ms']:.3f}"

        worst_compiled = max((by_config[c]["ms"] for c in ("compiled", "reduce-overhead") if c in by_config),
                             default=None)
        ratio = "-" if worst_compiled is None else f"{worst_compiled / eager['ms']:.2f}"
        print(f"| {shape} | {T} | {kind[4:]} | {eager['ms']:.3f} ({eager['frac_floor']:.2f}) | {cell('compiled')} | "
              f"{cell('reduce-overhead')} | {mine['ms']:.3f} ({mine['impl']}) | {best['ms']:.3f} ({best['impl']}) | "
              f"{best['ms'] / eager['ms']:.2f}x | {best['ms'] / mine['ms']:.2f}x | "
              f"{best['ms'] / best['floor_ms']:.2f}x | {ratio} |")


def model_slice(data: list[dict]) -> None:
    """Per (model, T): kernelhub's best configuration against the best other one (bench_model_slice.py)."""
    for r in data:
        if r.get("kind") == "slice_model":
            print(f"{r['model']}: layers {', '.join(r['layers'])}; {r['experts']} experts, top-{r['top_k']}, "
                  f"{r['params_GB']:.1f} GB bf16; {r['decode']}")
    print("\n| model | T | kernelhub eager | kernelhub compiled | kernelhub reduce-overhead | kernelhub best (which) "
          "| best other ms (which) | hf_grouped_mm eager / compiled / reduce-overhead | best other / kernelhub best |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    timed = [r for r in data if r.get("kind") == "slice_fwd"]
    for model, T in dict.fromkeys((r["model"], r["T"]) for r in timed):
        rs = [r for r in timed if (r["model"], r["T"]) == (model, T)]
        ours = [r for r in rs if r["base"] == "kernelhub"]
        others = [r for r in rs if r["base"] != "kernelhub"]

        def ms(base: str, config: str, rs: list[dict] = rs) -> str:
            r = next((r for r in rs if (r["base"], r["config"]) == (base, config)), None)
            return "-" if r is None else f"{r['ms']:.3f}"

        mine = min(ours, key=lambda r: r["ms"], default=None)
        best = min(others, key=lambda r: r["ms"], default=None)
        hf = " / ".join(ms("hf_grouped_mm", c) for c in ("eager", "compiled", "reduce-overhead"))
        cells = [ms("kernelhub", c) for c in ("eager", "compiled", "reduce-overhead")]
        cells += ["-" if r is None else f"{r['ms']:.3f} ({r['impl']})" for r in (mine, best)]
        cells += [hf, "-" if mine is None or best is None else f"{best['ms'] / mine['ms']:.2f}x"]
        print(f"| {model} | {T} | " + " | ".join(cells) + " |")


def fp8(data: list[dict]) -> None:
    """Per (shape, T) of bench_fp8.py: kernelhub fp8 against the ceilings of its own process (the
    fp8 matmul rate, the weight-bytes bound at copy bandwidth), its own compiled calls, kernelhub bf16
    and the best peer."""
    print("| shape | T | fp8 ms | of fp8 rate | of weight-bytes bound | fp8 compiled, reduce-overhead ms | W8A16 ms "
          "| bf16 ms | bf16 / fp8 | best peer ms (which) | best peer / fp8 | ceilings fp8 TFLOP/s, copy GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ceiling, points = None, {}
    for r in data:  # (each process measures its ceilings first; the points after it use them)
        if r.get("kind") == "fp8_ceiling":
            ceiling = r
        elif r.get("kind") == "fp8_fwd":
            points.setdefault((r["shape"], r["T"]), ({}, ceiling))[0][r["impl"]] = r
    for (shape, T), (impls, c) in points.items():
        ours, bf16, w8 = impls.get("kernelhub_fp8"), impls.get("kernelhub_bf16"), impls.get("kernelhub_fp8_w8a16")
        peers = [r for name, r in impls.items() if not name.startswith("kernelhub")]
        best = min(peers, key=lambda r: r["ms"], default=None)

        def ms(r: dict | None) -> str:
            return "-" if r is None else f"{r['ms']:.4f}"

        def ratio(a: dict | None, b: dict | None) -> str:
            return "-" if a is None or b is None else f"{a['ms'] / b['ms']:.2f}x"

        compiled = ", ".join(ms(impls.get(f"kernelhub_fp8[{c}]")) for c in ("compiled", "reduce-overhead"))
        cells = [ms(ours), "-" if ours is None else f"{ours['frac_fp8_rate']:.2f}",
                 "-" if ours is None else f"{ours['frac_bw']:.2f}", compiled, ms(w8), ms(bf16), ratio(bf16, ours),
                 "-" if best is None else f"{best['ms']:.4f} ({best['impl']})", ratio(best, ours),
                 "-" if c is None else f"{c['fp8_mm_TFLOPs']:.0f}, {c['copy_GBps']:.0f}"]
        print(f"| {shape} | {T} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    {"swiglu": swiglu, "moe": moe, "slice": model_slice, "fp8": fp8}[sys.argv[1]](rows(sys.argv[2:]))
