"""The fake's stream-ordered pools (``cudaMemPool_t``; docs/async.md)
(:class:`cupy_memstrat.backends.PoolBackend`)."""

from __future__ import annotations

import operator

from .. import codes as _codes
from .core import _ALIGN, _UINT64_MAX, _round_up

_POOL_GRANULE = 32 << 20  # a pool reserves device memory in 32 MiB steps (docs/claims.md)


class _FakePool:
    def __init__(self, handle: int, device: int, max_size: int, is_default: bool):
        self.handle, self.device, self.is_default = handle, device, is_default
        self.max_size = _round_up(max_size, _POOL_GRANULE) if max_size else 0
        self.release_threshold = 0  # CUDA's default for every pool
        self.reserved = self.used = self.idle = 0
        self.reserved_high = self.used_high = 0
        self.free: list[list] = []  # [ptr, size, tag]; tag None once a sync ordered the free
        self.live: dict[int, int] = {}  # ptr -> rounded size
        self.access: set[int] = set()  # peer devices granted access (cudaMemPoolSetAccess)
        self.destroyed = False


_POOL_ATTRS = {
    _codes.POOL_ATTR_RELEASE_THRESHOLD: "release_threshold",
    _codes.POOL_ATTR_RESERVED_MEM_CURRENT: "reserved",
    _codes.POOL_ATTR_RESERVED_MEM_HIGH: "reserved_high",
    _codes.POOL_ATTR_USED_MEM_CURRENT: "used",
    _codes.POOL_ATTR_USED_MEM_HIGH: "used_high",
}


class _PoolMixin:
    """Pools: each device's default and current pool, blocks reused per
    stream until a synchronisation orders their frees, release thresholds."""

    def _init_pools(self, devices: int) -> None:
        self._pools: dict[int, _FakePool] = {}
        self._default_pool = [self._new_pool(d, 0, is_default=True).handle for d in range(devices)]
        self._current_pool = list(self._default_pool)

    def _free_pool_block(self, ptr: int, rounded: int) -> bool:
        # cudaFree of a pool block (under the lock): synchronous, back to its pool
        for p in self._pools.values():
            if p.live.pop(ptr, None) is not None:
                p.used -= rounded
                p.free.append([ptr, rounded, None])
                p.idle += rounded
                return True
        return False

    def _synchronized(self, device: int, key) -> None:
        # A sync ordered the frees queued on stream `key` (None: every stream)
        # of `device`: any stream may reuse those blocks now, and the pools
        # give idle memory back down to their release thresholds.
        for pool in self._pools.values():
            if pool.device == device:
                for block in pool.free:
                    if key is None or block[2] == key:
                        block[2] = None
                self._apply_threshold(pool)

    # -- stream-ordered pools -----------------------------------------------
    def _new_pool(self, device: int, max_size: int, is_default: bool = False) -> _FakePool:
        self._next_handle += 0x100
        pool = _FakePool(self._next_handle, device, max_size, is_default)
        self._pools[pool.handle] = pool
        return pool

    def _pool(self, handle: int) -> _FakePool:
        pool = self._pools.get(handle)
        if pool is None or pool.destroyed:
            self._fail(_codes.ERROR_INVALID_VALUE)
        return pool

    def pool_create(self, device: int, max_size: int = 0) -> int:
        if not 0 <= device < len(self._capacity):
            self._fail(_codes.ERROR_INVALID_DEVICE)
        if max_size < 0:
            self._fail(_codes.ERROR_INVALID_VALUE)
        self._contexts.add(device)
        with self._lock:
            return self._new_pool(device, max_size).handle

    def pool_destroy(self, pool: int) -> None:
        with self._lock:
            p = self._pool(pool)
            if p.is_default:
                self._fail(_codes.ERROR_INVALID_VALUE)
            p.destroyed = True
            if not p.live:  # else CUDA releases it once the last block is freed
                self._release_pool(p)

    def _release_pool(self, p: _FakePool) -> None:
        self._used[p.device] -= p.reserved
        p.reserved = p.idle = 0
        p.free.clear()

    def device_can_access_peer(self, device: int, peer: int) -> bool:
        return device != peer and 0 <= peer < len(self._capacity)

    def pool_set_access(self, pool: int, devices) -> None:
        p = self._pool(pool)
        for d in devices:
            if d == p.device or not 0 <= d < len(self._capacity):
                self._fail(_codes.ERROR_INVALID_DEVICE)
        p.access.update(devices)

    def pool_access(self, pool: int) -> set:
        """Devices other than its own that may use the pool's memory (for tests)."""
        return set(self._pool(pool).access)

    def device_default_pool(self, device: int) -> int:
        return self._default_pool[device]

    def device_current_pool(self, device: int) -> int:
        return self._current_pool[device]

    def device_set_pool(self, device: int, pool: int) -> None:
        """``cudaDeviceSetMemPool`` (what CuPy's ``MemoryAsyncPool()`` does to every device)."""
        self._pool(pool)
        self._current_pool[device] = pool

    def malloc_from_pool_async(self, size: int, pool: int, stream: int) -> int:
        size = operator.index(size)  # a size_t, as CUDA's wrappers take it: a float is a TypeError
        if size < 0:
            self._fail(_codes.ERROR_INVALID_VALUE)
        with self._lock:
            p = self._pool(pool)
            key = self._stream_key(stream)
            if size == 0:
                return 0
            self.n_malloc_calls += 1
            rounded = _round_up(size, _ALIGN)
            ptr = self._reuse(p, rounded, key)
            if ptr is None:
                self._take_idle(p, rounded, key)
                if not self._make_room(p, rounded):
                    self._fail(_codes.ERROR_MEMORY_ALLOCATION)
                ptr = self._next[p.device]
                self._next[p.device] += rounded
            p.used += rounded
            p.used_high = max(p.used_high, p.used)
            p.live[ptr] = rounded
            self._live[ptr] = (rounded, p.device)
            return ptr

    @staticmethod
    def _reuse(p: _FakePool, rounded: int, key):
        for i, (ptr, size, tag) in enumerate(p.free):
            if size == rounded and tag in (None, key):
                del p.free[i]
                p.idle -= size
                return ptr
        return None

    @staticmethod
    def _take_idle(p: _FakePool, rounded: int, key) -> None:
        # No idle block of the size: the pool serves the request from idle memory this stream
        # may use (blocks whose free a sync ordered, or freed on this stream), splitting a
        # larger block or joining smaller ones, before it grows. Measured: eight 16 MiB blocks
        # freed, then four 32 MiB requests, keep 128 MiB reserved; 32 MiB blocks serve 16 MiB
        # requests likewise. The memory taken becomes reserved memory outside any block.
        usable = sorted((b for b in p.free if b[2] in (None, key)), key=lambda b: b[1])
        if not usable:
            return
        fit = next((b for b in usable if b[1] >= rounded), None)
        if fit is not None:  # split the smallest block that holds the request
            fit[1] -= rounded
            p.idle -= rounded
            if fit[1] == 0:
                p.free.remove(fit)
            else:
                fit[0] += rounded
            return
        need = rounded
        for b in reversed(usable):  # join the largest blocks first
            if need <= 0:
                break
            p.free.remove(b)
            p.idle -= b[1]
            need -= b[1]

    def _make_room(self, p: _FakePool, rounded: int) -> bool:
        for attempt in range(2):
            slack = p.reserved - p.used - p.idle
            if slack >= rounded:
                return True
            grow = _round_up(rounded - slack, _POOL_GRANULE)
            fits_pool = not p.max_size or p.reserved + grow <= p.max_size
            if fits_pool and self._used[p.device] + grow <= self._capacity[p.device]:
                p.reserved += grow
                p.reserved_high = max(p.reserved_high, p.reserved)
                self._used[p.device] += grow
                return True
            # A CUDA pool serves a request it cannot grow for from its idle
            # blocks of any size (2 GiB idle + 0.5 GiB new make a 2.5 GiB
            # block), also blocks freed on other streams (docs/async.md).
            p.free.clear()
            p.idle = 0
        return False

    def _shrink(self, p: _FakePool, floor: int) -> None:
        # Release idle memory (blocks whose free a sync has ordered) until
        # reserved <= max(floor, what is in use or still pending), in 32 MiB steps.
        pending = sum(b[1] for b in p.free if b[2] is not None)
        target = max(_round_up(p.used + pending, _POOL_GRANULE), _round_up(min(floor, p.reserved), _POOL_GRANULE))
        if target >= p.reserved:
            return
        if target < p.used + p.idle:
            p.free[:] = [b for b in p.free if b[2] is not None]
            p.idle = pending
        self._used[p.device] -= p.reserved - target
        p.reserved = target

    def _apply_threshold(self, p: _FakePool) -> None:
        if p.reserved > p.release_threshold:
            self._shrink(p, p.release_threshold)

    def free_async(self, ptr: int, stream: int) -> None:
        if ptr == 0:
            return
        with self._lock:
            key = self._stream_key(stream)
            self.n_free_calls += 1
            for p in self._pools.values():
                size = p.live.pop(ptr, None)
                if size is not None:
                    break
            else:
                self._fail(_codes.ERROR_INVALID_VALUE)
            del self._live[ptr]
            p.used -= size
            p.free.append([ptr, size, key])
            p.idle += size
            if p.destroyed and not p.live:
                self._release_pool(p)

    def pool_trim_to(self, pool: int, keep_bytes: int) -> None:
        with self._lock:
            self._shrink(self._pool(pool), keep_bytes)

    def pool_get_attribute(self, pool: int, attr: int) -> int:
        p = self._pool(pool)
        try:
            name = _POOL_ATTRS[attr]
        except KeyError:
            self._fail(_codes.ERROR_INVALID_VALUE)
        return getattr(p, name)

    def pool_set_attribute(self, pool: int, attr: int, value: int) -> None:
        p = self._pool(pool)
        if not 0 <= value <= _UINT64_MAX:
            self._fail(_codes.ERROR_INVALID_VALUE)
        if attr == _codes.POOL_ATTR_RELEASE_THRESHOLD:
            p.release_threshold = value
        elif attr in (_codes.POOL_ATTR_RESERVED_MEM_HIGH, _codes.POOL_ATTR_USED_MEM_HIGH) and value == 0:
            if attr == _codes.POOL_ATTR_RESERVED_MEM_HIGH:
                p.reserved_high = p.reserved
            else:
                p.used_high = p.used
        else:
            self._fail(_codes.ERROR_INVALID_VALUE)
