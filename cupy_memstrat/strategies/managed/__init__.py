"""The ``managed`` strategy: ``cudaMallocManaged`` memory in 2 MiB chunks, in three parts.

* :mod:`.strategy`: :class:`ManagedStrategy` (its options, the advice and
  prefetch policies, the hot path, the statistics and trim);
* :mod:`.slab`: the size classes, chunks and per-stream arenas, with no CUDA;
* :mod:`.guard`: the oversubscription guard.
"""

from .slab import CHUNK_BYTES, SIZE_CLASSES, SMALL_MAX
from .strategy import ManagedStats, ManagedStrategy

__all__ = ["CHUNK_BYTES", "SIZE_CLASSES", "SMALL_MAX", "ManagedStats", "ManagedStrategy"]
