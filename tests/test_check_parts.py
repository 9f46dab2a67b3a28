"""The checking layer's parts on their own, on the simulated GPU: the quarantine (freed blocks
held poisoned, verified when they leave) and the stream order (the streams each thread used,
the legacy-stream findings). The layer's behaviour through use(..., check=...) is in
test_checks.py and test_streams.py."""

import itertools
import threading
import weakref

import pytest

from cupy_memstrat.checks.quarantine import CANARY_BYTE, POISON_BYTE, Quarantine
from cupy_memstrat.checks.stream_order import StreamOrder, StreamRecord
from cupy_memstrat.testing import FakeBackend


@pytest.fixture
def fake():
    return FakeBackend()


def _parts(fake, **quarantine):
    findings, given_back = [], []
    seq = itertools.count(1).__next__
    order = StreamOrder(fake, seq, findings.append)
    opts = dict(poison=True, redzone=0, limit_bytes=1 << 30, limit_count=100)
    opts.update(quarantine)
    q = Quarantine(fake, give_back=lambda ptr, device: given_back.append(ptr), stream_order=order,
                   synchronize=fake.device_synchronize, report=findings.append, **opts)
    return q, order, findings, given_back


def _record(fake, stream=None):
    s = stream or fake.current_stream(0)
    return StreamRecord(1, weakref.ref(s), s.ptr, 0, 1), s


def test_the_quarantine_poisons_holds_and_gives_back_the_oldest_block_first(fake):
    q, _, findings, given_back = _parts(fake, limit_count=2)
    ent, _s = _record(fake)
    ptrs = [fake.malloc(1024) for _ in range(3)]
    for p in ptrs[:2]:
        q.after_free(p, 1000, 1024, 0, None, ent, threading.get_ident())
    assert len(q) == 2 and q.held_bytes == 2048 and given_back == []
    assert set(fake.read(ptrs[0], 1024)) == {POISON_BYTE}
    q.after_free(ptrs[2], 1000, 1024, 0, None, ent, threading.get_ident())
    assert given_back == [ptrs[0]] and len(q) == 2 and q.held_bytes == 2048
    q.drain()
    assert given_back == ptrs and len(q) == 0 and q.held_bytes == 0
    assert [f for _, f in q.verifier().collect()] == [] and findings == []


def test_the_quarantine_reports_a_write_to_a_held_block_through_its_report(fake):
    q, _, findings, _ = _parts(fake)
    ent, _s = _record(fake)
    p = fake.malloc(4096)
    q.after_free(p, 4096, 4096, 0, None, ent, threading.get_ident())
    fake.write(p + 7, b"\x00")
    q.drain()
    for owner, finding in q.verifier().collect():
        owner.report(finding)
    (f,) = findings
    assert f.kind == "write after free" and f.first_bad_offset == 7 and f.bad_bytes == 1


def test_a_closed_quarantine_holds_nothing_and_drain_keeps_other_devices_blocks():
    fake = FakeBackend(devices=2)
    q, _, _, given_back = _parts(fake)
    ent, _s = _record(fake)
    fake.set_device(1)
    ent1, _s1 = _record(fake, fake.current_stream(1))
    ent1.device = 1
    on1 = fake.malloc(512)
    fake.set_device(0)
    on0 = fake.malloc(512)
    q.after_free(on0, 512, 512, 0, None, ent, threading.get_ident())
    q.after_free(on1, 512, 512, 1, None, ent1, threading.get_ident())
    q.drain(1)
    assert given_back == [on1] and len(q) == 1
    q.close()
    assert given_back == [on1, on0] and len(q) == 0
    late = fake.malloc(512)
    q.after_free(late, 512, 512, 0, None, ent, threading.get_ident())
    assert given_back[-1] == late and len(q) == 0  # given back at once after close


def test_the_red_zone_alone_is_verified_and_the_block_given_back_at_once(fake):
    q, _, findings, given_back = _parts(fake, poison=False, redzone=256)
    ent, _s = _record(fake)
    p = fake.malloc(512)
    fake.memset_async(p + 100, CANARY_BYTE, 412, 0)
    fake.write(p + 300, b"\x00")  # past the 100 bytes asked for
    q.after_free(p, 100, 512, 0, None, ent, threading.get_ident())
    assert given_back == [p] and len(q) == 0
    for owner, finding in q.verifier().collect():
        owner.report(finding)
    (f,) = findings
    assert f.kind == "out-of-bounds write" and f.first_bad_offset == 300


def test_the_stream_order_reports_a_legacy_stream_site_once_until_told_to_forget(fake):
    _, order, findings, _ = _parts(fake)
    args = (("f.py", 3, "fn"), 0, 0x1000, 64, 0xABC, threading.get_ident())
    order.legacy_finding(*args)
    order.legacy_finding(*args)
    assert [f.kind for f in findings] == ["legacy stream"]
    order.forget_reported()
    order.legacy_finding(*args)
    assert len(findings) == 2


def test_the_stream_order_prunes_the_records_of_streams_that_are_gone(fake):
    s = fake.stream()
    table = {1: _record(fake, s)[0], 2: _record(fake)[0]}
    del s
    import gc

    gc.collect()
    StreamOrder.prune(table)
    assert list(table) == [2]


def test_a_free_while_another_busy_stream_was_used_is_reported_or_deferred(fake):
    """The block's stream idle, another stream of the thread busy: a finding at once. Both busy:
    the decision waits on events (deferred) and poll() makes it."""
    _, order, findings, _ = _parts(fake)
    tid = threading.get_ident()
    a, other = fake.stream(), fake.stream()
    ent = StreamRecord(order.next_seq(), weakref.ref(a), a.ptr, 0, 1)
    order.seen[tid] = {a.ptr: ent, other.ptr: StreamRecord(order.next_seq(), weakref.ref(other), other.ptr, 0, 0)}
    fake.launch(other)  # work queued on the other stream
    order.check_free(0x2000, 256, 0, None, ent, tid, ent.seen)
    assert [f.kind for f in findings] == ["cross-stream reuse"] and order.deferred == []
    fake.launch(a)
    order.seen[tid][other.ptr].seen = order.next_seq()
    order.check_free(0x3000, 256, 0, None, ent, tid, ent.seen)
    assert len(order.deferred) == 1
    fake.finish(a)  # the block's stream finishes first: a finding
    order.poll()
    assert order.deferred == [] and len(findings) == 2
