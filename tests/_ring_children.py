"""Bodies of the child processes in test_ring.py.

Kept apart from the test module so a spawned child imports only this, helpers and
poolloader (not pytest or hypothesis). `shared` is the parent's Mapping for a
forked child (inherited, the name may already be gone) or the segment's name for
a spawned one (mapped here). Each body reports through its exit code and, where
the parent needs more, through a control ring the child pushes to.

Exit codes: 0 as expected, 3 timed out, 4 returned when it should have raised;
an uncaught exception exits 1 with the traceback on stderr.
"""
import sys
import time

from helpers import attach_shared

from poolloader.errors import RingClosed, RingTimeout
from poolloader.shm._ring import Doorbell, Ring

READY = -1  # pushed on the control ring once the child is attached


def _open(shared, nbytes):
    return attach_shared(shared, nbytes) if isinstance(shared, str) else shared


def produce(shared, nbytes, ring_at, start, count, timeout):
    """Push start, start+1, ... (count values), each within `timeout` seconds."""
    ring = Ring(_open(shared, nbytes), ring_at)
    for value in range(start, start + count):
        ring.push(value, timeout)


def produce_until_killed(shared, nbytes, ring_at):
    """Push 0, 1, 2, ... until the parent kills us (exits 3 if nobody pops for 30 s)."""
    ring = Ring(_open(shared, nbytes), ring_at)
    value = 0
    try:
        while True:
            ring.push(value, 30.0)
            value += 1
    except RingTimeout:
        sys.exit(3)


def consume_until_killed(shared, nbytes, ring_at):
    """Pop forever, checking the values are 0, 1, 2, ... (exits 3 after 30 s idle)."""
    ring = Ring(_open(shared, nbytes), ring_at)
    expected = 0
    try:
        while True:
            value = ring.pop(30.0)
            if value != expected:
                sys.exit(f"popped {value}, expected {expected}")
            expected += 1
    except RingTimeout:
        sys.exit(3)


def block_until_closed(shared, nbytes, ring_at, control_at, role):
    """Say READY, then block in `role` ("pop" on an empty ring, "push" on a full one).

    Pushes the milliseconds it stayed blocked on the control ring; exits 0 when
    the call raised RingClosed.
    """
    memory = _open(shared, nbytes)
    ring, control = Ring(memory, ring_at), Ring(memory, control_at)
    control.push(READY, 5.0)
    started = time.monotonic()
    try:
        if role == "pop":
            ring.pop(30.0)
        else:
            ring.push(7, 30.0)
    except RingClosed:
        code = 0
    except RingTimeout:
        code = 3
    else:
        code = 4
    control.push(int((time.monotonic() - started) * 1000), 5.0)
    sys.exit(code)


def wait_for_bell(shared, nbytes, bell_at, control_at):
    """Say READY, wait up to 10 s for the doorbell; push the milliseconds waited."""
    memory = _open(shared, nbytes)
    bell, control = Doorbell(memory, bell_at), Ring(memory, control_at)
    control.push(READY, 5.0)
    started = time.monotonic()
    rung = bell.wait(10.0)
    control.push(int((time.monotonic() - started) * 1000), 5.0)
    sys.exit(0 if rung else 3)


def produce_and_ring(shared, nbytes, ring_at, bell_at, tag, count):
    """Push tag*1_000_000 + i for i < count on our own ring, ringing the bell after each."""
    memory = _open(shared, nbytes)
    ring, bell = Ring(memory, ring_at), Doorbell(memory, bell_at)
    for i in range(count):
        ring.push(tag * 1_000_000 + i, 10.0)
        bell.ring()


def consume(shared, nbytes, ring_at, count, timeout):
    """Pop `count` values, each within `timeout` seconds; they must be 0, 1, 2, ..."""
    ring = Ring(_open(shared, nbytes), ring_at)
    for expected in range(count):
        value = ring.pop(timeout)
        if value != expected:
            sys.exit(f"popped {value}, expected {expected}")


def claim_all(shared, nbytes, words, wins_at, backwards):
    """Claim each of `words` u64 claim words (word i holds ticket i + 1), in order or
    `backwards`, and mark the ones this process won with a 1 byte at wins_at + i
    (after a 1 at wins_at + words: attached, about to start)."""
    from poolloader.shm._ring import claim

    mapping = _open(shared, nbytes)
    marks = memoryview(mapping)
    marks[wins_at + words] = 1  # attached: the parent starts now too
    order = range(words - 1, -1, -1) if backwards else range(words)
    for i in order:
        if claim(mapping, i * 8, i + 1):
            marks[wins_at + i] = 1
