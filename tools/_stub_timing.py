"""Host-time medians for the launch-stubbed CPU scripts in tools/ (host_stub_*.py)."""

import statistics
import time
from collections.abc import Callable, Hashable


def interleaved_medians(fns: dict[Hashable, Callable[[], object]], n: int, warmup: int,
                        rounds: int = 5) -> dict[Hashable, float]:
    """Median us per call of each fn over `rounds` rounds, every fn once per round (the host's speed
    drifts, so fns timed one after the other would each get a different host)."""
    times: dict[Hashable, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            for _ in range(warmup):
                fn()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[key].append((time.perf_counter() - t0) / n * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}
