"""/proc, the one reader of the process table for all benches (`fd_count`,
`cpu_ns`, `rss_bytes`, `shm_mapped_bytes`, `processes`, `live_children`,
`session_pids`, `pids_running`), and hygiene (`note_workers`, `our_shm_names`,
`wait_no_children`, `wait_clean`): what a run leaves behind, children and
/dev/shm names.

Nothing here imports torch or poolloader at import time.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import time
from dataclasses import dataclass

SHM_DIR = "/dev/shm"


@dataclass
class Proc:
    state: bytes
    ppid: int
    pgrp: int
    session: int


def processes() -> dict[int, Proc]:
    """{pid: Proc} of every process readable now (one that exits meanwhile is skipped)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        table[int(entry)] = Proc(fields[0], int(fields[1]), int(fields[2]), int(fields[3]))
    return table


def _alive(proc: Proc) -> bool:
    return proc.state not in (b"Z", b"X", b"x")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def live_children(pid: int | None = None) -> dict[int, str]:
    """{pid: command line} of the non-zombie children of `pid` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return {p: cmdline(p) for p, proc in processes().items() if proc.ppid == pid and _alive(proc)}


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is `sid`."""
    return [p for p, proc in processes().items() if proc.session == sid and _alive(proc)]


def pids_running(needle: str) -> list[int]:
    """Processes whose command line contains `needle` (read-only)."""
    return sorted(p for p in processes() if needle in cmdline(p))


def fd_count(pid: int | str = "self") -> int:
    """Open descriptors of `pid`, not counting the one this call opens to list them."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return fds - 1 if pid in ("self", os.getpid()) else fds


def cpu_ns(pid: int) -> int:
    """CPU time of every live thread of `pid`, in ns (/proc/<pid>/task/*/schedstat).

    Threads that exited are not counted (loader workers keep theirs for life)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of `pid` (/proc/<pid>/statm)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shm_mapped_bytes(pid: int | str = "self") -> int:
    """Bytes of shared memory objects that `pid` maps: /dev/shm files (unlinked ones
    included) and memfd segments (poolloader's default backend), each (object, offset,
    length) counted once: the shared memory it keeps alive."""
    seen = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith((SHM_DIR + "/", "/memfd:")):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            seen.add((parts[3], parts[4], int(parts[2], 16), end - start))
    return sum(length for *_, length in seen)


# pids of this run and of every worker it started: /dev/shm names are ours when
# they carry one (PoolLoader: "pl2-<main pid>-...", torch: "torch_<creator pid>_...").
# Other processes on the machine may create and remove names meanwhile.
OUR_PIDS = {os.getpid()}


def note_workers(it) -> list[int]:
    """Remember the worker pids of a loader iterator (DataLoader's and PoolLoader's
    both keep their processes in `_workers`); returns them."""
    pids = [w.pid for w in getattr(it, "_workers", ()) if w.pid]
    OUR_PIDS.update(pids)
    return pids


def shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def names_of(pids, names=None) -> list[str]:
    """The /dev/shm names (of `names`, default all) that carry one of `pids`
    (as `pl2-<pid>-` or `torch_<pid>_`)."""
    from poolloader.shm.backends.posix import NAME_TAG

    pids = set(pids)
    out = []
    for name in shm_names() if names is None else names:
        for prefix, sep in ((f"{NAME_TAG}-", "-"), ("torch_", "_")):
            if name.startswith(prefix):
                head = name[len(prefix):].split(sep, 1)[0]
                if head.isdigit() and int(head) in pids:
                    out.append(name)
    return sorted(out)


def our_shm_names() -> list[str]:
    return names_of(OUR_PIDS)


def _service_pids() -> set[int]:
    """multiprocessing's run-long helper processes (resource tracker, forkserver), if
    started, and poolloader's zygotes (poolloader.worker.zygote)."""
    from multiprocessing import forkserver, resource_tracker

    from poolloader.worker import zygote

    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None), *zygote.pids()}
    return {pid for pid in pids if pid}


def wait_no_children(timeout: float = 10.0) -> dict[int, str]:
    """Wait until this process has no live child (multiprocessing's resource tracker
    and forkserver excepted); returns those left after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        multiprocessing.active_children()  # reaps the multiprocessing children that exited
        services = _service_pids()
        children = {p: c for p, c in live_children().items() if p not in services}
        if not children or time.monotonic() > deadline:
            return children
        time.sleep(0.05)


def wait_clean(timeout: float = 10.0) -> list[str]:
    """Wait until no child process and no shm name of ours is left; returns what
    is still there after `timeout` (empty when clean)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        children = wait_no_children(0)
        names = our_shm_names()
        if not children and not names:
            return []
        if time.monotonic() > deadline:
            return [f"child pid {p}" for p in children] + [f"{SHM_DIR}/{n}" for n in names]
        time.sleep(0.05)
