"""The checking layer: :class:`CheckedStrategy` wraps any strategy (see the
package docstring for what each check does).

The layer is itself a :class:`~cupy_memstrat.Strategy`: CuPy calls its hot
path, which asks the wrapped strategy's hot path for a (padded) block, and
keeps the program's view in the common accounting: ``bytes_in_use`` counts
the bytes the program asked for; red zones and quarantined blocks show in
``bytes_reserved`` (the wrapped strategy's reserve).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref

from ..stats import origin_capture
from ..strategies._support import FOLD_AT  # the accounting rule (strategies/_support.py)
from ..strategies.base import Strategy
from .findings import CheckError, Finding, live_layers, quiet_warn, record, register_layer, warn_finding
from .options import CHECKS, OPTIONS, refuse_options_of_checks_off
from .quarantine import CANARY_BYTE, Quarantine
from .stream_order import StreamOrder, StreamRecord, _expected

__all__ = ["CheckedStrategy", "checked"]


class CheckedStrategy(Strategy):
    """A strategy wrapped in the checking layer (``use(name, check=...)``).

    Args:
        inner: the strategy to check (any :class:`~cupy_memstrat.Strategy`,
            built-in or third-party, not already checked).
        check: ``"streams"``, ``"poison"``, ``"redzone"``, any combination
            (``"streams,poison"``; ``+`` also separates, for spec strings),
            or ``"all"``.
        on_finding: ``"raise"`` (default), ``"warn"`` or ``"record"``.
        quarantine_bytes: bytes of freed blocks held poisoned before they go
            back to ``inner`` (default 256 MiB; size strings accepted).
        quarantine_count: blocks held at most (default 4096); the oldest
            leaves first when either limit is passed. 0 and 0: each block is
            verified and given back at once.
        redzone_bytes: guard bytes after each allocation, rounded up to 256
            (default 256); the canary starts right after the requested size,
            so the guard covers the rounding too.
        track_origins: always on here (findings name the allocation site).
        owns_inner: close ``inner`` with this layer (what :func:`cupy_memstrat.create`
            does for a strategy it made from a name); a strategy passed in
            is left open.

    Raises:
        TypeError: ``inner`` is not a Strategy, or is already checked.
        ValueError: no check named, an unknown check, or a bad option value
            (the message names the option and the value).

    The layer holds two parts: :attr:`stream_order` (the streams seen, the
    ``streams`` check) and :attr:`quarantine` (the blocks held poisoned, the
    verification kernels).

    Costs (docs/checks.md has the measurements): ``streams`` a stack walk and a few
    dict updates per allocation and free; ``poison`` a memset per free and a
    kernel when a block leaves quarantine; ``redzone`` a memset per
    allocation and a kernel per free.
    """

    name = "checked"
    description = "the checking layer (streams, poison, redzone) over another strategy"
    has_c_hot_path = False
    reserved_is_in_use = False
    options = OPTIONS  # declared in cupy_memstrat.checks.options

    def __init__(self, inner: Strategy, *, owns_inner: bool = False, **options):
        if "backend" in options:
            raise TypeError("backend: the checks use the wrapped strategy's backend; pass backend= when creating it")
        if not isinstance(inner, Strategy):
            raise TypeError(f"inner: expected a cupy_memstrat.Strategy to check, got {type(inner).__name__} {inner!r}")
        if isinstance(inner, CheckedStrategy):
            raise TypeError(f"inner: {inner!r} is already checked; wrap the strategy it checks instead")
        super().__init__(backend=inner.backend, **options)
        checks = self.config["check"]
        if not checks:
            raise ValueError("check: expected at least one of streams, poison, redzone (or all), got none")
        self.check_options_apply(checks, options)
        self.inner = inner
        self._owns_inner = owns_inner  # made from a spec for this layer: closed with it (owns_inner)
        self.name = inner.name
        self.checks = checks
        self._track_origins = True
        self._streams = "streams" in checks
        self._poison = "poison" in checks
        self._redzone = self.config["redzone_bytes"] if "redzone" in checks else 0
        self._pad = self._poison or bool(self._redzone)
        self._policy = self.config["on_finding"]
        # What the program sees as the strategy's options: the wrapped strategy's (its own
        # track_origins among them), then the checks', "check" spelled as in a spec (JSON-ready)
        # (and its oom_snapshot, unless one was given to this layer)
        own = {k: v for k, v in self.config.items()
               if k != "track_origins" and (k != "oom_snapshot" or "oom_snapshot" in options)}
        own["check"] = ",".join(c for c in CHECKS if c in checks)
        self.config = {**inner.config, **own}
        self._meta: dict[int, tuple] = {}  # ptr -> (padded, StreamRecord, thread id, seq)
        self._next_seq = itertools.count(1).__next__
        self.stream_order = StreamOrder(self.backend, self._next_seq, self._report)
        self.quarantine = Quarantine(
            self.backend, poison=self._poison, redzone=self._redzone,
            limit_bytes=self.config["quarantine_bytes"], limit_count=self.config["quarantine_count"],
            give_back=self._give_back, stream_order=self.stream_order, synchronize=self._synchronize,
            report=self._report,
        )
        self._to_raise: list[Finding] = []
        self._alarm = False
        self.n_findings = 0  # findings this layer has reported
        register_layer(self)

    @classmethod
    def parse_options(cls, options: dict) -> dict:
        """As :meth:`Strategy.parse_options`; messages name the option
        (``check: unknown check 'x' ...``)."""
        specs = {o.name: o for o in cls.option_specs()}
        unknown = sorted(set(options) - set(specs))
        if unknown:
            raise ValueError(f"unknown check option {unknown[0]!r}; valid options: {', '.join(sorted(specs))}")
        return {n: (o.parse(options[n], n) if n in options else o.default) for n, o in specs.items()}

    @staticmethod
    def check_options_apply(checks, given) -> None:
        """Refuse options given for a check that is off.

        Raises:
            ValueError: e.g. ``redzone_bytes`` without the ``redzone`` check.
        """
        refuse_options_of_checks_off(checks, given)

    @property
    def owns_inner(self) -> bool:
        """Whether closing this layer closes the strategy it checks: True for one made for it
        from a name (``create("async", check=...)``), False for a strategy passed in."""
        return self._owns_inner

    # -- the hot path --------------------------------------------------------------------------
    def _build_hot_path(self):
        inner = self.inner
        inner_malloc, inner_free = inner.hot_path_functions()
        self._inner_free = inner_free
        b = self.backend
        current_stream, memset = b.current_stream, b.memset_async
        events, live, origins, meta = self.accounts.events, self.accounts.live, self.accounts.origins, self._meta
        fold, unknown_free = self.accounts.fold, self._unknown_free
        streams_on, pad, rz, redzone_on = self._streams, self._pad, self._redzone, bool(self._redzone)
        flagged = b.check_kernels().flagged if pad else None
        order = self.stream_order
        get_ident, seen_tables, next_seq, ref = threading.get_ident, order.seen, self._next_seq, weakref.ref
        expected = _expected
        state = self
        check_streams, after_free, legacy, prune = (
            order.check_free, self.quarantine.after_free, order.legacy_finding, order.prune)
        # the wrapped strategy's track_origins=N frames, else the first (findings name the site)
        capture = origin_capture(self.config.get("track_origins") or True)

        def malloc(size, device):
            if state._alarm:
                state._on_alarm()
            if pad and flagged():
                state._on_flag()
            stream = current_stream(device)
            sptr = stream.ptr
            padded = ((size + 255) & ~255) + rz if pad else size
            try:
                ptr = inner_malloc(padded, device)
            except (MemoryError, OverflowError) as exc:  # OverflowError: the padding passed size_t
                ptr = state._out_of_memory(size, padded, device, exc)
            try:
                if redzone_on:
                    memset(ptr + size, CANARY_BYTE, padded - size, sptr)
                tid = get_ident()
                seq = next_seq()
                table = seen_tables.get(tid)
                if table is None:
                    table = seen_tables[tid] = {}
                key = sptr if sptr > 2 else ~(device * 4 + sptr)  # 0-2: each device's own default streams
                ent = table.get(key)
                if ent is None or ent.ref() is not stream:
                    if len(table) > 64:
                        prune(table)
                    ent = table[key] = StreamRecord(seq, ref(stream), sptr, device, seq)
                else:
                    ent.seen = ent.last_alloc = seq
                origin = capture(1)
                if streams_on and sptr < 2 and expected:
                    exp = expected.get(tid)
                    if exp is not None and exp[1] in (-1, device):
                        legacy(origin, device, ptr, size, exp[0], tid)
            except BaseException:
                inner_free(ptr, device)  # nothing is lost: the block goes back before the error
                raise
            ev = events[device]
            ev.append(size)  # the accounting rule (strategies/_support.py)
            origins[ptr] = origin
            meta[ptr] = (padded, ent, tid, seq)
            live[device][ptr] = size
            if len(ev) > FOLD_AT:
                fold(device)
            return ptr

        inner_recorded, own_recorded, watch = inner.deferred.recorded, self.deferred.recorded, self._watch

        def free(ptr, device, stacklevel=1):
            try:
                size = live[device].pop(ptr)
            except (KeyError, IndexError, TypeError):
                device, size = unknown_free(ptr, stacklevel)
                if size is None:
                    return
            events[device].append(-size)  # after the pop (the accounting rule, strategies/_support.py)
            origin = origins.pop(ptr, None)
            padded, ent, tid, seq = meta.pop(ptr)
            # streams marked with record_stream(): the inner strategy holds the
            # block back until their work is done, so they are ordered
            rec = inner_recorded.get(ptr) if inner_recorded else None
            if own_recorded:  # the inner strategy's frees wait for every stream (device)
                rec = own_recorded.pop(ptr, None) or rec
            if streams_on:
                try:
                    check_streams(ptr, size, device, origin, ent, tid, seq, rec)
                except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
                    quiet_warn(f"cupy_memstrat.checks: the stream check of 0x{ptr:x} failed: {exc!r}")
                if order.deferred:  # decided at a later allocation
                    state._alarm = True
            if pad and not rec:
                after_free(ptr, size, padded, device, origin, ent, tid)
            else:
                # a recorded block is not poisoned: a recorded stream may still
                # use it, legitimately, after the free
                inner_free(ptr, device)
            if watch[0] is not None and not live[device]:
                watch[0]()

        self._hot_malloc, self._hot_free, self.hot_path = malloc, free, "python"
        return malloc, free

    def _give_back(self, ptr: int, device: int) -> None:
        """Free a block to the strategy this layer checks (the quarantine's way out)."""
        self._inner_free(ptr, device)

    def _synchronize(self, device: int) -> None:
        """``cudaDeviceSynchronize``, after deciding what the stream checks
        waiting on events can decide (a synchronisation finishes their events)."""
        for layer in live_layers():
            if layer.stream_order.deferred:
                layer.stream_order.poll()
        self.backend.device_synchronize(device)

    def record_stream(self, ptr: int, stream) -> bool:
        """As :meth:`Strategy.record_stream`, on the strategy this layer
        checks (the same pointer): the ``streams`` check then counts
        ``stream`` as ordered before the block's reuse, and the ``poison``
        check does not fill the block (the recorded stream may still use it
        after the free).

        Raises:
            TypeError: ``ptr`` is not an int.
            ValueError: ``ptr`` is not a live allocation of this layer.
        """
        if isinstance(ptr, bool) or not isinstance(ptr, int):
            raise TypeError(f"ptr: expected an int pointer, got {type(ptr).__name__} {ptr!r}")
        d = self.accounts.device_of(ptr)
        if d is None:
            raise ValueError(f"{self.name}: 0x{ptr:x} is not the start of a live allocation of this strategy")
        if not self.inner.record_stream(ptr, stream):
            # the inner strategy's frees wait for every stream: kept for the check only
            self.deferred.record(ptr, stream, d)
        return True

    def drain(self, device: int | None = None) -> None:
        """Verify every quarantined block (of ``device``, or of every device) and give it back to
        the strategy this layer checks; a block that fails verification is reported as a
        finding. What :func:`cupy_memstrat.using` does when a layer over a strategy passed in
        ends while arrays live."""
        self.quarantine.drain(device)

    def _out_of_memory(self, size: int, padded: int, device: int, exc: BaseException) -> int:
        """The wrapped strategy refused ``padded`` bytes: give the quarantine
        back and try once more; else raise ``OutOfMemoryError`` for the
        requested ``size``, counted in this layer's ``n_failed``."""
        if self.quarantine:
            self.quarantine.drain(device)
            try:
                return self.inner.hot_path_functions()[0](padded, device)
            except (MemoryError, OverflowError) as again:
                exc = again
        self.accounts.count_failed(device)
        self.recovery.raise_out_of_memory(
            size, device, reason=getattr(exc, "reason", "cuda"), cause=exc,
            detail=f" ({padded:,} bytes with the checks' padding; {type(exc).__name__}: {exc})",
        )

    # -- findings --------------------------------------------------------------------------------
    def _report(self, finding: Finding) -> None:
        if not finding.strategy:
            finding = dataclasses.replace(finding, strategy=self.name)
        self.n_findings += 1
        record(finding)
        if self._policy == "warn":
            try:
                warn_finding(finding)
            except Exception:  # noqa: BLE001 - warnings as errors: raised at the next allocation instead
                self._to_raise.append(finding)
                self._alarm = True
        elif self._policy == "raise":
            self._to_raise.append(finding)
            self._alarm = True

    def _refresh_alarm(self) -> None:
        self._alarm = bool(self._to_raise or self.stream_order.deferred)

    def _on_alarm(self) -> None:
        if self.stream_order.deferred:
            self.stream_order.poll()
        if self._to_raise:
            found = list(self._to_raise)
            self._to_raise.clear()
            self._refresh_alarm()
            raise CheckError(found)
        self._refresh_alarm()

    def _on_flag(self) -> None:
        for owner, finding in self.quarantine.verifier().collect():
            owner.report(finding)
        if self._to_raise:
            self._on_alarm()

    def _collect(self, device: int | None = None) -> None:
        """Decide deferred stream checks, drain the quarantine, read every
        queued kernel (of every layer on this backend: they share the slots).
        The stream checks come first: a synchronisation finishes both of
        their events, after which they cannot be decided."""
        order = self.stream_order
        if order.deferred:
            order.poll()
        self.quarantine.drain(device)
        if self._pad:
            for owner, finding in self.quarantine.verifier().collect(device):
                owner.report(finding)
        if order.deferred:  # after the synchronisation both events are done: undecidable, dropped
            order.drop_undecided()
        self._refresh_alarm()

    # -- the rest of the Strategy interface ------------------------------------------------------------
    def stats(self, device: int | None = None):
        """The common :class:`~cupy_memstrat.Stats`: in use as the program
        sees it (requested sizes); reserved as the wrapped strategy holds it
        (padding, red zones and quarantined blocks included), and the wrapped strategy's
        largest free block."""
        st = super().stats(device)
        inner = self.inner.stats(st.device)
        return dataclasses.replace(
            st, bytes_reserved=inner.bytes_reserved, peak_bytes_reserved=inner.peak_bytes_reserved,
            largest_free_block=inner.largest_free_block,
        )

    def largest_free_block(self, device: int) -> int | None:
        """The wrapped strategy's (a request is padded by the red zone before it gets there)."""
        return self.inner.largest_free_block(device)

    def reset_peak(self, device: int | None = None, *, reserved: bool = True) -> None:
        super().reset_peak(device, reserved=reserved)
        self.inner.reset_peak(device, reserved=reserved)

    def trim(self, keep_bytes=0, device: int | None = None) -> int:
        """Verify and give back the quarantined blocks (of ``device``), then
        trim the wrapped strategy (:meth:`Strategy.trim`). Returns the bytes
        given back to CUDA, the quarantined blocks included where the wrapped
        strategy frees straight to CUDA (``device``)."""
        if device is not None:
            device = self._device_or_current(device)
        from ..sizes import parse_size

        parse_size(keep_bytes, total=100, what="keep_bytes")  # a bad value fails before anything is given back
        devices = range(self.backend.device_count()) if device is None else [device]
        before = sum(self.inner.stats(d).bytes_reserved for d in devices)
        self.drain(device)
        released = self.inner.trim(keep_bytes, device)
        after = sum(self.inner.stats(d).bytes_reserved for d in devices)
        return max(released, before - after)

    def close(self) -> None:
        """Verify and give back the quarantine; later frees are verified and
        given back at once. The wrapped strategy is closed too if this layer
        made it (``owns_inner``)."""
        self.quarantine.close()
        self.stream_order.drop_own_events()
        if self._owns_inner:
            self.inner.close()
        super().close()

    def __getattr__(self, name):
        # strategy-specific methods of the wrapped strategy (pool_stats, managed_stats, ...)
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"<CheckedStrategy check={','.join(c for c in CHECKS if c in self.checks)} over {self.inner!r}>"


def checked(strategy, check="all", **options):
    """Wrap an existing strategy object in the checking layer (what
    ``use(name, check=...)`` does for a strategy made by name).

    Args:
        strategy: a :class:`cupy_memstrat.Strategy` (not already checked).
        check: the checks (see :func:`parse_checks`); default all three.
        **options: ``on_finding``, ``quarantine_bytes``, ``quarantine_count``,
            ``redzone_bytes``, ``track_origins``.

    Raises:
        TypeError: ``strategy`` is not a Strategy, or is already checked.
        ValueError: a bad option value, or no check named.
    """
    if "backend" in options:
        raise TypeError("backend: the checks use the wrapped strategy's backend; pass backend= when creating it")
    return CheckedStrategy(strategy, check=check, **options)
