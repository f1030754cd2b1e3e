"""Where users train: a container's small /dev/shm, memory given back, nothing named.

The default (memfd) backend puts slots in anonymous shared memory: no /dev/shm space,
no names, freed by the kernel when the last process holding a segment dies. These
tests run real loaders: in a private mount namespace with Docker's default 64 MiB
/dev/shm (skipped, with the reason, where `unshare -m` is not permitted), under
SIGKILL of every process, and with a consumer that keeps and drops many batches.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys

import proc
import pytest
import torch
from helpers import communicate_within, wait_until

from poolloader import PoolLoader

HERE = os.path.dirname(os.path.abspath(__file__))
CHILDREN = os.path.join(HERE, "_container_children.py")
SMALL_SHM = "64m"


def _unshare_reason() -> str | None:
    """None if this process may run a child with its own 64 MiB /dev/shm; else why not."""
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={SMALL_SHM} tmpfs /dev/shm"],
            capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare -m cannot run here: {e}"
    if probe.returncode:
        return f"a private /dev/shm needs root (unshare -m, mount): {probe.stderr.strip()}"
    return None


def test_rfdetr_batches_with_8_workers_in_a_64_mib_dev_shm():
    """The stock container case: PoolLoader trains, the POSIX backend fails at once with
    the knob to turn, DataLoader fails (its worker cannot allocate shared memory)."""
    reason = _unshare_reason()
    if reason:
        pytest.skip(reason)
    child = subprocess.Popen(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs -o size={SMALL_SHM} tmpfs /dev/shm && exec {sys.executable} {CHILDREN} small-shm"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_within(child, 300, "the 64 MiB /dev/shm child")
    assert child.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    print(result)
    assert result["shm_bytes"] == 64 << 20
    assert result["pool_batch_bytes"] > 64 << 20  # one batch alone would not fit /dev/shm
    assert "mismatch" not in result and result["pool_batches"] == 16
    assert result["pool_names_seen"] == []  # nothing named while it ran
    assert result["posix"].startswith("ShmSpaceError") and "--shm-size" in result["posix"]
    assert result["posix_s"] < 30
    assert result["dataloader"] != "ran", "DataLoader was expected to fail in a 64 MiB /dev/shm"
    assert result["dataloader_s"] < 60


def _names_of(pids) -> list[str]:
    """/dev/shm names that `pids` hold or that carry one of them (other tests and jobs on
    this host make names of their own meanwhile)."""
    names = os.listdir("/dev/shm")
    held = {name for name, holders in proc.shm_holders(names).items() if holders & set(pids)}
    return sorted(held | {n for n in names if any(f"-{pid}-" in n for pid in pids)})


def test_sigkill_of_main_and_every_worker_leaves_nothing_and_frees_the_memory():
    child = subprocess.Popen([sys.executable, CHILDREN, "hold"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = child.stdout.readline()  # bounded: the child exits by itself after 60 s
        assert line.startswith("READY"), (line, child.stderr.read()[-3000:] if child.poll() else "")
        pids = [int(p) for p in line.split()[1:]]
        segments: dict[int, int] = {}
        for pid in pids:
            segments.update(proc.memfd_segments(pid))
        pool_bytes = sum(segments.values())
        assert len(segments) >= 3 and pool_bytes >= 3 * (8 << 20), segments
        assert _names_of(pids) == []  # nothing named
        shmem_before = proc.shmem_bytes()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert wait_until(lambda: not any(proc.pid_running(p) for p in pids), 10.0)
        # the kernel frees a memfd with its last holder: nobody holds any of them
        holders = proc.memfd_holders(segments)
        assert not any(holders.values()), holders
        # and the memory came back (other processes may allocate meanwhile: a margin)
        assert wait_until(lambda: shmem_before - proc.shmem_bytes() >= 0.75 * pool_bytes, 10.0), (
            shmem_before, proc.shmem_bytes(), pool_bytes)
        assert _names_of(pids) == []
    finally:
        for pid in pids:
            if proc.pid_running(pid):
                os.kill(pid, signal.SIGKILL)
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=10)


class FourMiB(torch.utils.data.Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        return torch.full((1 << 20,), i, dtype=torch.int32)  # 4 MiB


def _distinct_shared_bytes(pids) -> tuple[int, int]:
    """(bytes, segments) of the distinct memfd segments that `pids` map together."""
    seen: dict[int, int] = {}
    for pid in pids:
        seen.update(proc.memfd_segments(pid))
    return sum(seen.values()), len(seen)


def test_held_then_dropped_batches_give_their_memory_back_in_every_process():
    """8 workers; the consumer keeps 60 batches of 4 MiB (the pool holds 18: 42 detach),
    drops them, takes 40 more: main and the workers together map at most 1.25× the pool."""
    loader = PoolLoader(FourMiB(), batch_size=1, num_workers=8, slot_bytes=5 << 20)
    it = iter(loader)
    kept = [next(it) for _ in range(60)]
    assert [int(b[0, 0]) for b in kept] == list(range(60))
    assert loader.stats.detaches >= 40 and loader.stats.detached_bytes > 0
    held_while_kept = loader.stats.detached_bytes
    del kept
    for k in range(40):
        batch = next(it)
        assert int(batch[0, 0]) == 60 + k
        del batch
    gc.collect()
    pids = [os.getpid()] + it.worker_pids
    pool_bytes = loader.stats.pool_bytes
    # workers drop a segment that left the pool at their next sync (a request, or their
    # idle tick): bounded
    ok = wait_until(lambda: _distinct_shared_bytes(pids)[0] <= 1.25 * pool_bytes, 5.0)
    mapped, segments = _distinct_shared_bytes(pids)
    print(f"pool {pool_bytes / 2**20:.1f} MiB in {loader.stats.slot_count} slots; mapped "
          f"{mapped / 2**20:.1f} MiB in {segments} segments; held while kept "
          f"{held_while_kept / 2**20:.1f} MiB")
    assert ok, (mapped, segments, pool_bytes)
    assert loader.stats.detached_bytes == 0
    del it
