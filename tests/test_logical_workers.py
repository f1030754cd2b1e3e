"""node_workers=P: P processes host the num_workers logical workers, and every batch is
bit-identical to DataLoader(num_workers)'s (issue 31's foundation, docs/guide.md).

Real worker processes over real shared memory; DataLoader runs the same body as the
reference (tests/compare.py). The datasets (tests/logical_datasets.py) draw from torch,
numpy and random in worker_init_fn and per sample, and worker_init_fn changes its
worker's copy of the dataset, so a logical worker that ran with another's RNG, dataset
copy or WorkerInfo gives different bits."""
from __future__ import annotations

import gc
import os
import signal
import time

import logical_datasets as lds
import proc
import pytest
import torch
from compare import assert_same, both_loaders
from torch.utils.data import DataLoader

from poolloader import PoolLoader, WorkerDied

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]  # more workers than cores


def _node(cls, node_workers):
    return {"node_workers": node_workers} if cls is PoolLoader else {}


def _epochs(n):
    return lambda loader: [list(loader) for _ in range(n)]


def _parity(make, epochs=2):
    ref, got = both_loaders(make, _epochs(epochs))
    assert len(ref) == len(got)
    for e, (a, b) in enumerate(zip(ref, got)):
        assert len(a) == len(b), f"epoch {e}: {len(a)} batches != {len(b)}"
        assert_same(a, b, f"epoch{e}")
    return got


@pytest.mark.parametrize("workers,node", [(4, 1), (4, 2), (3, 2)])
@pytest.mark.parametrize("persistent", [False, True])
def test_map_parity_fork(workers, node, persistent):
    got = _parity(lambda cls: cls(
        lds.InitAugmentDataset(), batch_size=3, shuffle=True, num_workers=workers,
        worker_init_fn=lds.augment_init, persistent_workers=persistent,
        multiprocessing_context="fork", **_node(cls, node)))
    # every logical worker ran its own worker_init_fn on its own copy of the dataset
    seen = {(int(w), int(i)) for b in got[0] for w, i in zip(b["worker"], b["init_worker"])}
    assert seen == {(w, w) for w in range(workers)}


def test_growth_resend_and_stats():
    # slots far too small: every logical worker's first batch asks for a bigger slot
    # and its host writes the payload it kept for that worker; stats count per worker
    loaders = []

    def make(cls):
        extra = {"slot_bytes": 4096, "node_workers": 2} if cls is PoolLoader else {}
        loaders.append(cls(lds.InitAugmentDataset(shape=(3, 40, 41)), batch_size=4,
                           shuffle=True, num_workers=4, worker_init_fn=lds.augment_init,
                           multiprocessing_context="fork", **extra))
        return loaders[-1]
    got = _parity(make, epochs=1)
    stats = loaders[-1].stats
    assert stats.worker_batches == len(got[0]) and stats.slot_growths >= 1, stats


def test_stall_report_names_logical_worker_and_host_pid():
    loader = PoolLoader(lds.InitAugmentDataset(n=12, sleep_at=3, sleep_s=4.0), batch_size=1,
                        num_workers=4, node_workers=2, timeout=1.5,
                        multiprocessing_context="fork")
    it = iter(loader)
    try:
        for _ in range(3):
            next(it)
        with pytest.raises(RuntimeError, match="timed out after 1.5 seconds") as info:
            next(it)  # batch 3: logical worker 3, in the second process
        host = it.worker_pids[1]
    finally:
        it._shutdown_workers()
    message = str(info.value)
    assert f"worker 3 (pid {host}): on batch 3" in message, message
    # worker 1 shares that process: it waits its turn, it is not stuck on its own batch
    assert (f"worker 1 (pid {host}): waiting for its process, which is on worker 3's "
            "batch 3") in message, message
    del it, info
    gc.collect()


def test_map_parity_spawn_uneven():
    _parity(lambda cls: cls(
        lds.InitAugmentDataset(n=17), batch_size=2, shuffle=True, num_workers=3,
        worker_init_fn=lds.augment_init, persistent_workers=True,
        multiprocessing_context="spawn", **_node(cls, 2)))


def test_out_of_order_every_batch_once():
    # in_order=False: which worker gets which batch depends on timing, in DataLoader too
    # (a request goes to a worker with fewer tasks in flight), so only the batches'
    # samples are compared; each once, in the batches DataLoader makes
    ref, got = both_loaders(lambda cls: cls(
        lds.InitAugmentDataset(), batch_size=3, num_workers=4, in_order=False,
        worker_init_fn=lds.augment_init, multiprocessing_context="fork", **_node(cls, 2)),
        _epochs(1))
    assert (sorted(b["index"].tolist() for b in ref[0])
            == sorted(b["index"].tolist() for b in got[0]))


@pytest.mark.parametrize("workers,node", [(4, 2), (3, 2)])
def test_iterable_sharded_by_worker(workers, node):
    got = _parity(lambda cls: cls(
        lds.ShardedStream(), batch_size=2, num_workers=workers, worker_init_fn=lds.shard_init,
        persistent_workers=True, multiprocessing_context="fork", **_node(cls, node)))
    indices = sorted(int(i) for b in got[0] for i in b["i"])
    assert indices == list(range(23))  # each sample once: every worker iterated its own shard


def _rest_after_resume(k, saved_node, loaded_node, workers=4):
    """Batches k.. of an epoch: DataLoader uninterrupted, and a PoolLoader whose state was
    saved at batch k with node_workers=saved_node and loaded with loaded_node."""
    def make(cls, node):
        return cls(lds.InitAugmentDataset(), batch_size=3, shuffle=True, num_workers=workers,
                   worker_init_fn=lds.augment_init, multiprocessing_context="fork",
                   generator=torch.Generator().manual_seed(5), **_node(cls, node))

    ref, _ = both_loaders(lambda cls: make(DataLoader, None), _epochs(1))
    torch.manual_seed(77)
    first = make(PoolLoader, saved_node)
    it = iter(first)
    for _ in range(k):
        next(it)
    state = first.state_dict()
    del it, first
    gc.collect()
    torch.manual_seed(99)  # another global state: the loaded one must not matter
    second = make(PoolLoader, loaded_node)
    second.load_state_dict(state)
    return ref[0][k:], list(second)


@pytest.mark.parametrize("saved,loaded", [(2, 1), (1, None), (None, 2)])
def test_resume_across_node_workers(saved, loaded):
    ref, got = _rest_after_resume(4, saved, loaded)
    assert len(ref) == len(got) and len(ref) > 0
    assert_same(ref, got)


def test_exactly_node_workers_processes():
    before = set(proc.live_children(parent=os.getpid()))  # e.g. multiprocessing's resource tracker
    loader = PoolLoader(lds.InitAugmentDataset(), batch_size=3, num_workers=4, node_workers=2,
                        multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    children = set(proc.live_children(parent=os.getpid())) - before
    pids = it.worker_pids
    it._shutdown_workers()
    del it
    assert len(pids) == 2 and sorted(children) == sorted(pids), (children, pids)
    gc.collect()


def test_killed_host_is_worker_died_naming_its_pid():
    loader = PoolLoader(lds.InitAugmentDataset(n=60), batch_size=2, num_workers=4,
                        node_workers=2, multiprocessing_context="fork", persistent_workers=True)
    it = iter(loader)
    try:
        next(it)
        victim = it.worker_pids[1]  # hosts logical workers 1 and 3
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            for _ in range(100):
                next(it)
        waited = time.monotonic() - t0
    finally:
        it._shutdown_workers()
    message = str(info.value)
    assert f"pid {victim}" in message and "signal 9" in message, message
    assert "hosting workers 1, 3" in message, message
    assert waited < 2.0, f"WorkerDied came {waited:.2f} s after the kill"
    del it, info
    gc.collect()


def _cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_idle_host_sleeps():
    # persistent workers between epochs: every host waits on its doorbell, in the kernel
    loader = PoolLoader(lds.InitAugmentDataset(n=12), batch_size=3, num_workers=4,
                        node_workers=2, multiprocessing_context="fork", persistent_workers=True)
    try:
        list(loader)
        pids = loader._iterator.worker_pids
        before = [_cpu_ticks(p) for p in pids]
        time.sleep(1.0)
        used = [_cpu_ticks(p) - b for p, b in zip(pids, before)]
        assert all(u <= 10 for u in used), f"idle hosts used {used} clock ticks in 1 s"
        assert len(list(loader)) == 4  # and they wake for the next epoch
    finally:
        loader._iterator._shutdown_workers()
        loader._iterator = None
    gc.collect()


def test_uncopyable_dataset_is_a_clear_error():
    loader = PoolLoader(lds.LockedDataset(), batch_size=2, num_workers=2, node_workers=1,
                        multiprocessing_context="fork")
    with pytest.raises(TypeError) as info:
        list(loader)
    message = str(info.value)
    assert "LockedDataset" in message and "node_workers=None" in message, message
    assert "lock" in message, message
    del info
    gc.collect()


@pytest.mark.parametrize("value", [0, 5, True, 1.5, "2"])
def test_node_workers_must_be_in_range(value):
    with pytest.raises(ValueError, match=f"node_workers={value!r}.*num_workers=4"):
        PoolLoader(lds.InitAugmentDataset(), num_workers=4, node_workers=value)
    with pytest.raises(ValueError, match="num_workers=0"):
        PoolLoader(lds.InitAugmentDataset(), node_workers=1)


def test_node_workers_equal_to_num_workers_is_the_default_path():
    # one process per worker: no request doorbells, each worker waits on its own ring
    loader = PoolLoader(lds.InitAugmentDataset(n=6), batch_size=3, num_workers=2,
                        node_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    try:
        assert it._pool.control.request_doorbells == []
        assert len(it.worker_pids) == 2 and len(list(it)) == 2
    finally:
        it._shutdown_workers()
    del it
    gc.collect()
