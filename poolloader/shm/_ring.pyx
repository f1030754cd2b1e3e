# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython face of csrc/ring.h: an SPSC int64 ring and a doorbell in shared memory.

The C header owns the byte layout (see its comment). Both classes take any
writable buffer (a poolloader mapping, an mmap) plus a 64-byte-aligned offset, and
keep the buffer exported for their whole life, so the memory cannot be unmapped
under them.

Every process that maps the buffer can write all of it, so a Ring trusts nothing it
reads there after attaching: the capacity is a copy held in the object (the
creator's argument, or the recorded value checked once against the buffer's size),
and a changed capacity or magic field, or counters out of step, raise ControlCorrupt
instead of reading or writing outside the ring. After that error the ring stays broken in this process: every
later call raises it again.
"""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_SIMPLE
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int64_t, uint64_t, uint8_t

import time

from poolloader.errors import ControlCorrupt, RingClosed, RingTimeout

cdef extern from "ring.h" nogil:
    int PL_OK, PL_EMPTY, PL_FULL, PL_TIMEOUT, PL_CLOSED, PL_INTR, PL_CORRUPT
    uint64_t PL_RING_HEADER_BYTES_ "PL_RING_HEADER_BYTES"
    uint64_t PL_DOORBELL_BYTES_ "PL_DOORBELL_BYTES"
    const char *PL_TIMED_WAIT
    uint64_t UINT64_MAX
    uint64_t pl_ring_nbytes(uint64_t capacity)
    uint64_t pl_ring_max_capacity(uint64_t nbytes)
    int pl_ring_init(void *b, uint64_t capacity)
    uint64_t pl_ring_attach(void *b, uint64_t nbytes)
    uint64_t pl_ring_recorded_capacity(void *b)
    uint64_t pl_ring_head(void *b)
    uint64_t pl_ring_tail(void *b)
    int pl_ring_closed(void *b)
    void pl_ring_close(void *b)
    uint64_t pl_ring_len(void *b, uint64_t capacity)
    int pl_ring_push(void *b, uint64_t capacity, int64_t value, double seconds)
    int pl_ring_pop(void *b, uint64_t capacity, int64_t *value, double seconds)
    int pl_doorbell_init(void *b)
    int pl_doorbell_is_valid(void *b)
    void pl_doorbell_ring(void *b)
    int pl_doorbell_wait(void *b, double seconds)
    int pl_claim(void *word, uint64_t ticket)

RING_HEADER_BYTES = PL_RING_HEADER_BYTES_
DOORBELL_BYTES = PL_DOORBELL_BYTES_
# The C call that timed waits use in this build: "sem_clockwait" (glibc >= 2.30), or
# "sem_timedwait" in sliced realtime deadlines (older C libraries, or a build with
# POOLLOADER_FORCE_SEM_TIMEDWAIT=1); see csrc/ring.h.
TIMED_WAIT = PL_TIMED_WAIT.decode("ascii")

# Longest single sleep inside a blocking call: between slices Python signal
# handlers run (KeyboardInterrupt reaches a blocked main process promptly).
cdef double _SLICE = 0.1


def ring_nbytes(uint64_t capacity):
    """Bytes a ring of `capacity` cells occupies in its buffer (header included)."""
    return pl_ring_nbytes(capacity)


cdef class _Shared:
    """Holds a writable export of `buffer` and the address `offset` bytes into it."""
    cdef Py_buffer _view
    cdef bint _held
    cdef void *_ptr
    cdef readonly object buffer
    cdef readonly Py_ssize_t offset

    cdef int _attach(self, object buffer, Py_ssize_t offset, uint64_t nbytes) except -1:
        PyObject_GetBuffer(buffer, &self._view, PyBUF_WRITABLE | PyBUF_SIMPLE)
        self._held = True
        if offset < 0 or offset > self._view.len or nbytes > <uint64_t>(self._view.len - offset):
            raise ValueError(
                f"a region of {nbytes} bytes at offset {offset} does not fit a buffer "
                f"of {self._view.len} bytes")
        if (<size_t>self._view.buf + offset) % 64:
            raise ValueError(f"offset {offset} is not 64-byte aligned in its buffer")
        self.buffer = buffer
        self.offset = offset
        self._ptr = <uint8_t *>self._view.buf + offset
        return 0

    def __dealloc__(self):
        if self._held:
            PyBuffer_Release(&self._view)
            self._held = False


cdef class Ring(_Shared):
    """Bounded single-producer/single-consumer queue of int64 in shared memory.

    Exactly one process pushes and exactly one pops (ownership is the caller's
    contract). The creator calls `Ring(buf, off, capacity=n)` once; the other
    side attaches with `Ring(buf, off)`, which checks the recorded capacity
    against the buffer once and keeps it (ValueError when there is no ring of a
    capacity that fits). Blocking calls release the GIL and wait
    at most `timeout` seconds (None: until closed), raising RingTimeout or
    RingClosed (after `close()` from either side), or ControlCorrupt when the
    ring's shared fields were overwritten (see the module docstring). `label` names
    the ring in error messages ("done ring of worker 3").
    """
    cdef readonly uint64_t capacity
    cdef readonly str label
    cdef object _broken  # the message of the ControlCorrupt raised once, raised by every later call

    def __cinit__(self, buffer, Py_ssize_t offset=0, capacity=None, *, str label="ring"):
        cdef int rc
        cdef uint64_t room
        self.label = label
        if capacity is not None:
            if capacity < 1:
                raise ValueError(f"ring capacity must be >= 1, got {capacity}")
            self._attach(buffer, offset, pl_ring_nbytes(capacity))
            rc = pl_ring_init(self._ptr, capacity)
            if rc != 0:
                raise OSError(rc, "sem_init failed for a ring")
        else:
            self._attach(buffer, offset, PL_RING_HEADER_BYTES_)
            room = <uint64_t>(self._view.len - offset)
            capacity = pl_ring_attach(self._ptr, room)
            if capacity == 0:
                raise ValueError(
                    f"{label}: no initialised ring at offset {offset} of this buffer (magic "
                    f"{(<uint64_t *>self._ptr)[0]:#x}, recorded capacity "
                    f"{pl_ring_recorded_capacity(self._ptr)}; the {room} bytes from there hold "
                    f"at most {pl_ring_max_capacity(room)} cells)")
            PyBuffer_Release(&self._view)
            self._held = False
            self._attach(buffer, offset, pl_ring_nbytes(capacity))
        self.capacity = capacity

    @staticmethod
    def nbytes(uint64_t capacity):
        return pl_ring_nbytes(capacity)

    def __len__(self):
        """Values currently queued (exact from either side when the other is idle)."""
        if self._broken is not None:
            raise ControlCorrupt(self._broken)
        cdef uint64_t n = pl_ring_len(self._ptr, self.capacity)
        if n == UINT64_MAX:
            self._corrupt("len")
        return n

    @property
    def closed(self):
        return bool(pl_ring_closed(self._ptr))

    def close(self):
        """Mark the ring closed and wake every waiter on both sides; they raise RingClosed."""
        pl_ring_close(self._ptr)

    def try_push(self, int64_t value):
        """Push without waiting; False when full. Producer side only."""
        if self._broken is not None:
            raise ControlCorrupt(self._broken)
        cdef int rc = pl_ring_push(self._ptr, self.capacity, value, -1.0)
        if rc == PL_OK:
            return True
        return self._check(rc, "push")

    def try_pop(self):
        """Pop without waiting; None when empty. Consumer side only."""
        if self._broken is not None:
            raise ControlCorrupt(self._broken)
        cdef int64_t value = 0
        cdef int rc = pl_ring_pop(self._ptr, self.capacity, &value, -1.0)
        if rc == PL_OK:
            return value
        self._check(rc, "pop")
        return None

    def push(self, int64_t value, timeout=None):
        """Push, waiting at most `timeout` seconds for a free cell (GIL released)."""
        cdef int64_t dummy = 0
        self._wait(True, value, &dummy, timeout)

    def pop(self, timeout=None):
        """Pop, waiting at most `timeout` seconds for a value (GIL released)."""
        cdef int64_t value = 0
        self._wait(False, 0, &value, timeout)
        return value

    cdef int _wait(self, bint pushing, int64_t value, int64_t *out, object timeout) except -1:
        cdef double slice_
        cdef int rc
        cdef void *ptr = self._ptr
        cdef uint64_t capacity = self.capacity
        cdef double deadline = 0.0
        if self._broken is not None:
            raise ControlCorrupt(self._broken)
        if timeout is not None:
            if timeout < 0:
                raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
            deadline = time.monotonic() + timeout
        while True:
            slice_ = _SLICE
            if timeout is not None:
                slice_ = min(_SLICE, max(0.0, deadline - time.monotonic()))
            with nogil:
                if pushing:
                    rc = pl_ring_push(ptr, capacity, value, slice_)
                else:
                    rc = pl_ring_pop(ptr, capacity, out, slice_)
            if rc == PL_OK:
                return 0
            if rc == PL_TIMEOUT or rc == PL_INTR:
                PyErr_CheckSignals()
                if timeout is not None and time.monotonic() >= deadline:
                    queued = pl_ring_len(ptr, capacity)
                    raise RingTimeout(
                        f"{self.label} {'push' if pushing else 'pop'} timed out after {timeout} s "
                        f"(capacity {capacity}, "
                        f"{'counters out of step' if queued == UINT64_MAX else queued} queued)")
                continue
            self._check(rc, "push" if pushing else "pop")

    cdef object _check(self, int rc, str what):
        if rc == PL_EMPTY:
            return False
        if rc == PL_CLOSED:
            raise RingClosed(f"{self.label} {what} failed: the ring was closed")
        if rc == PL_CORRUPT:
            self._corrupt(what)
        raise OSError(-rc, f"{self.label} {what} failed")

    cdef int _corrupt(self, str what) except -1:
        cdef uint64_t head = pl_ring_head(self._ptr)
        cdef uint64_t tail = pl_ring_tail(self._ptr)
        cdef uint64_t recorded = pl_ring_recorded_capacity(self._ptr)
        cdef uint64_t magic = (<uint64_t *>self._ptr)[0]
        self._broken = (
            f"{self.label} {what}: its shared fields were overwritten (head {head}, tail "
            f"{tail}: {tail - head if tail >= head else -<object>(head - tail)} apart, must be "
            f"within 0..{self.capacity}; capacity field {recorded}, attached with "
            f"{self.capacity}; magic {magic:#x}). "
            "Some process that maps the pool's control block wrote over it (a stray write "
            "in dataset, collate or extension code running in a worker); nothing was read "
            "or written outside the ring.")
        raise ControlCorrupt(self._broken)


cdef int _claim(object buffer, Py_ssize_t offset, uint64_t ticket) except -1:
    cdef Py_buffer view
    cdef int won
    PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE | PyBUF_SIMPLE)
    try:
        if offset < 0 or offset + 8 > view.len or (<size_t>view.buf + offset) % 8:
            raise ValueError(f"no aligned u64 at offset {offset} of a buffer of {view.len} bytes")
        won = pl_claim(<uint8_t *>view.buf + offset, ticket)
    finally:
        PyBuffer_Release(&view)
    return won


def claim(buffer, Py_ssize_t offset, uint64_t ticket):
    """Take the request whose claim word (the u64 at `offset` of `buffer`) holds
    `ticket`: swap it to 0 atomically. True if this call did; False if the word holds
    anything else (someone took it first, or the slot carries another request now)."""
    return _claim(buffer, offset, ticket) == 1


def claim_and_push(buffer, Py_ssize_t offset, uint64_t ticket, Ring ring, int64_t value):
    """claim(), and if it won, ring.try_push(value), in one call (no signal handler
    runs between them): 0 lost the claim (nothing pushed), 1 claimed and pushed, 2
    claimed but the ring was full, 3 claimed but the push raised (the ring closed or
    broken: it raises again at its next call)."""
    if _claim(buffer, offset, ticket) != 1:
        return 0
    try:
        pushed = ring.try_push(value)
    except Exception:
        return 3
    return 1 if pushed else 2


cdef class Doorbell(_Shared):
    """A process-shared counting semaphore: many processes ring, one waits.

    Producers call `ring()` after each push to their own Ring; the consumer
    `wait(timeout)`s (GIL released) and then drains its rings with try_pop.
    A wake may find nothing new (an earlier drain took it): callers loop.
    """

    def __cinit__(self, buffer, Py_ssize_t offset=0, bint create=False):
        cdef int rc
        self._attach(buffer, offset, PL_DOORBELL_BYTES_)
        if create:
            rc = pl_doorbell_init(self._ptr)
            if rc != 0:
                raise OSError(rc, "sem_init failed for a doorbell")
        elif not pl_doorbell_is_valid(self._ptr):
            raise ValueError(f"no initialised doorbell at offset {offset} of this buffer")

    def ring(self):
        pl_doorbell_ring(self._ptr)

    def wait(self, double timeout):
        """True if rung within `timeout` seconds, else False."""
        cdef int rc
        cdef void *ptr = self._ptr
        cdef double deadline = time.monotonic() + timeout
        cdef double slice_
        while True:
            slice_ = min(_SLICE, max(0.0, deadline - time.monotonic()))
            with nogil:
                rc = pl_doorbell_wait(ptr, slice_)
            if rc == PL_OK:
                return True
            if rc == PL_TIMEOUT or rc == PL_INTR:
                PyErr_CheckSignals()
                if time.monotonic() >= deadline:
                    return False
                continue
            raise OSError(-rc, "doorbell wait failed")

    def drain(self):
        """Drop every token rung so far and return how many: a consumer whose poll
        found nothing drains the tokens of what earlier polls took, then polls once
        more, so its next wait sleeps instead of waking at once for each of them."""
        cdef Py_ssize_t n = 0
        while self.wait(0.0):
            n += 1
        return n
