"""Faults and limits: main killed, /dev/shm too small, access, several loaders, iterables."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import loader_datasets as ds
import proc
import pytest
import torch
from helpers import pid_running
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from poolloader import PoolLoader, ShmSpaceError

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_sigkill_of_main_workers_exit_and_unlink(backend):
    code = textwrap.dedent(f"""
        import sys, os, time
        sys.path.insert(0, {HERE!r})
        import loader_datasets as ds
        from poolloader import PoolLoader
        loader = PoolLoader(ds.PidDataset(n=10000, delay=0.01), batch_size=2, num_workers=2,
                            slot_bytes=1 << 16, shm_backend={backend!r})
        it = iter(loader)
        next(it)
        print(it.shm_prefix, *it.worker_pids, flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        assert line, "child produced no output"
        prefix, pids = line[0], [int(p) for p in line[1:]]
        assert (prefix == "None") == (backend == "memfd")  # memfd names nothing
        segments = {inode for pid in [child.pid, *pids] for inode in proc.memfd_segments(pid)}
        assert bool(segments) == (backend == "memfd")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        def leftovers():
            names = [n for n in os.listdir("/dev/shm") if ("/" + n).startswith(prefix)]
            alive = [p for p in pids if pid_running(p)]
            return names, alive
        while time.monotonic() < deadline and any(leftovers()):
            time.sleep(0.05)
        names, alive = leftovers()
        assert not names, f"names left after main was killed: {names}"
        assert not alive, f"workers still alive 5 s after main was killed: {alive}"
        # memfd: with main and its workers gone, no process holds the segments (freed)
        assert not any(proc.memfd_holders(segments).values())
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def test_shm_limit_is_a_clear_error_before_anything_is_written(monkeypatch):
    loader = PoolLoader(ds.AugmentDataset(), batch_size=2, num_workers=2, slot_bytes=1 << 20,
                        shm_limit=3 << 20)
    with pytest.raises(ShmSpaceError) as info:
        iter(loader)
    msg = str(info.value)
    assert "bytes" in msg and "shm_limit" in msg and str(3 << 20) in msg
    monkeypatch.setenv("POOLLOADER_SHM_LIMIT", str(2 << 20))
    with pytest.raises(ShmSpaceError, match="POOLLOADER_SHM_LIMIT"):
        iter(PoolLoader(ds.AugmentDataset(), batch_size=2, num_workers=2))


def test_growth_past_the_limit_is_a_clear_error():
    loader = PoolLoader(ds.BigDataset(), batch_size=4, collate_fn=ds.pad_collate, num_workers=1,
                        slot_bytes=70_000, shm_limit=2 << 20)
    with pytest.raises(ShmSpaceError, match="cap of"):
        for _ in loader:
            pass


def test_segments_are_private_and_exclusive():
    """A pool whose worker never maps its segments keeps every name: each is checked."""
    import posix_ipc

    from poolloader.shm.backends.posix import create_segment
    from poolloader.shm.pool import SlotPool
    pool = SlotPool(num_workers=1, slots=2, max_slots=2, slot_bytes=1 << 16, backend="posix")
    try:
        names = sorted(pool.live_names)
        assert len(names) == 3  # the control block and two slots, none acknowledged yet
        for name in names:
            assert stat.S_IMODE(os.stat("/dev/shm" + name).st_mode) == 0o600, name
            assert name.startswith(pool.prefix)
            with pytest.raises(posix_ipc.ExistentialError):
                create_segment(name, 4096, "test")  # O_EXCL: never reuses a name
        assert len(pool.prefix.split("-")[-1]) == 16  # 64 random bits
    finally:
        pool.close()
    assert not any(os.path.exists("/dev/shm" + n) for n in names)


def test_two_loaders_interleaved_do_not_interfere():
    a = PoolLoader(ds.AugmentDataset(n=30), batch_size=3, num_workers=2)
    b = PoolLoader(ds.SeedInfoDataset(), batch_size=2, num_workers=2)
    ia, ib = iter(a), iter(b)
    assert ia._pool.locator != ib._pool.locator
    got_a, got_b = [], []
    for _ in range(8):
        got_a.append(next(ia)["index"].tolist())
        got_b.append(next(ib)[:, 0].tolist())
    assert got_a == [[3 * k, 3 * k + 1, 3 * k + 2] for k in range(8)]
    assert got_b == [[2 * k, 2 * k + 1] for k in range(8)]


class ShardedIterable(IterableDataset):
    """Uneven shards: worker w yields w*3+1 items; some workers may get none."""

    def __init__(self, n=17):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, self.n, nw + 1):  # the last share is never read: uneven
            yield torch.tensor([i, wid]) + torch.rand(2) * 0


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_iterable_parity(workers, batch_size):
    out = []
    for cls in (DataLoader, PoolLoader):
        torch.manual_seed(0)
        loader = cls(ShardedIterable(), batch_size=batch_size, num_workers=workers,
                     persistent_workers=True)
        out.append([[b.tolist() for b in loader] for _epoch in range(2)])
        del loader
    assert out[0] == out[1]


class OneHugeSample(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.zeros((4 << 20) if i == 5 else 4)  # item 5: 16 MiB


def test_growth_refused_stops_the_iterator_instead_of_hanging():
    loader = PoolLoader(OneHugeSample(), batch_size=None, num_workers=2, slot_bytes=1 << 20,
                        shm_limit=12 << 20)
    it = iter(loader)
    with pytest.raises(ShmSpaceError):
        for _ in it:
            pass
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="shut down by the error raised before"):
        next(it)
    assert time.monotonic() - t0 < 5.0  # a hang blocks for good; margin for a loaded machine
