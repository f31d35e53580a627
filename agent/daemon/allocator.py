"""Give large buffers back to the system when they are freed.

The daemon reads pages of up to 8 MiB from inference servers, and command output, on threads that
come and go. glibc's malloc raises its mmap threshold each time such a buffer is freed (up to
32 MiB), after which buffers that size come from the heap arenas (one per thread, up to eight per
core) and their memory stays with the process: under a server that keeps answering large or
hostile pages, resident memory climbed from 65 to 200 MB in 45 s without a Python object leaking.
A fixed threshold (which also turns off glibc's adjustment of it) keeps every buffer of 256 KiB
or more in its own mapping, returned whole on free; two arenas bound what small allocations on
many threads may hold. Python's small objects are not affected (pymalloc has its own arenas).
"""

from __future__ import annotations

import ctypes

from agent.logs import get_logger

log = get_logger()

_M_MMAP_THRESHOLD = -3  # glibc malloc.h
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 256 * 1024
ARENA_MAX = 2


def return_large_buffers() -> bool:
    """Tune glibc's malloc as above; False where the C library is not glibc (nothing changes)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        log.debug("malloc tuning skipped: not glibc")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_ARENA_MAX, ARENA_MAX))
