"""The ``expandable`` strategy: a reserved range of virtual addresses per device, memory mapped
into it in pages, in two parts.

* :mod:`.strategy`: :class:`ExpandableStrategy` (its options, the CUDA calls through the
  backend's :class:`~cupy_memstrat.backends.VmmBackend`, the statistics and trim);
* :mod:`.space`: the free ranges of addresses, their streams, and which pages are mapped, with
  no CUDA.
"""

from .strategy import ExpandableStrategy

__all__ = ["ExpandableStrategy"]
