"""Bounds on the native memory a long-running CPU process keeps outside Python's heap.

Owns :func:`bound_native_caches`, which a serving process (``pipeline serve``, the CLI's chat and
run, an engine's child process) calls once at start, before any model loads; it lives in the
library, above no backend, because those callers and a backend's loader
(:mod:`backends.gguf.backend` hands a load's scratch back) all use it.
Two caches grow with the variety of traffic rather than its volume (``benchmarks/
serve_memory.py``; ``docs/performance.md``):

1. oneDNN's primitive caches: a compiled kernel (with its buffers) per distinct matrix shape,
   1,024 entries by default in each of oneDNN's own cache (bfloat16 and float16 products
   through ``F.linear``) and ideep's (the packed float32 products of
   :mod:`backends.torch.packed`), and a serving engine's row count (decode tokens plus
   prefill chunk lengths) takes hundreds of values. Both are capped to ``primitive_cache``
   entries: the shapes a decode batch repeats stay in them, and a prefill shape that fell out
   is created again. (Padding the rows to a few buckets instead kept the caches warm but
   made prefill slower by up to a fifth: ``docs/performance.md``.) Each
   library reads its cap from the environment when it makes its first primitive
   (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``), so they are set there
   (a value the operator set is kept).
2. glibc malloc's dynamic mmap threshold: after a large block is freed the threshold rises
   to its size, so later blocks of every size up to it come from the arenas, whose free
   pages a fragmented heap seldom returns. A fixed threshold (``mmap_threshold`` bytes)
   keeps large tensors in their own mappings, returned to the system when freed.

A third cache has no capacity to set: torch's fused CPU attention (bfloat16, float16) keeps a
compiled micro-kernel with its buffers for every block shape it meets, for good. Capacities
cannot bound what the model does not repeat, so the model bounds the shapes instead, in
every mode: its matrix products run on a fixed set of row counts
(:func:`~backends.torch.packed.bounded_rows`, or the batch-invariant tiles) and its prompt
attention on padded lengths (:func:`~backends.torch.model.attend`), so both kinds of cache
hold the same few entries however varied the traffic.

Elsewhere than glibc the second is skipped; both are process-wide, which is why the server
(a process of its own) applies them and :func:`~pipeline.builder.build` does not.

:func:`release_free_memory` hands the pages malloc holds free back to the system
(``malloc_trim``); the server calls it when its engines fall idle after work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import attrs

log = logging.getLogger("pipeline.memory")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
M_TRIM_THRESHOLD = -1


@attrs.frozen
class NativeBounds:
    """What :func:`bound_native_caches` set: oneDNN's primitive cache's capacity (as it will
    read it; ideep's is set alike) and the malloc thresholds (None where glibc's ``mallopt`` is not available)."""

    primitive_cache: int | None
    mmap_threshold: int | None


def bound_native_caches(primitive_cache: int = 128,
                        mmap_threshold: int = 256 * 1024) -> NativeBounds:
    """Cap oneDNN's and ideep's primitive caches (unless their variables are set) and
    fix glibc's mmap and trim thresholds at ``mmap_threshold`` bytes. Call before any model
    loads; idempotent."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(primitive_cache))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(primitive_cache))  # ideep's
    try:
        capacity: int | None = int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"])
    except ValueError:
        capacity = None
    return NativeBounds(capacity, _mallopt(mmap_threshold))


def release_free_memory() -> bool:
    """Return the free pages of malloc's heaps to the system (glibc's ``malloc_trim``); a few
    milliseconds, so for idle moments. False where that is not available."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _mallopt(threshold: int) -> int | None:
    """Fix glibc's mmap and trim thresholds; None where that is not glibc."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, threshold) and mallopt(M_TRIM_THRESHOLD, threshold)):
        log.warning("mallopt refused a threshold of %d bytes; malloc keeps its own", threshold)
        return None
    return threshold
