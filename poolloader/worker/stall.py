"""Stall reports: which worker owes which batch, for how long, and where its Python code is.

Worker side, set up once at worker start and costing nothing per batch beyond one
store:

* `install_dumper()` creates an anonymous memfd that the worker owns
  ("poolloader-stack-<worker id>") and registers `faulthandler` on STACK_SIGNAL to
  write every thread's Python stack into it. faulthandler dumps from the C signal
  handler, so the stack comes even while the worker is blocked in C code or a
  system call (a lock, a socket read, a hung NFS file) holding the GIL or not,
  where a Python-level signal handler would never run. STACK_SIGNAL is a real-time
  signal: torch's workers use SIGBUS/SIGSEGV/SIGFPE/SIGTERM, schedulers send
  SIGUSR1/SIGUSR2 (SLURM, Lightning's requeue), nothing sends this one. Like any
  signal it can end a blocking system call early with EINTR (poll, select, sleeps and
  waits with a timeout always; with a chained handler, below, any): Python's own calls
  retry, a C library that does not retry sees the error.
  A handler the worker inherited for STACK_SIGNAL (from main, under fork) is chained:
  called after the dump. The memfd starts with a HEADER_BYTES status block: if a
  handler other than poolloader's is installed for STACK_SIGNAL later in the worker
  (`signal.signal` is watched; the handler itself is checked after worker_init_fn
  and at every idle tick, `check_handler()`), the block says so and whose, and main
  does not send the signal.
* `busy_stamp()` is what the worker writes into column [3] of its worker_stats row
  (poolloader.shm.control) when it starts on a request: the slot it is on and when it
  started (CLOCK_MONOTONIC, one clock for every process).

Main side (poolloader.main.stall), only when a wait has lasted its `timeout` or
`stall_warning`: the report, which reads the stamps (`read_stamp`, the stamp's codec
is here with `busy_stamp`) and the stack files (MEMFD_PREFIX, HEADER_BYTES) this side
writes, and sends STACK_SIGNAL.
"""
from __future__ import annotations

import faulthandler
import os
import signal

STACK_SIGNAL = int(signal.SIGRTMIN) + 7

# The name of each worker's stack file (memfd): this prefix, then the worker id.
MEMFD_PREFIX = "poolloader-stack-"
# The stack file's status block (dumps follow it): byte 0 is 1 while a handler other
# than poolloader's is installed for STACK_SIGNAL, then what it is (UTF-8, NUL-padded).
HEADER_BYTES = 256
_SIG_DFL, _SIG_IGN = 0, 1  # sa_handler values
# busy stamp: (slot + 1) << _SLOT_SHIFT | start time in µs modulo 2**_SLOT_SHIFT
# (8.9 years of uptime); slot field 0: unknown (a slot index past 2**16 - 2).
_SLOT_SHIFT = 48
_TIME_MASK = (1 << _SLOT_SHIFT) - 1
_MAX_SLOT_FIELD = (1 << 16) - 1


# -- worker side --------------------------------------------------------------------

class _Dumper:
    """This worker's stack file and the address of poolloader's handler in it."""

    def __init__(self, fd: int, ours: int | None) -> None:
        self.fd = fd
        self.ours = ours
        self.foreign: bytes = b""  # what the status block says now (b"": ours)


_dumper: _Dumper | None = None
_libc_sigaction = None  # libc's sigaction through ctypes, and its out buffer
_plain_signal = signal.signal  # signal.signal before install_dumper watched it


def _handler_address(signum: int) -> int | None:
    """sa_handler of `signum` in this process (0: SIG_DFL, 1: SIG_IGN), from libc's
    sigaction; None where it cannot be asked."""
    global _libc_sigaction
    try:
        if _libc_sigaction is None:
            import ctypes
            _libc_sigaction = (ctypes.CDLL(None, use_errno=True).sigaction,
                               ctypes.create_string_buffer(512), ctypes.c_void_p)
        sigaction, out, pointer = _libc_sigaction
        if sigaction(signum, None, out) != 0:
            return None
        return pointer.from_buffer(out).value or 0  # sa_handler comes first
    except Exception:
        return None


def install_dumper(worker_id: int) -> None:
    """In a worker, before anything that may block: dump stacks on STACK_SIGNAL into a
    memfd this process owns (kept open for its life), chaining a handler inherited for
    it. Best effort: without memfd support the stall report shows no stack, and
    nothing else changes."""
    global _dumper
    try:
        fd = os.memfd_create(f"{MEMFD_PREFIX}{worker_id}", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return
    try:
        os.pwrite(fd, bytes(HEADER_BYTES), 0)
        os.lseek(fd, HEADER_BYTES, os.SEEK_SET)  # faulthandler writes after the status block
        inherited = _handler_address(STACK_SIGNAL)
        if inherited is None:  # cannot ask libc: what Python knows
            chain = callable(signal.getsignal(STACK_SIGNAL))
        else:
            chain = inherited not in (_SIG_DFL, _SIG_IGN)  # chaining SIG_DFL would kill
        faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=chain)
    except (OSError, RuntimeError, ValueError):
        os.close(fd)
        return
    _dumper = _Dumper(fd, _handler_address(STACK_SIGNAL))
    signal.signal = _watched_signal  # a later handler for STACK_SIGNAL is seen at once


def _watched_signal(signalnum, handler):
    try:
        return _plain_signal(signalnum, handler)
    finally:
        check_handler()


def check_handler() -> None:
    """In a worker: write in the status block whether poolloader's handler is still the
    one for STACK_SIGNAL (main signals the worker only then). One sigaction call."""
    dumper = _dumper
    if dumper is None or dumper.ours is None:
        return
    now = _handler_address(STACK_SIGNAL)
    if now is None or now == dumper.ours:
        foreign = b""
    else:
        foreign = b"\x01" + _describe_handler(now).encode("utf-8", "replace")[:HEADER_BYTES - 1]
    if foreign != dumper.foreign:
        try:
            os.pwrite(dumper.fd, foreign.ljust(HEADER_BYTES, b"\0"), 0)
        except OSError:
            return
        dumper.foreign = foreign


def _describe_handler(address: int) -> str:
    if address == _SIG_DFL:
        return "SIG_DFL"
    if address == _SIG_IGN:
        return "SIG_IGN"
    python = signal.getsignal(STACK_SIGNAL)
    if callable(python):
        name = getattr(python, "__qualname__", None) or repr(python)
        return f"the Python handler {getattr(python, '__module__', '?')}.{name}"
    return f"a handler at {address:#x} installed outside Python"


# -- the busy stamp: the worker writes it, main reads it (poolloader.main.stall) -------

def busy_stamp(slot: int, since_ns: int) -> int:
    """The worker_stats[3] value of a worker that started on `slot` at `since_ns`
    (time.perf_counter_ns(): CLOCK_MONOTONIC on Linux). Called before the slot index
    is checked: any int (a forged one too) gives a valid stamp, "slot unknown"."""
    field = slot + 1 if 0 <= slot < _MAX_SLOT_FIELD else 0
    return (field << _SLOT_SHIFT) | ((since_ns // 1000) & _TIME_MASK)


def read_stamp(stamp: int, now_ns: int) -> tuple[int | None, float | None]:
    """(slot, seconds on it) from a busy stamp; (None, None) for a worker that has not
    started on any request yet."""
    if stamp == 0:
        return None, None
    field = stamp >> _SLOT_SHIFT
    elapsed_us = ((now_ns // 1000) - (stamp & _TIME_MASK)) & _TIME_MASK
    return (field - 1 if field else None), elapsed_us / 1e6
