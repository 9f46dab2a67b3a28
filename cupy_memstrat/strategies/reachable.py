"""The strategies kept reachable while they have handed out memory.

CuPy frees through a strategy from finalisers, so a strategy that has allocated
stays referenced here until it is closed: the garbage collector must never
clear it while arrays that are garbage in the same cycle still have to be freed
(a test's traceback cycle can hold both). The set also answers two questions
that need every such strategy: which one owns a pointer
(:func:`cupy_memstrat.record_stream`), and which ones to trim before an
allocation that ran out of memory is retried.
"""

from __future__ import annotations

import threading

__all__ = ["Reachable", "REACHABLE"]


class Reachable:
    """A set of strategies under a re-entrant lock (a finaliser can let one go while another is added)."""

    def __init__(self):
        self._members: set = set()
        self._lock = threading.RLock()

    def add(self, strategy) -> None:
        with self._lock:
            self._members.add(strategy)

    def discard(self, strategy) -> None:
        with self._lock:
            self._members.discard(strategy)

    def __contains__(self, strategy) -> bool:
        return strategy in self._members

    def members(self) -> list:
        """A copy: the strategies reachable now."""
        with self._lock:
            return list(self._members)

    def owner_of_pointer(self, ptr: int, device: int):
        """The strategy whose live table holds ``ptr`` on ``device``, or None; a checking layer
        is preferred to the strategy it wraps (both hold it: the layer is the program's view)."""
        found = None
        for s in self.members():
            if s.accounts.is_live(ptr, device):
                if getattr(s, "inner", None) is not None:
                    return s
                found = s
        return found


#: the process's reachable strategies
REACHABLE = Reachable()
