"""Per-rank buffers that every peer maps: CPU shared memory (tests, gloo) and CUDA symmetric memory.

A backing only maps memory; the bump allocator and the symmetry checks live in `SymmetricHeap`.
Both backings return one uint8 tensor of `nbytes` per rank of the group, indexable by group rank.
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
import uuid
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["CpuSharedBacking", "CudaSymmetricBacking"]

# Exchange a failure flag over the group and raise on every rank if any rank failed (_agree.agree).
Agree = Callable[..., None]


def _shm_dir() -> str:
    # /dev/shm is tmpfs on Linux: pages are RAM-backed and never written to disk.
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class CpuSharedBacking:
    """One file per rank in /dev/shm, mmapped by every rank of the group (one host only).

    Rank 0 picks a unique prefix and broadcasts it; each rank creates ``<prefix>-r<rank>``,
    then maps its peers' files. Once every rank has mapped every file each rank unlinks its own,
    so nothing is left in /dev/shm even if a process dies later: the mappings keep the pages.
    """

    def __init__(
        self, nbytes: int, group: dist.ProcessGroup, rank: int, world_size: int, agreed: Agree
    ) -> None:
        hosts: list[str | None] = [None] * world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) != 1:
            raise ValueError(
                "SymmetricHeap: the CPU backing shares memory between processes of one host, "
                f"but the group spans hosts {sorted(set(map(str, hosts)))}"
            )
        prefix = [f"kernelhub-symheap-{os.getpid()}-{uuid.uuid4().hex[:12]}" if rank == 0 else None]
        dist.broadcast_object_list(prefix, src=dist.get_global_rank(group, 0), group=group)
        directory = _shm_dir()
        paths = [os.path.join(directory, f"{prefix[0]}-r{r}") for r in range(world_size)]
        self._maps: list[mmap.mmap] = []
        own = paths[rank]
        created = False
        error: BaseException | None = None
        try:
            _check_room(directory, nbytes, world_size)
            fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            created = True
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            error = _no_room(e, nbytes, directory)
        except MemoryError as e:
            error = e
        try:
            # Every rank's file exists (or every rank raises) before anyone opens a peer's.
            agreed(error, where="SymmetricHeap (creating its shared-memory file)")
            for path in paths:
                try:
                    fd = os.open(path, os.O_RDWR)
                    try:
                        self._maps.append(mmap.mmap(fd, nbytes, mmap.MAP_SHARED))
                    finally:
                        os.close(fd)
                except OSError as e:
                    error = _no_room(e, nbytes, directory)
                    break
            # Every rank has mapped every file: the names are no longer needed.
            agreed(error, where="SymmetricHeap (mapping the peers' shared-memory files)")
        except BaseException:
            for m in self._maps:
                m.close()
            self._maps = []
            raise
        finally:
            if created:
                os.unlink(own)
        # Through numpy, whose array holds a buffer export on the mapping for as long as any tensor
        # viewing it lives (torch.frombuffer holds none: close() would unmap memory under live
        # tensors, and a use after close() would crash the process).
        self.buffers = [torch.from_numpy(np.frombuffer(m, dtype=np.uint8)) for m in self._maps]

    def close(self) -> None:
        self.buffers = []
        maps, self._maps = self._maps, []
        for m in maps:
            try:
                m.close()
            except BufferError:
                # A tensor from this heap is still alive; the mapping is released with it.
                pass


def _check_room(directory: str, nbytes: int, world_size: int) -> None:
    """Refuse a heap the shared-memory filesystem cannot hold.

    The files are sparse: creating one far larger than the filesystem succeeds, and the process is
    killed by SIGBUS when it first touches a page that has no room.
    """
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if nbytes * world_size > free:
        raise MemoryError(
            f"SymmetricHeap: {nbytes} bytes per rank x {world_size} ranks do not fit in {directory} "
            f"({free} bytes free): pass a smaller `nbytes`"
        )


def _no_room(error: OSError, nbytes: int, directory: str) -> MemoryError:
    return MemoryError(f"SymmetricHeap: could not map {nbytes} bytes per rank in {directory}: {error}")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


class CudaSymmetricBacking:
    """`torch.distributed._symmetric_memory` buffers (CUDA IPC / NVLink peer mappings).

    Multicast stays off: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set (unless the caller set it)
    before the first rendezvous, because multicast objects fail on some machines (no NVLS) and
    this heap issues no multimem operations.
    """

    def __init__(
        self,
        nbytes: int,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        device: torch.device,
        agreed: Agree,
    ) -> None:
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        if _torch_version() < (2, 11):
            # Before 2.11 rendezvous needs the group's store registered first (deprecated since).
            if not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
                symm_mem.enable_symm_mem_for_group(group.group_name)
        error: BaseException | None = None
        try:
            self._local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            error = MemoryError(
                f"SymmetricHeap: could not allocate {nbytes} bytes of symmetric memory on {device}: {e}"
            )
        # rendezvous is collective: a rank that failed above must not leave the others in it
        agreed(error, where="SymmetricHeap (allocating symmetric memory)")
        # The group name (a str) is accepted by rendezvous in every torch that has it.
        self._handle = symm_mem.rendezvous(self._local, group.group_name)
        self.buffers = [
            self._local if r == rank else self._handle.get_buffer(r, (nbytes,), torch.uint8, 0)
            for r in range(world_size)
        ]

    def close(self) -> None:
        self.buffers = []
        self._handle = None
        self._local = None
