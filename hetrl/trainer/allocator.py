"""The CPU allocator setting of training processes: freed memory stays in the process for the next step.

Why by hand: glibc's malloc serves every request above its mmap threshold (32 MB at most) with a fresh mmap and
unmaps it on free, so each step's large tensors (the [rows, vocab] logits and their gradient, the tied
embedding's [vocab, hidden] gradient) fault in freshly zeroed pages again, on every step. jemalloc and tcmalloc
keep such memory, but only through LD_PRELOAD, which a running Python process cannot apply to itself; glibc's
`mallopt` can, at run time: no mmap'd chunks (everything from the heap) and a 1 GiB trim threshold, so a freed
block is reused by the next allocation of its size. Measured on the `long` case's update pass (SmolLM2-135M,
a 505-token prompt and 8 responses, forward + backward, 2 threads, 6 passes in each of 3 alternating
processes; benchmarks/results/allocator.md): median 6.21 s against 7.30 s with glibc's defaults (1.18x), and
steadier; peak RSS +331 MB (2.97 -> 3.30 GB).

`HETRL_MALLOC=system` keeps glibc's defaults. Elsewhere than Linux with glibc this does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
KEEP = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30))
# glibc's own steady state after a process has freed a large mmap'd chunk (the dynamic threshold at its 32 MB cap,
# trim at twice it): what the process returns to when a run ends, so code run after it in the same process (a
# comparison run of another system) allocates as it would have without hetrl
SYSTEM = ((M_MMAP_MAX, 65536), (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20))


def _libc():
    if not sys.platform.startswith("linux") or os.environ.get("HETRL_MALLOC", "").lower() == "system":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version   # glibc, not musl
        return libc
    except (OSError, AttributeError):
        return None


def _apply(libc, settings) -> bool:
    return all(libc.mallopt(k, v) == 1 for k, v in settings)


def keep_freed_memory() -> bool:
    """Switch this process to keeping freed memory (for a process that only trains: a Ray actor). -> applied."""
    libc = _libc()
    return libc is not None and _apply(libc, KEEP)


@contextlib.contextmanager
def freed_memory_kept(enabled: bool = True):
    """Keep freed memory while the block runs, then go back to glibc's steady state."""
    libc = _libc() if enabled else None
    if libc is None:
        yield False
        return
    applied = _apply(libc, KEEP)
    if not applied:
        log.info("mallopt refused the allocator setting; glibc's defaults stay")
    try:
        yield applied
    finally:
        _apply(libc, SYSTEM)
