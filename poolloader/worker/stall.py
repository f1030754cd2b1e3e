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

Main side, only when a wait has lasted its `timeout` or `stall_warning`:
`report()` names every worker that owes a batch, the batch it is on (main kept a
reference to the sample indices it sent), since when, and its stack. Main reads the
worker's memfd through /proc/<pid>/fd/<n>, which needs only the read access a
same-user process has to another's /proc entries (Yama's ptrace_scope restricts
PTRACE_ATTACH, not this). Only the worker whose batch is waited for (the oldest
request in flight: in order, the one next() must return) is signalled, and only if
/proc/<pid>/status shows it catches STACK_SIGNAL (a worker still starting up is never
killed by the signal's default action) and its status block shows poolloader's
handler; the others are described without a stack. Main waits at most DUMP_WAIT_S
for the dump.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import time
from dataclasses import dataclass

STACK_SIGNAL = int(signal.SIGRTMIN) + 7
# How long main waits for the workers' stack dumps, in all (seconds).
DUMP_WAIT_S = 1.0
# A dump is complete once its file stopped growing for this long (seconds).
DUMP_SETTLE_S = 0.05
# Innermost frames shown per thread; sample indices shown per batch.
MAX_FRAMES = 12
MAX_INDICES = 32

_MEMFD_PREFIX = "poolloader-stack-"
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
        fd = os.memfd_create(f"{_MEMFD_PREFIX}{worker_id}", os.MFD_CLOEXEC)
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


# -- main side ----------------------------------------------------------------------

@dataclass
class OwedWork:
    """What one worker owes main, in send order: (seq, sample indices) per request."""

    worker: int
    pid: int | None
    requests: list[tuple[int, object]]
    current: int | None  # seq of the request it is on (None: not started on any)
    on_it_s: float | None


def owed_work(workers, worker_stats, inflight: dict, sent: dict) -> list[OwedWork]:
    """Per worker with requests in flight: what it owes and which one it is on.

    `inflight`: slot -> (seq, worker) (poolloader.main.ledger); `sent`: slot -> the sample
    indices main sent in that slot's request; `worker_stats`: the control block's
    (num_workers, 4) table, column [3] the busy stamps."""
    now = time.perf_counter_ns()
    by_worker: dict[int, list[tuple[int, int]]] = {}
    for slot, (seq, worker) in inflight.items():
        by_worker.setdefault(worker, []).append((seq, slot))
    owed = []
    for worker in sorted(by_worker):
        pairs = sorted(by_worker[worker])
        stamp = int(worker_stats[worker, 3]) if worker_stats is not None else 0
        slot, on_it = read_stamp(stamp, now)
        current = next((seq for seq, s in pairs if s == slot), None)
        pid = workers[worker].pid if worker < len(workers) else None
        owed.append(OwedWork(worker, pid, [(seq, sent.get(s)) for seq, s in pairs],
                             current, on_it if current is not None else None))
    return owed


def report(workers, worker_stats, inflight: dict, sent: dict) -> str:
    """The stall report: one paragraph per worker that owes a batch, with its stack.

    Blocks up to DUMP_WAIT_S (the stack dumps). Called only once a wait has lasted its
    `timeout` or `stall_warning`."""
    owed = owed_work(workers, worker_stats, inflight, sent)
    if not owed:
        return "No worker owes a batch (main is waiting for nothing: an internal error)."
    # the batch waited for: the oldest in flight (in order, the one next() must return)
    target = min(owed, key=lambda w: w.requests[0][0])
    stacks = dump_stacks([target.pid] if target.pid is not None else [])
    n = len(owed)
    lines = [f"{n} worker{'s' if n != 1 else ''} owe{'s' if n == 1 else ''} a batch "
             f"(stacks are most recent call first):"]
    for w in owed:
        lines.append(f"  worker {w.worker} (pid {w.pid}): {_describe(w)}")
        stack = stacks.get(w.pid) if w.pid is not None else None
        if w is not target:
            stack = (f"no stack: not signalled (only worker {target.worker}, whose batch "
                     f"{target.requests[0][0]} is waited for, is)")
        lines.extend("    " + line for line in (stack or "no stack").splitlines())
    return "\n".join(lines)


def _describe(w: OwedWork) -> str:
    requests = dict(w.requests)
    if w.current is None:
        head = ("not on any batch yet (still in start-up or worker_init_fn?); owes "
                f"batch {w.requests[0][0]}, samples {_indices(w.requests[0][1])}")
    else:
        head = (f"on batch {w.current} for {w.on_it_s:.1f} s, "
                f"samples {_indices(requests[w.current])}")
    others = [seq for seq, _ in w.requests if seq != w.current]
    if w.current is None:
        others = others[1:]
    if others:
        head += f"; also owes batch{'es' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    return head


def _indices(index) -> str:
    if index is None:  # batch_size=None over an IterableDataset
        return "(an IterableDataset: no sample indices)"
    if isinstance(index, (list, tuple)):
        if all(i is None for i in index):
            return "(an IterableDataset batch: no sample indices)"
        shown = ", ".join(repr(i) for i in index[:MAX_INDICES])
        more = f", ... ({len(index)} in all)" if len(index) > MAX_INDICES else ""
        return f"[{shown}{more}]"
    return repr(index)


def dump_stacks(pids: list[int], wait_s: float = DUMP_WAIT_S) -> dict[int, str]:
    """pid -> that worker's stacks (innermost MAX_FRAMES per thread, down to the worker
    loop), or a line saying why there is none. Signals every worker first, then waits
    for all dumps together, at most `wait_s`."""
    out: dict[int, str] = {}
    files: dict[int, tuple[int, int]] = {}  # pid -> (fd, size before the signal)
    for pid in pids:
        fd = None
        try:
            path = _dump_file(pid)
            if path is not None:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                status = os.pread(fd, HEADER_BYTES, 0)
                if status[:1] == b"\x01":
                    what = status[1:].rstrip(b"\0").decode("utf-8", "replace")
                    out[pid] = (f"no stack: the worker installed its own handler for signal "
                                f"{STACK_SIGNAL} (SIGRTMIN+{STACK_SIGNAL - int(signal.SIGRTMIN)}"
                                f", the stack signal): {what}; it was not signalled")
                    continue
            if not _catches(pid, STACK_SIGNAL):
                out[pid] = "no stack: the worker has not installed its stack dumper (still starting?)"
                continue
            if fd is None:
                out[pid] = "no stack: the worker has no stack file (memfd_create unavailable?)"
                continue
            files[pid] = (fd, os.fstat(fd).st_size)
            fd = None  # closed below
            os.kill(pid, STACK_SIGNAL)
        except OSError as e:
            out[pid] = f"no stack: {e}"
        finally:
            if fd is not None:
                os.close(fd)
    try:
        sizes = {pid: start for pid, (_fd, start) in files.items()}
        settled_at = {pid: 0.0 for pid in files}  # when its size last changed
        deadline = time.monotonic() + wait_s
        while files and time.monotonic() < deadline:
            time.sleep(0.01)
            now = time.monotonic()
            for pid, (fd, _start) in files.items():
                size = os.fstat(fd).st_size
                if size != sizes[pid]:
                    sizes[pid], settled_at[pid] = size, now
            if all(sizes[p] > files[p][1] and now - settled_at[p] >= DUMP_SETTLE_S
                   for p in files):
                break
        for pid, (fd, start) in files.items():
            size = os.fstat(fd).st_size
            if size <= start:
                out[pid] = f"no stack: the worker did not answer within {wait_s:.1f} s"
                continue
            text = os.pread(fd, size - start, start).decode("utf-8", "replace")
            out[pid] = format_dump(text)
    finally:
        for fd, _start in files.values():
            os.close(fd)
    return out


def _catches(pid: int, signum: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _dump_file(pid: int) -> str | None:
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:" + _MEMFD_PREFIX):
            return f"{fd_dir}/{name}"
    return None


def format_dump(text: str) -> str:
    """faulthandler's all-threads dump, each thread cut to its innermost MAX_FRAMES frames
    and to the frames above the worker loop (multiprocessing's own are left out)."""
    blocks, current = [], []  # type: ignore[var-annotated]
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" ") and current:
            blocks.append(current)
            current = []
        current.append(line)
    if current:
        blocks.append(current)
    lines = []
    for block in blocks:
        head, frames = block[0], [f.strip() for f in block[1:]]
        for k, frame in enumerate(frames):
            if frame.endswith(" in worker_loop") and "poolloader" in frame:
                frames = frames[:k + 1]
                break
        shown = frames[:MAX_FRAMES]
        lines.append(head)
        lines.extend("  " + f for f in shown)
        if len(frames) > len(shown):
            lines.append(f"  ... {len(frames) - len(shown)} outer frames")
    return "\n".join(lines)
