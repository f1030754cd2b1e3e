"""Stall reports, main's side: which worker owes which batch, for how long, and where
its Python code is (the workers' side, the stack dumper and the busy stamps, is
poolloader.worker.stall).

Only when a wait has lasted its `timeout` or `stall_warning`:
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

import os
import signal
import time
from dataclasses import dataclass

from poolloader.worker.stall import HEADER_BYTES, MEMFD_PREFIX, STACK_SIGNAL, read_stamp

# How long main waits for the workers' stack dumps, in all (seconds).
DUMP_WAIT_S = 1.0
# A dump is complete once its file stopped growing for this long (seconds).
DUMP_SETTLE_S = 0.05
# Innermost frames shown per thread; sample indices shown per batch.
MAX_FRAMES = 12
MAX_INDICES = 32


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
    # node_workers: logical workers share a process, which is on one batch at a time
    busy = {w.pid: w for w in owed if w.current is not None}
    for w in owed:
        host = busy.get(w.pid)
        if w.current is None and host is not None:
            head = (f"waiting for its process, which is on worker {host.worker}'s batch "
                    f"{host.current}; owes batch{'es' if len(w.requests) > 1 else ''} "
                    f"{', '.join(str(seq) for seq, _ in w.requests)}")
        else:
            head = _describe(w)
        lines.append(f"  worker {w.worker} (pid {w.pid}): {head}")
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
        if target.startswith("/memfd:" + MEMFD_PREFIX):
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
