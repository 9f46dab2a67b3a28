"""Destroyed streams, handled once (cupy_memstrat.strategies.stream_deaths): the watch that
notices a stream's death and the quarantine that waits for its work, on the simulated GPU.
The strategies' own behaviour around dead streams is in test_streams.py and tests/gpu."""

import gc

import pytest

from cupy_memstrat.strategies.stream_deaths import Quarantine, StreamWatch
from cupy_memstrat.testing import FakeBackend


def _watch(fake):
    deaths = []
    return StreamWatch(fake, 1, lambda device, handle: deaths.append((device, handle))), deaths


def test_a_watched_streams_death_is_reported_once_when_the_stream_object_goes():
    fake = FakeBackend()
    watch, deaths = _watch(fake)
    s = fake.stream()
    h = s.ptr
    assert watch.watch(0, s) and watch.watch(0, s) and watch.is_watched(0, h)
    assert deaths == []
    del s
    gc.collect()
    assert deaths == [(0, h)] and not watch.is_watched(0, h)


def test_a_new_stream_at_a_destroyed_streams_handle_reports_the_old_death_at_once_and_only_once():
    """CUDA gives a destroyed stream's handle to the next stream while the old object may still
    live (its weak reference not yet cleared): the new stream's arrival is the old one's death."""
    fake = FakeBackend()
    watch, deaths = _watch(fake)
    old = fake.stream()
    h = old.ptr
    watch.watch(0, old)
    old.destroy()  # the handle goes back to CUDA; the Python object lives on
    new = fake.stream()
    assert new.ptr == h  # the simulator, as CUDA does, gives the handle out again
    assert watch.watch(0, new) and deaths == [(0, h)]
    del old
    gc.collect()
    assert deaths == [(0, h)]  # not reported a second time
    del new
    gc.collect()
    assert deaths == [(0, h), (0, h)]


def test_default_streams_are_never_watched_and_a_wrapper_of_someone_elses_stream_is_not_watched():
    fake = FakeBackend()
    watch, deaths = _watch(fake)
    assert watch.watch(0, fake.null_stream()) is True  # never destroyed: nothing to watch
    owned = fake.stream()
    wrapper = fake.external_stream(owned)
    assert watch.watch(0, wrapper) is False and not watch.is_watched(0, wrapper.ptr)
    del wrapper
    gc.collect()
    assert deaths == []


def test_the_quarantine_gives_its_blocks_back_after_one_synchronisation_and_none_without_blocks():
    fake = FakeBackend()
    q = Quarantine(fake, 1)
    given = []
    syncs = fake.n_device_synchronize_calls
    assert q.release(0, lambda item, n: given.append(item)) == 0
    assert fake.n_device_synchronize_calls == syncs  # nothing held: no synchronisation
    q.add(0, "a", 512)
    q.add(0, "b", 1024)
    assert q.bytes == [1536]
    assert q.release(0, lambda item, n: given.append((item, n))) == 1536
    assert sorted(given) == [("a", 512), ("b", 1024)] and q.bytes == [0]
    assert fake.n_device_synchronize_calls == syncs + 1


def test_a_failed_synchronisation_keeps_the_blocks_quarantined():
    class Failing(FakeBackend):
        def device_synchronize(self, device):
            raise self.Error(1)

    q = Quarantine(Failing(), 1)
    q.add(0, "a", 512)
    with pytest.raises(Failing.Error):
        q.release(0, lambda item, n: pytest.fail("given before the device was synchronised"))
    assert q.bytes == [512]
