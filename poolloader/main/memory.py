"""How much memory the loader's processes hold, read from /proc on request
(LoaderStats.memory(); never on the per-batch path), and how much of the pool's
reserved bytes are resident (SlotPool.resident_bytes: mincore over each slot).

Per process: USS (unique: Private_Clean + Private_Dirty, what exiting it would free),
PSS (proportional: each shared page divided among the processes that map it, so the
PSS of all processes adds up to what they hold together), RSS (resident, shared pages
counted in full in every process) and shared (Shared_Clean + Shared_Dirty). Linux 4.14+
sums them in /proc/<pid>/smaps_rollup; older kernels have only /proc/<pid>/smaps, whose
per-mapping lines are summed here. A process that has exited (or whose /proc cannot be
read) is skipped: reading is one bounded read of a /proc file per process, no wait.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# smaps(_rollup) field -> ProcessMemory attribute (values in kB there, bytes here)
_FIELDS = {"Rss": "rss", "Pss": "pss", "Shared_Clean": "shared", "Shared_Dirty": "shared",
           "Private_Clean": "uss", "Private_Dirty": "uss"}


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory in bytes, as its smaps said when read."""

    pid: int
    uss: int
    pss: int
    rss: int
    shared: int


@dataclass(frozen=True)
class WorkerMemory(ProcessMemory):
    """A worker's memory; `worker_id` as get_worker_info().id in that worker."""

    worker_id: int = -1


@dataclass(frozen=True)
class MemoryReport:
    """The memory of one loader's live workers and of the main process, read at once.

    `workers` lists the workers that were alive and readable (an exited one is left
    out, so len(workers) may be below num_workers); `main` is None only if the main
    process's own /proc could not be read. Totals are sums over `workers`."""

    workers: tuple[WorkerMemory, ...]
    main: ProcessMemory | None
    # the live pool's slots: bytes whose pages exist now (what a memory cgroup is
    # charged for them: written by a batch, not yet returned) and bytes reserved
    # (the slots' sizes); both 0 without a live pool
    pool_resident: int = 0
    pool_reserved: int = 0

    def _sum(self, field: str) -> int:
        return sum(getattr(w, field) for w in self.workers)

    workers_uss = property(lambda self: self._sum("uss"), doc="USS summed over the workers")
    workers_pss = property(lambda self: self._sum("pss"), doc="PSS summed over the workers")
    workers_rss = property(lambda self: self._sum("rss"), doc="RSS summed over the workers")
    workers_shared = property(lambda self: self._sum("shared"),
                              doc="`shared` summed over the workers")

    def as_dict(self) -> dict:
        def one(p: ProcessMemory) -> dict:
            return {"pid": p.pid, "uss": p.uss, "pss": p.pss, "rss": p.rss, "shared": p.shared}
        return {"workers": [dict(one(w), worker_id=w.worker_id) for w in self.workers],
                "main": None if self.main is None else one(self.main),
                "workers_uss": self.workers_uss, "workers_pss": self.workers_pss,
                "workers_rss": self.workers_rss, "workers_shared": self.workers_shared,
                "pool_resident": self.pool_resident, "pool_reserved": self.pool_reserved}

    def line(self) -> str:
        """One line for a summary: the workers' USS and PSS sums, main's USS and PSS."""
        text = (f"{len(self.workers)} worker{'' if len(self.workers) == 1 else 's'} "
                f"USS {_mib(self.workers_uss)}, PSS {_mib(self.workers_pss)} (sums)")
        if self.main is not None:
            text += f"; main USS {_mib(self.main.uss)}, PSS {_mib(self.main.pss)}"
        if self.pool_reserved:
            text += (f"; pool {_mib(self.pool_resident)} resident of "
                     f"{_mib(self.pool_reserved)} reserved")
        return text


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def parse_smaps(text: str) -> dict[str, int]:
    """{uss, pss, rss, shared} in bytes from the text of smaps_rollup or smaps (every
    mapping's lines summed: smaps_rollup has one block, smaps one per mapping)."""
    totals = dict.fromkeys(("uss", "pss", "rss", "shared"), 0)
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        name = _FIELDS.get(key)
        if name is None or not sep:
            continue
        value = rest.split()
        if len(value) == 2 and value[1] == "kB" and value[0].isdigit():
            totals[name] += int(value[0]) * 1024
    return totals


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def read_process(pid: int, proc: str = "/proc") -> dict[str, int] | None:
    """{uss, pss, rss, shared} of `pid` in bytes, or None if it is gone or unreadable
    (exited, a zombie whose mappings are gone, another user's). `proc`: where procfs is."""
    try:
        text = _read(f"{proc}/{pid}/smaps_rollup")
    except FileNotFoundError:
        if not os.path.isdir(f"{proc}/{pid}"):
            return None
        try:  # Linux < 4.14: no smaps_rollup, sum smaps
            text = _read(f"{proc}/{pid}/smaps")
        except OSError:
            return None
    except OSError:  # ProcessLookupError, PermissionError, ESRCH while it exits
        return None
    if not text.strip():  # a zombie: its mappings are gone
        return None
    return parse_smaps(text)


def report(workers: list[tuple[int, int]], proc: str = "/proc",
           pool: tuple[int, int] = (0, 0)) -> MemoryReport:
    """A MemoryReport of `workers` ((worker_id, pid) of each live worker, in id order)
    and of this process; `pool`: the live pool's (resident, reserved) bytes."""
    found = []
    for worker_id, pid in workers:
        figures = read_process(pid, proc)
        if figures is not None:
            found.append(WorkerMemory(pid=pid, worker_id=worker_id, **figures))
    own = read_process(os.getpid(), proc)
    main = None if own is None else ProcessMemory(pid=os.getpid(), **own)
    return MemoryReport(tuple(found), main, *pool)
