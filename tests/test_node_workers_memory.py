"""PoolLoader(node_workers=P) costs what DataLoader(num_workers) costs: under fork the
logical workers of one process keep the dataset's arrays one copy, as DataLoader's
forked workers share main's (the ones after the first of each process map the start
payload copy-on-write, poolloader.main.startup), and the rationality warning counts
the P processes. A node process that fails for a live rank (here: it cannot open the
rank's pool, EMFILE) says so, on stderr and in every rank's WorkerDied, at once.

Real worker processes; memory read from /proc/<pid>/smaps_rollup (Pss: the process's
share of every page it maps; Private: pages no other process maps)."""
from __future__ import annotations

import os
import warnings

import numpy as np
import test_node_pool
import torch
from compare import assert_same, both_loaders
from torch.utils.data import Dataset, get_worker_info

from poolloader import PoolLoader

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
TABLE_MIB = 64
WORKERS = 4
BATCHES = 8  # 2 a logical worker: each has read the whole table by then


class Table(Dataset):
    """A 64 MiB table each item reads whole; worker_init_fn writes its worker id into the
    first row of its own copy, which each item reports: a write shared between logical
    workers shows in the batches."""

    def __init__(self):
        self.table = np.random.default_rng(3).random(TABLE_MIB * MiB // 8).reshape(-1, 1024)

    def __len__(self):
        return BATCHES

    def __getitem__(self, i):
        return torch.tensor([float(self.table.sum()), i]), torch.from_numpy(self.table[0, :4].copy())


def mark_copy(worker_id):
    get_worker_info().dataset.table[0, :4] = worker_id


def _rollup(pid: int) -> dict[str, int]:
    """smaps_rollup's fields of `pid`, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def _workers_memory(loader) -> tuple[list, dict[str, int]]:
    """An epoch's first BATCHES batches, and the worker processes' memory summed (Pss,
    Private) with the iterator still alive."""
    it = iter(loader)
    batches = [next(it) for _ in range(BATCHES)]
    pids = it.worker_pids if isinstance(loader, PoolLoader) else [w.pid for w in it._workers]
    rollups = [_rollup(pid) for pid in pids]
    memory = {"processes": len(pids), "Pss": sum(r["Pss"] for r in rollups),
              "Private": sum(r["Private_Clean"] + r["Private_Dirty"] for r in rollups)}
    return batches, memory


def test_node_workers_under_fork_keep_the_arrays_one_copy():
    """One process hosting 4 logical workers: before, the 3 after the first each deep-
    copied the table (Pss and Private about 3 × 64 MiB above DataLoader's 4 workers)."""
    dataset = Table()
    (theirs, dl), (ours, pl) = both_loaders(lambda cls: cls(
        dataset, batch_size=1, num_workers=WORKERS, worker_init_fn=mark_copy,
        multiprocessing_context="fork",
        **({"node_workers": 1} if cls is PoolLoader else {})), _workers_memory)
    assert_same(ours, theirs)  # each logical worker wrote into its own copy only
    assert [int(b[1][0, 0]) for b in ours] == [i % WORKERS for i in range(BATCHES)]
    assert (dl["processes"], pl["processes"]) == (WORKERS, 1)
    table = TABLE_MIB * MiB
    # no copy of the table is private to the process (DataLoader's workers: none either)
    assert pl["Private"] < table // 2, (pl, dl)
    # and its share of every page it maps is no more than DataLoader's 4 workers' (they
    # map the table, inherited, and the process maps it twice: inherited and the payload)
    assert pl["Pss"] <= dl["Pss"] + table // 2, (pl, dl)


def test_rationality_warning_counts_processes():
    """More logical workers than CPUs in fewer processes: no warning; more processes
    than CPUs: DataLoader's warning, naming the processes."""
    cpus = len(os.sched_getaffinity(0))

    def warned(node_workers) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = PoolLoader(list(range(8)), batch_size=2, num_workers=cpus + 2,
                                node_workers=node_workers, multiprocessing_context="fork")
            it = iter(loader)
            next(it)
            del it
        return [str(w.message) for w in caught if "worker processes in total" in str(w.message)]

    assert warned(1) == []
    messages = warned(cpus + 1)  # at construction and at iter(), as DataLoader's
    assert messages and all(f"will create {cpus + 1} worker processes" in m for m in messages)
    loader = PoolLoader(list(range(4)), num_workers=cpus + 2, node_workers=cpus + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader.check_worker_number_rationality()
    assert loader.num_workers == cpus + 2  # the check counted processes, and put it back


def test_a_pool_the_node_process_cannot_open_is_the_live_rank_s_error_at_once(tmp_path, monkeypatch):
    """Rank 0's pool cannot be opened by the node process (its RLIMIT_NOFILE lowered below
    its lowest free descriptor: EMFILE). Before, the process took that for "rank gone",
    dropped the rank and went on: next() waited its whole timeout (30 s), and an OSError
    raised later ended the process silently (exit 0) and read as a possible OOM kill."""
    monkeypatch.setattr(test_node_pool, "CHILD", os.path.join(HERE, "_node_workers_children.py"))
    results, codes, text = test_node_pool._ranks(tmp_path, "emfile", 2)
    assert codes == [0, 0], text
    result = results[0]
    error = result["error"] or ""
    assert error.startswith("WorkerDied: "), (result, text)
    assert "Too many open files" in error and "killed for memory" not in error, error
    assert result["seconds"] < 10, result  # at once, not after timeout=30
    # the node process's traceback, on its stderr: the hosting rank's, whose child it is
    # (the first rank to build the loader: either)
    assert "Traceback (most recent call last)" in text and "[Errno 24]" in text, text

