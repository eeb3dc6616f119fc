"""Process memory: forked children that leave the parent's tensors behind, and free
memory handed back to the kernel.

hivemind starts each averager as a forked process of the trainer (`mp.Process`). A fork
shares the parent's pages copy-on-write, and every page the parent then writes (weights,
gradients, Adam's moments: all of them, at every step) becomes two: the child keeps the
old copy as its own. An averager needs none of them (it averages copies in shared memory,
and asks the parent for the state it serves), yet each held a stale copy of the trainer's
tensors: 1.3 and 2.1 GB of PSS on SmolLM2-135M, a quarter of `agentjet local` (bench/LOG.md).

`left_behind()` marks the storage of the parent's large private CPU tensors MADV_DONTFORK
while it forks: those pages are not mapped in the child at all, so it cannot hold them,
and a child that touched one would fault at once instead of reading stale values. The
marks are lifted when the fork is done, so later forks see the memory as usual. Only the
page-aligned interior of each storage is marked: the allocator's bookkeeping around it
stays mapped. Tensors in shared memory (what an averager works on) are left alone. The
heap's free pages are handed back (`trim`) before the fork too: inherited, they became the
child's own as the parent allocated there (each averager 450-610 MB of PSS after three
minutes of `agentjet local`, 210-220 MB with the trim; bench/LOG.md).

`shared_zeros()` and `untouched_zeros()` make buffers whose pages exist only once written:
in shared memory, those a parameter round copies the parameters into before it runs and
a gradient round's averaged gradients; private, the gradient accumulators (node/averagers.py
`ExactGradientAverager`). A trainer without peers has no rounds, and one whose every
step is a whole epoch accumulates nothing: hivemind's own buffers cost the parameters'
size each from the start.

`trim()` hands free heap pages back (glibc's malloc_trim). glibc serves allocations below
its mmap threshold, which rises to 32 MB as large blocks are freed, from its arenas, and
keeps what a step freed there: a trainer's PSS grew by ~4 GB of free heap over a few
minutes (bench/LOG.md). A lower fixed threshold (MALLOC_MMAP_THRESHOLD_) kept it down too
but made every step 30-40% slower (half the CPU time in page faults); a trim after each
step costs one walk over the arenas.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

MADV_DONTFORK = 10  # linux/mman.h
MADV_DOFORK = 11
# Smaller storages are not worth a madvise each (and are mostly inside malloc's arenas).
MIN_BYTES = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc only


def private_ranges(min_bytes: int = MIN_BYTES) -> list[tuple[int, int]]:
    """(address, length) of the whole pages inside each CPU tensor storage of this process
    of at least `min_bytes` that is not in shared memory, each storage once."""
    page = mmap.PAGESIZE
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # (type: isinstance reads __class__)
            continue
        try:
            if obj.device.type != "cpu" or obj.is_sparse or obj.is_shared():
                continue
            storage = obj.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # meta, wrapped or exotic tensors
            continue
        if nbytes >= min_bytes and address:
            seen[address] = max(seen.get(address, 0), nbytes)
    ranges = []
    for address, nbytes in seen.items():
        start = -(-address // page) * page
        end = (address + nbytes) // page * page
        if end > start:
            ranges.append((start, end - start))
    return ranges


def _advise(ranges: list[tuple[int, int]], advice: int) -> None:
    for address, length in ranges:
        if _libc.madvise(address, length, advice) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"madvise({advice}) of {length} bytes: {os.strerror(errno)}")


@contextmanager
def left_behind(ranges: list[tuple[int, int]] | None = None) -> Iterator[None]:
    """Processes forked inside the block do not inherit `ranges` (default: `private_ranges()`)."""
    ranges = private_ranges() if ranges is None else ranges
    _advise(ranges, MADV_DONTFORK)
    # Free heap pages handed back first: else the child inherits them, and as the parent
    # allocates there it keeps their old contents as its own.
    trim()
    try:
        yield
    finally:
        _advise(ranges, MADV_DOFORK)


def shared_zeros(like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor shaped like `like`, of its dtype, zeros, in shared memory whose pages do
    not exist until written (`share_memory_()` on a copy writes every page first)."""
    nbytes = like.numel() * like.element_size()
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(nbytes)  # reads as zeros
    return torch.empty(0, dtype=like.dtype).set_(storage).view(like.shape)


def untouched_zeros(likes: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """CPU tensors shaped like each of `likes`, of their dtypes, zeros, views of one private
    anonymous mapping whose pages do not exist until written (and no file descriptor each,
    as shared memory takes)."""
    align = 64
    offsets, total = [], 0
    for like in likes:
        offsets.append(total)
        total += -(-like.numel() * like.element_size() // align) * align
    if total == 0:
        return tuple(torch.zeros_like(like, device="cpu") for like in likes)
    whole = torch.frombuffer(mmap.mmap(-1, total), dtype=torch.uint8)  # reads as zeros
    return tuple(
        whole[at : at + like.numel() * like.element_size()].view(like.dtype).view(like.shape)
        for at, like in zip(offsets, likes, strict=True)
    )


def trim() -> None:
    """Return the heap's free pages to the kernel (a no-op without glibc)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
