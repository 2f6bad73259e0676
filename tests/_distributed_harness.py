"""Run a scenario on N ranks in fresh processes, bounded in time, and collect each rank's result.

Processes come from a forkserver that has imported torch once, so a 4-rank run starts in well under
a second instead of four cold `import torch`s (~2 s each on a 2-core CI machine). Each rank writes
its result (or its traceback) to a file; the caller gets a list indexed by rank, or a test failure
naming the ranks that crashed or did not finish in time (they are killed).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

_CTX: Any = None


def _context():
    global _CTX
    if _CTX is None:
        if "forkserver" in mp.get_all_start_methods():
            _CTX = mp.get_context("forkserver")
            _CTX.set_forkserver_preload(["torch", "torch.distributed", "_distributed_scenarios"])
        else:
            _CTX = mp.get_context("spawn")
    return _CTX


def _worker(
    rank: int,
    world: int,
    backend: str,
    store: str,
    scenario: str,
    kwargs: dict,
    env: dict,
    out: str,
    op_timeout: float | None,
):
    import _distributed_scenarios as scenarios
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    try:
        init = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            init["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
            **init,
        )
        if op_timeout is not None:
            # Startup (forkserver, rendezvous) can take seconds on a loaded machine; collectives of
            # this group time out after `op_timeout`: a rank left waiting fails the test quickly.
            kwargs = {**kwargs, "group": dist.new_group(timeout=timedelta(seconds=op_timeout))}
        result = ("ok", getattr(scenarios, scenario)(rank, world, **kwargs))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        with open(out, "wb") as f:
            pickle.dump(result, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    scenario: str,
    world: int,
    *,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    op_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `_distributed_scenarios.<scenario>(rank, world, **kwargs)` on `world` processes.

    With `op_timeout`, the scenario also gets `group=`: a new group of all ranks whose collectives
    time out after that many seconds (the default group's timeout is 60 s).
    """
    ctx = _context()
    env = {"KERNELHUB_CHECK_ALLOC_SYMMETRY": "0", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="kernelhub-dist-") as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world, backend, store, scenario, kwargs, env, outs[r], op_timeout),
                name=f"{scenario}-rank{r}",
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join(5)
        results: list[Any] = []
        errors: list[str] = []
        for r, path in enumerate(outs):
            if not Path(path).exists():
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            status, value = pickle.loads(Path(path).read_bytes())
            if status != "ok":
                errors.append(f"rank {r} raised {value}")
            results.append(value)
    if hung:
        pytest.fail(
            f"{scenario} on {world} ranks: ranks {hung} did not finish in {timeout:.0f}s (killed)\n"
            + "\n".join(errors)
        )
    if errors:
        pytest.fail(f"{scenario} on {world} ranks failed:\n" + "\n".join(errors))
    return results
