"""The tests' one reader of /proc: processes, their states, descriptors and mappings.

No pytest import: spawned children and the namespaced bodies import it. Every reader
tolerates a process that exits while it looks (it is then absent, or not running).
"""
from __future__ import annotations

import os

SHM_DIR = "/dev/shm"
_GONE = ("Z", "X", "x")  # zombie or dead: exited, not running anything


def pids() -> list[int]:
    """Every pid of this PID namespace."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _stat(pid) -> tuple[int, str] | None:
    """(ppid, state) of `pid`, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[1]), fields[0].decode()


def process_table() -> dict[int, tuple[int, str]]:
    """{pid: (ppid, state)} of every process we can read."""
    table = {}
    for pid in pids():
        entry = _stat(pid)
        if entry is not None:
            table[pid] = entry
    return table


def pid_running(pid) -> bool:
    """Alive and not a zombie (a pid of this process's PID namespace)."""
    entry = _stat(pid)
    return entry is not None and entry[1] not in _GONE


def command(pid) -> str:
    """`pid`'s command line, spaces for NULs, at most 200 characters ("?" once gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def live_children(table=None, parent: int | None = None) -> dict[int, str]:
    """{pid: command} of `parent`'s (default: this process's) children that are not
    zombies."""
    parent = os.getpid() if parent is None else parent
    table = process_table() if table is None else table
    return {pid: command(pid) for pid, (ppid, state) in table.items()
            if ppid == parent and state not in _GONE}


def tree(table, root: int | None = None) -> set[int]:
    """`root` (default: this process) and all its descendants in `table`."""
    found, grew = {os.getpid() if root is None else root}, True
    while grew:
        more = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return found


def maps(pid="self") -> list[tuple[int, int, str]]:
    """(start, end, path) of each mapping of `pid` (path "" when anonymous); [] once gone."""
    out = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi, fields[5].rstrip("\n") if len(fields) > 5 else ""))
    except OSError:
        pass
    return out


def fd_targets(pid="self") -> list[str]:
    """What each open descriptor of `pid` points to; [] once gone."""
    out = []
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in entries:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile (listdir's own descriptor, for one)
            pass
    return out


def fd_count() -> int:
    """Descriptors this process has open (less the one listing them)."""
    return len(os.listdir("/proc/self/fd")) - 1


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def vm_size_bytes() -> int:
    """This process's virtual address space."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmSize:")).split()[1]) * 1024


def shm_holders(names) -> dict[str, set[int]]:
    """{name: pids that map /dev/shm/<name> or hold it open}."""
    by_path = {os.path.join(SHM_DIR, name): name for name in names}
    holders: dict[str, set[int]] = {name: set() for name in names}
    for pid in pids():
        for path in [p for _, _, p in maps(pid)] + fd_targets(pid):
            if path in by_path:
                holders[by_path[path]].add(pid)
    return holders


MEMFD_TAG = "/memfd:poolloader"  # how /proc shows the memfd backend's segments


def memfd_segments(pid="self") -> dict[int, int]:
    """{inode: bytes} of the poolloader memfd segments `pid` maps (each mapped whole,
    so the largest mapping of an inode is its size); {} once gone."""
    out: dict[int, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) > 5 and fields[5].startswith(MEMFD_TAG):
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    inode = int(fields[4])
                    out[inode] = max(out.get(inode, 0), hi - lo)
    except OSError:
        pass
    return out


def memfd_allocated(pid="self") -> dict[int, int]:
    """{inode: bytes allocated} of the poolloader memfd segments `pid` maps: the pages
    that exist (a slot's pages are charged as written, not at creation), from
    st_blocks of /proc/<pid>/map_files/<range> (root, or CAP_SYS_ADMIN); where that
    cannot be read, the segment's size."""
    out: dict[int, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = [line.split(maxsplit=5) for line in f]
    except OSError:
        return out
    for fields in lines:
        if len(fields) > 5 and fields[5].startswith(MEMFD_TAG):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            inode = int(fields[4])
            try:
                allocated = os.stat(f"/proc/{pid}/map_files/{fields[0]}").st_blocks * 512
            except OSError:
                allocated = hi - lo
            out[inode] = max(out.get(inode, 0), allocated)
    return out


def memfd_holders(inodes) -> dict[int, set[int]]:
    """{inode: pids that map it or hold a descriptor of it}, over every process."""
    inodes = set(inodes)
    held: dict[int, set[int]] = {inode: set() for inode in inodes}
    for pid in pids():
        for inode in memfd_segments(pid):
            if inode in held:
                held[inode].add(pid)
        try:
            entries = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in entries:
            try:
                if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith(MEMFD_TAG):
                    continue
                inode = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
            except OSError:
                continue
            if inode in held:
                held[inode].add(pid)
    return held


def shmem_bytes() -> int:
    """The machine's shmem in use (/proc/meminfo Shmem): /dev/shm files and memfds."""
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("Shmem:")).split()[1]) * 1024


def wait_gone(pids, timeout: float) -> bool:
    """Wait (at most `timeout` s) until none of `pids` runs; whether none does."""
    import time
    deadline = time.monotonic() + timeout
    while any(pid_running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# what torch's TCPStore (and so torchrun's and accelerate's rendezvous) says, in lower
# case, when the port it was given is taken
_PORT_TAKEN = ("eaddrinuse", "address already in use")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago. Another process may take it
    before the caller's rendezvous binds it (nothing can hand a bound socket to a rank
    started later): `on_a_free_port` starts again then."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_a_free_port(run, failure):
    """`run(port)` on a free port, once more on a new one if `failure(result)` (its
    output when it failed, else "") says that port was taken meanwhile."""
    result = run(free_port())
    text = failure(result).lower()
    if any(words in text for words in _PORT_TAKEN):
        result = run(free_port())
    return result
