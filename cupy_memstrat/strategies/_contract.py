"""The strategy contract's names: the hooks a :class:`~cupy_memstrat.Strategy`
subclass provides (docs/strategies.md, "Writing your own strategy"), the names
mistaken for them, and :class:`ProvidedHooks`, the built-in strategies' way of
providing theirs."""

from __future__ import annotations

HOOKS = ("allocate", "deallocate")
# names that look like hooks and are not: a class that defines one but no hook of that name of its own is refused
NOT_HOOKS = {"_allocate": "allocate", "_deallocate": "deallocate"}


class ProvidedHooks:
    """For a built-in strategy whose hooks are functions it makes (device:
    ``cudaMalloc``/``cudaFree``; pool; the adapters): :meth:`_provide_hooks`
    binds them on the instance, so that the hot path calls them with no Python
    frame of ours, unless a subclass overrides a hook; that subclass can call
    ``super().allocate(size)`` / ``super().deallocate(ptr)``."""

    def allocate(self, size: int) -> int:
        """The built-in hook (:meth:`Strategy.allocate`)."""
        return self._own_hooks[0](size)

    def deallocate(self, ptr: int) -> None:
        """The built-in hook (:meth:`Strategy.deallocate`)."""
        return self._own_hooks[1](ptr)

    def _provide_hooks(self, allocate, deallocate) -> None:
        self._own_hooks = (allocate, deallocate)
        mro = type(self).__mro__
        below = mro[:mro.index(ProvidedHooks)]  # the classes that can override this one's hooks
        for name, fn in zip(HOOKS, (allocate, deallocate)):
            if not any(name in vars(k) for k in below):
                setattr(self, name, fn)
            else:
                vars(self).pop(name, None)
