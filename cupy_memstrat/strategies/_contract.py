"""The strategy contract: the hooks a :class:`~cupy_memstrat.Strategy`
subclass provides (docs/strategies.md, "Writing your own strategy"), and their
names of before this release, kept one release with a ``DeprecationWarning``."""

from __future__ import annotations

import operator
import warnings

from .._userwarn import warn_at_user

_OLD = {"allocate": "_allocate", "deallocate": "_deallocate"}
_warned: set = set()  # (class, old hook name) already warned about


def _say_deprecated(cls, old: str, new: str, at_user: bool) -> None:
    if (cls, old) in _warned:
        return
    _warned.add((cls, old))
    msg = (f"{cls.__name__}.{old} is deprecated: name the hook {new} (the strategy contract, docs/strategies.md); "
           "the old name goes in the next release")
    if at_user:
        warn_at_user(msg, DeprecationWarning)
    else:
        warnings.warn(msg, DeprecationWarning, stacklevel=3)  # the class statement


class _ContractMixin:
    """Mixed into Strategy; its public names are documented as Strategy's."""

    #: True for a strategy that builds a hot path of its own (managed, async): it has no hooks
    own_hot_path = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        hooks = [n for n in (*_OLD, *_OLD.values()) if n in vars(cls)]
        if hooks and super(cls, cls).own_hot_path:  # (the value cls inherits)
            raise TypeError(f"{cls.__name__}: {', '.join(hooks)} would never be called: {cls.__mro__[1].__name__} "
                            "builds a hot path of its own; subclass cupy_memstrat.Strategy (or DeviceStrategy) to "
                            "provide hooks (docs/strategies.md)")
        for new, old in _OLD.items():  # said at the class statement, where the user can see it
            if old in vars(cls) and new not in vars(cls):
                _say_deprecated(cls, old, new, at_user=False)

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
        if not 0 <= device < len(self._counters):
            raise ValueError(f"record_reserved: device: expected 0 <= device < {len(self._counters)}, got {device}")
        with self._fold_lock:
            c = self._counters[device]
            c.reserved += delta
            if c.reserved > c.peak_reserved:
                c.peak_reserved = c.reserved

    # the contract's names of before this release, kept one release
    def _allocate(self, size: int) -> int:
        """Deprecated: name the hook :meth:`allocate`."""
        return self.allocate(size)

    def _deallocate(self, ptr: int) -> None:
        """Deprecated: name the hook :meth:`deallocate`."""
        return self.deallocate(ptr)

    def _record_reserved(self, device: int, delta: int) -> None:
        """Deprecated: call :meth:`record_reserved`."""
        _say_deprecated(type(self), "_record_reserved", "record_reserved", at_user=True)
        self.record_reserved(device, delta)

    def _hooks(self):
        """``(allocate, deallocate)`` as the hot path calls them: for each, the
        most derived definition wins, the instance's own first, then the classes
        in method resolution order; a class with both names uses the new one;
        an old name (``_allocate`` / ``_deallocate``) still works, with a
        ``DeprecationWarning``."""
        hooks = []
        for new, old in _OLD.items():
            found = None
            for owner, where in ((type(self), vars(self)), *((k, vars(k)) for k in type(self).__mro__)):
                if new in where and owner is not _ContractMixin:
                    found = getattr(self, new) if where is not vars(self) else where[new]
                    break
                if old in where and owner is not _ContractMixin:
                    _say_deprecated(owner, old, new, at_user=True)  # (said once per class)
                    found = getattr(self, old) if where is not vars(self) else where[old]
                    break
            hooks.append(found if found is not None else getattr(self, new))
        return tuple(hooks)


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
        for (new, old), fn in zip(_OLD.items(), (allocate, deallocate)):
            if not any(new in vars(k) or old in vars(k) for k in below):
                setattr(self, new, fn)
            else:
                vars(self).pop(new, None)
