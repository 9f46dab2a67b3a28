"""The strategy contract: the hooks a :class:`~cupy_memstrat.Strategy`
subclass provides (docs/strategies.md, "Writing your own strategy")."""

from __future__ import annotations

import operator

HOOKS = ("allocate", "deallocate")
# names that look like hooks and are not: a class that defines one but no hook of that name of its own is refused
_NOT_HOOKS = {"_allocate": "allocate", "_deallocate": "deallocate"}


class _ContractMixin:
    """Mixed into Strategy; its public names are documented as Strategy's."""

    #: True for a strategy that builds a hot path of its own (managed, async): it has no hooks
    own_hot_path = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        hooks = [n for n in (*HOOKS, *_NOT_HOOKS) if n in vars(cls)]
        if hooks and super(cls, cls).own_hot_path:  # (the value cls inherits)
            raise TypeError(f"{cls.__name__}: {', '.join(hooks)} would never be called: {cls.__mro__[1].__name__} "
                            "builds a hot path of its own; subclass cupy_memstrat.Strategy (or DeviceStrategy) to "
                            "provide hooks (docs/strategies.md)")
        for wrong, hook in _NOT_HOOKS.items():  # refused at the class statement, not ignored at every call
            if wrong in vars(cls) and _is_builtin_hook(cls, hook):
                raise TypeError(f"{cls.__name__}.{wrong} is not a hook: name it {hook} (docs/strategies.md, "
                                "'Writing your own strategy')")

    def allocate(self, size: int) -> int:
        """The subclass's hook: obtain ``size`` bytes (> 0) on the current
        device and return the pointer (an int).

        Called by the hot path only, after the size was checked; the base
        class counts it. Raise the backend's ``Error`` (CUDA's
        ``cudaErrorMemoryAllocation`` for out of memory): the base class
        then recovers in CuPy's order (gives cached memory back, collects,
        retries) or raises :class:`~cupy_memstrat.OutOfMemoryError`.
        ``managed`` and ``async`` build hot paths of their own and have no
        hook to override.
        """
        if self.own_hot_path:
            raise NotImplementedError(f"{type(self).__name__} builds a hot path of its own and has no allocate "
                                      "hook: allocate with raw_malloc(size)")
        raise NotImplementedError(f"{type(self).__name__} defines no allocate(size) -> ptr")

    def deallocate(self, ptr: int) -> None:
        """The subclass's hook: give back a pointer :meth:`allocate` returned.
        Called once per pointer, after the accounting; an exception is
        turned into a ``RuntimeWarning`` (CuPy frees from finalisers)."""
        if self.own_hot_path:
            raise NotImplementedError(f"{type(self).__name__} builds a hot path of its own and has no deallocate "
                                      "hook: free with raw_free(ptr)")
        raise NotImplementedError(f"{type(self).__name__} defines no deallocate(ptr)")

    def record_reserved(self, device: int, delta: int) -> None:
        """For caching strategies: ``delta`` bytes (an int) were taken from
        (> 0) or given back to (< 0) CUDA on ``device`` (``bytes_reserved``
        and its peak). Off the hot path (pool growth and trims): it takes a lock.

        Raises:
            TypeError: ``device`` or ``delta`` is not an int (bool included).
            ValueError: ``device`` is not a device of this strategy's backend.
        """
        for what, v in (("device", device), ("delta", delta)):
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise TypeError(f"record_reserved: {what}: expected an int, got {type(v).__name__} {v!r}")
        device, delta = operator.index(device), operator.index(delta)
        n = self.accounts.n_devices
        if not 0 <= device < n:
            raise ValueError(f"record_reserved: device: expected 0 <= device < {n}, got {device}")
        self.accounts.add_reserved(device, delta)

    def _hooks(self):
        """``(allocate, deallocate)`` as the hot path calls them: for each, the
        most derived definition, the instance's own first."""
        return tuple(getattr(self, n) for n in HOOKS)


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


def _is_builtin_hook(cls, hook: str) -> bool:
    """Whether ``cls``'s hook ``hook`` is the contract's default or :class:`ProvidedHooks`'s,
    not one written in a subclass."""
    return any(getattr(cls, hook) is vars(k)[hook] for k in (_ContractMixin, ProvidedHooks))
