"""A fresh memory cgroup per measured arm: memory as a container counts it.

A container's limit (Docker --memory, a Kubernetes limit, SLURM) kills by its
cgroup's charge: anonymous memory, shmem (tmpfs, /dev/shm, memfd) and the page cache
its processes caused. A PSS sum counts only pages some process maps; batches that
sit in a queue unmapped (DataLoader's) and reserved segment pages are missed. So an
arm runs with every process it starts inside a memory cgroup of its own, made below
this process's, and what the arm cost is that cgroup's peak charge (v1
memory.max_usage_in_bytes, v2 memory.peak, Linux 5.19+) plus a breakdown of the
charge at the end (memory.stat: anon, shmem, file).

`MemoryCgroup.make(label)` gives (cgroup, None) or (None, why not): no controller,
not root, no memory.peak on v2. The arm's processes join through `preexec` (the
child writes its pid into cgroup.procs before exec); `close()` waits (bounded) for
the cgroup to empty, moves any straggler to the parent cgroup and removes it.
"""
from __future__ import annotations

import os
import time

MIB = 1 << 20


def _own_memory_cgroup() -> tuple[str, str, bool] | None:
    """(mount, own path, is_v1) of this process's memory cgroup, or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.split(":", 2) for line in f.read().splitlines()]
    except OSError:
        return None
    v1 = [path for _, controllers, path in lines if "memory" in controllers.split(",")]
    if v1:
        return "/sys/fs/cgroup/memory", v1[0], True
    own = next((path for hid, _, path in lines if hid == "0"), None)
    return (None if own is None else ("/sys/fs/cgroup", own, False))


class MemoryCgroup:
    def __init__(self, path: str, v1: bool, parent: str):
        self.path = path
        self.v1 = v1
        self.parent = parent

    @classmethod
    def make(cls, label: str, limit: int | None = None):
        """(MemoryCgroup, None), or (None, why one cannot be made here)."""
        found = _own_memory_cgroup()
        if found is None:
            return None, "no memory cgroup controller in /proc/self/cgroup"
        mount, own, v1 = found
        parent = os.path.join(mount, own.lstrip("/"))
        if not os.path.isdir(parent):  # in a cgroup namespace: the mount's root is ours
            parent = mount
        if not v1 and not os.path.exists(os.path.join(parent, "memory.max")) \
                and parent != mount:
            return None, f"cgroup v2 {parent} has no memory controller for its children"
        path = os.path.join(parent, f"plbench-{label}-{os.getpid()}-{time.monotonic_ns() % 10**9}")
        try:
            os.mkdir(path)
        except OSError as e:
            return None, f"a memory cgroup cannot be made in {parent} (needs root): {e}"
        group = cls(path, v1, parent)
        if not v1 and not os.path.exists(os.path.join(path, "memory.peak")):
            group.close()
            return None, "cgroup v2 without memory.peak (Linux < 5.19): no peak charge to read"
        if limit is not None:
            name = "memory.limit_in_bytes" if v1 else "memory.max"
            try:
                with open(os.path.join(path, name), "w") as f:
                    f.write(str(limit))
            except OSError as e:
                group.close()
                return None, f"{name} cannot be set in {path}: {e}"
        return group, None

    def preexec(self):
        """A subprocess preexec_fn: the child joins this cgroup before exec."""
        procs = os.path.join(self.path, "cgroup.procs")

        def join():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return join

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def peak(self) -> int:
        """The highest charge since the cgroup was made, in bytes."""
        return int(self._read("memory.max_usage_in_bytes" if self.v1 else "memory.peak"))

    def current(self) -> int:
        return int(self._read("memory.usage_in_bytes" if self.v1 else "memory.current"))

    def stat(self) -> dict:
        """memory.stat's charge by kind, bytes: anon, shmem, file (page cache, shmem
        excluded), kernel (v2 only)."""
        raw = {}
        for line in self._read("memory.stat").splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                raw[key] = int(value)
        if self.v1:  # v1's rss is anonymous (shmem counts as cache)
            return {"anon": raw.get("total_rss", raw.get("rss", 0)),
                    "shmem": raw.get("total_shmem", raw.get("shmem", 0)),
                    "file": raw.get("total_cache", raw.get("cache", 0))
                    - raw.get("total_shmem", raw.get("shmem", 0))}
        return {"anon": raw.get("anon", 0), "shmem": raw.get("shmem", 0),
                "file": raw.get("file", 0) - raw.get("shmem", 0),
                "kernel": raw.get("kernel", 0)}

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def close(self, wait_s: float = 10.0) -> None:
        """Remove the cgroup: wait up to `wait_s` for its processes to exit, move any
        left to the parent (they are the caller's to end), then rmdir."""
        deadline = time.monotonic() + wait_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in self.pids():
            try:
                with open(os.path.join(self.parent, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except OSError:
                pass
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        os.rmdir(self.path)
