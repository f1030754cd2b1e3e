"""LoaderStats: plausible counters that answer "which side is the bottleneck?"."""
import mmap
import os
import signal
import time

import loader_datasets as ds
import pytest

from poolloader import PoolLoader
from poolloader.main import memory


def run(delay, consumer_delay):
    loader = PoolLoader(ds.SlowDataset(n=24, delay=delay), batch_size=2, num_workers=2,
                        persistent_workers=True)
    for _ in loader:
        time.sleep(consumer_delay)
    stats = loader.stats.as_dict()
    del loader
    return stats


def test_slow_workers_show_as_main_waiting_and_slow_consumer_as_worker_idle():
    slow_workers = run(delay=0.05, consumer_delay=0.0)
    slow_consumer = run(delay=0.0, consumer_delay=0.05)
    for stats in (slow_workers, slow_consumer):
        assert stats["batches"] == 12 and stats["worker_batches"] == 12
        assert stats["slot_count"] >= 6 and stats["slot_bytes"] >= 1 << 20
    # 24 samples × 50 ms = 1.2 s of work over 2 workers; main waits for most of it.
    # Ordering with margins, not ratios: a busy machine adds waits to both runs.
    assert slow_workers["worker_busy_s"] > 0.9
    assert slow_workers["main_wait_s"] > 0.3
    # compared past the first batch: the workers' start-up is a wait in both runs, and
    # a loaded machine can stretch one run's by more than the margin
    assert slow_workers["steady_wait_s"] > slow_consumer["steady_wait_s"] + 0.2
    # a slow consumer (12 × 50 ms) leaves the workers idle
    assert slow_consumer["worker_idle_s"] > 0.5
    assert slow_consumer["worker_idle_s"] > slow_workers["worker_idle_s"] + 0.2


def test_growth_counters():
    loader = PoolLoader(ds.BigDataset(n=12), batch_size=3, collate_fn=ds.pad_collate,
                        num_workers=1, slot_bytes=70_000)
    for _ in loader:
        pass
    assert loader.stats.slot_growths >= 1
    assert loader.stats.pool_growths == 0
    assert loader.stats.slot_count == 0  # the pool is gone after a non-persistent epoch
    grown, learned = loader.stats.slot_growths, loader.stats.learned_slot_bytes
    assert learned > 70_000
    for _ in loader:  # the next epoch's pool starts at the learned size: no regrowth
        pass
    assert loader.stats.slot_growths == grown
    assert loader.stats.worker_batches == 8  # both epochs' pools counted


# -- memory(): the workers' and main's memory, read from /proc on request -------------------

MIB = 1 << 20
HELD = []  # what worker_init_fn keeps alive in its worker


def hold_private_64mib_in_worker_0(worker_id):
    if worker_id == 0:  # 64 MiB written page by page: private, resident, this worker's only
        # a mapping of its own: malloc could reuse heap pages inherited from the pytest
        # process, shared until written, whose PSS share the worker already carried
        # (under xdist that heap holds what earlier tests left: PSS then grew by 34 MiB)
        block = mmap.mmap(-1, 64 * MIB)
        block.write(b"\x01" * (64 * MIB))
        HELD.append(block)


def _wait_gone(pid, timeout=10.0):
    """Until `pid` has exited (a zombie or gone), at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except OSError:
            return
        time.sleep(0.02)
    raise AssertionError(f"worker {pid} still running {timeout} s after SIGKILL")


def test_memory_lists_every_worker_with_positive_figures():
    loader = PoolLoader(ds.SlowDataset(n=12, delay=0.0), batch_size=2, num_workers=2,
                        persistent_workers=True)
    assert loader.stats.memory().workers == ()  # nothing iterated yet: no workers
    it = iter(loader)
    next(it)
    report = loader.stats.memory()
    assert [(w.worker_id, w.pid) for w in report.workers] == list(enumerate(it.worker_pids))
    for p in (*report.workers, report.main):
        assert p.uss > 0 and p.pss > 0 and p.shared > 0, p
        assert p.uss <= p.pss <= p.rss and p.uss + p.shared == p.rss, p
    assert report.main.pid == os.getpid()
    assert report.workers_uss == sum(w.uss for w in report.workers) > 0
    assert report.as_dict()["workers"][1]["pid"] == it.worker_pids[1]
    del it, loader


def test_memory_at_shutdown_is_read_as_the_workers_stop_and_only_if_asked():
    loader = PoolLoader(ds.SlowDataset(n=8, delay=0.0), batch_size=2, num_workers=2)
    for _ in loader:
        pass
    assert loader.stats.last_memory is None  # not asked: nothing read at shutdown
    loader.stats.memory_at_shutdown = True
    it = iter(loader)
    pids = it.worker_pids
    for _ in it:  # a non-persistent epoch's end stops its workers
        pass
    last = loader.stats.last_memory
    assert [(w.worker_id, w.pid) for w in last.workers] == list(enumerate(pids))
    assert last.workers_pss > 0 and last.main.pid == os.getpid()
    assert loader.stats.memory().workers == ()  # no live iterator now
    del it, loader


def test_memory_shows_what_one_worker_holds_privately():
    loader = PoolLoader(ds.SlowDataset(n=8, delay=0.0), batch_size=2, num_workers=2,
                        persistent_workers=True, worker_init_fn=hold_private_64mib_in_worker_0)
    it = iter(loader)
    next(it)
    next(it)  # both workers have run worker_init_fn (round robin)
    holder, other = loader.stats.memory().workers
    assert holder.worker_id == 0 and other.worker_id == 1
    # 64 MiB more unique memory, give or take the few pages the two workers differ by
    assert holder.uss - other.uss >= 64 * MIB - 2 * MIB, (holder, other)
    assert holder.pss - other.pss >= 64 * MIB - 2 * MIB, (holder, other)
    del it, loader


def test_memory_skips_a_worker_that_died():
    loader = PoolLoader(ds.SlowDataset(n=40, delay=0.0), batch_size=2, num_workers=2,
                        persistent_workers=True)
    it = iter(loader)
    next(it)
    pids = it.worker_pids
    os.kill(pids[1], signal.SIGKILL)  # a worker this test's loader started
    _wait_gone(pids[1])
    report = loader.stats.memory()  # no error: the dead worker is left out
    assert [(w.worker_id, w.pid) for w in report.workers] == [(0, pids[0])]
    assert report.main is not None
    # a pid that vanished between listing and reading reads as gone, not as an error
    assert memory.read_process(pids[1]) is None
    with pytest.raises(RuntimeError, match=str(pids[1])):
        for _ in it:
            pass
    del it, loader


def test_memory_sums_smaps_where_smaps_rollup_is_missing(tmp_path):
    """Linux < 4.14: the same figures from /proc/<pid>/smaps (here a copy of a real,
    idle worker's, in a procfs-shaped folder without smaps_rollup)."""
    loader = PoolLoader(ds.SlowDataset(n=4, delay=0.0), batch_size=2, num_workers=1,
                        persistent_workers=True)
    it = iter(loader)
    for _ in it:
        pass
    pid = it.worker_pids[0]  # idle: waiting for the next epoch's requests
    # Pages move between private and shared as other processes (other tests' too) map
    # or drop what the worker maps: take a smaps copy between two equal rollups.
    for _ in range(50):
        before = memory.read_process(pid)
        with open(f"/proc/{pid}/smaps") as f:
            smaps = f.read()
        rollup = memory.read_process(pid)
        if rollup == before:
            break
        time.sleep(0.05)
    (tmp_path / str(pid)).mkdir()
    (tmp_path / str(pid) / "smaps").write_text(smaps)
    summed = memory.read_process(pid, proc=str(tmp_path))
    del it, loader
    assert smaps.count("Pss:") > 10 and rollup is not None and summed is not None
    assert summed["uss"] + summed["shared"] == summed["rss"]
    # an idle process: the same within 1% or 1 MiB (pages may move between private and
    # shared between the two reads as main maps or drops what the worker also maps)
    for name in ("uss", "pss", "rss", "shared"):
        assert abs(summed[name] - rollup[name]) <= max(0.01 * rollup[name], MIB), \
            (name, summed, rollup)
    assert memory.read_process(pid + 10**7, proc=str(tmp_path)) is None
