"""Worker start-up under spawn and forkserver (poolloader.worker.startup): the dataset,
worker_init_fn and collate_fn are pickled once per iterator, not once per worker, and
main's shared copy is released once every worker has loaded it."""
from __future__ import annotations

import multiprocessing
import os
import time

import proc
import pytest
import torch
from compare import assert_same
from torch.utils.data import DataLoader, Dataset, get_worker_info

from poolloader import PoolLoader


class CountedPickles(Dataset):
    """Counts how often main pickles it (a class attribute: pickling runs in main)."""

    pickled = 0

    def __init__(self, n: int = 48):
        self.n = n
        self.state = [f"img_{i:06d}.jpg" for i in range(n)]  # some Python state

    def __getstate__(self):
        type(self).pickled += 1
        return self.__dict__

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, len(self.state[i])]), torch.initial_seed() % 1000


def seed_init(worker_id):
    torch.manual_seed(1000 + worker_id)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_dataset_is_pickled_once_per_iterator_and_batches_match_dataloader(method):
    ctx = multiprocessing.get_context(method)
    workers = 2  # DataLoader pickles twice, PoolLoader once: a third spawn adds ~2 s, no check
    results = {}
    for cls in (DataLoader, PoolLoader):
        CountedPickles.pickled = 0
        torch.manual_seed(7)
        loader = cls(CountedPickles(), batch_size=4, num_workers=workers,
                     multiprocessing_context=ctx, worker_init_fn=seed_init)
        results[cls] = (list(loader), CountedPickles.pickled)
    assert results[DataLoader][1] == workers  # DataLoader: once per worker
    assert results[PoolLoader][1] == 1  # PoolLoader: once
    assert_same(results[DataLoader][0], results[PoolLoader][0])


def test_a_posix_pool_s_start_arguments_travel_with_each_worker_not_through_proc():
    """shm_backend="posix" is the way out where workers cannot open /proc/<main>/fd:
    its workers' start arguments must not need /proc either, so they travel as
    DataLoader's do (pickled once per worker), not through main's memfd. Under
    forkserver only: spawn pickles the start arguments with each worker's Process the
    same way (the test above runs both)."""
    ctx = multiprocessing.get_context("forkserver")
    results = {}
    for cls, options in ((DataLoader, {}), (PoolLoader, {"shm_backend": "posix"})):
        CountedPickles.pickled = 0
        torch.manual_seed(7)
        loader = cls(CountedPickles(), batch_size=4, num_workers=2,
                     multiprocessing_context=ctx, worker_init_fn=seed_init, **options)
        it = iter(loader)
        held = proc.fd_targets()  # main keeps a shared start until every worker replied
        results[cls] = (list(it), CountedPickles.pickled)
        assert not any(target.startswith("/memfd:poolloader-start") for target in held), held
    assert results[PoolLoader][1] == results[DataLoader][1] == 2
    assert_same(results[DataLoader][0], results[PoolLoader][0])


def test_the_shared_start_is_released_once_every_worker_has_replied():
    loader = PoolLoader(CountedPickles(), batch_size=4, num_workers=2,
                        multiprocessing_context=multiprocessing.get_context("spawn"))
    it = iter(loader)
    assert it._shared_start is not None and it._shared_start.nbytes > 0
    fd = it._shared_start._fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:poolloader-start")
    batches = [next(it) for _ in range(4)]  # both workers replied
    assert it._shared_start is None
    assert [b[0][:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                      [12, 13, 14, 15]]


class WaitsForWorker1(Dataset):
    """One item, which waits (bounded) until worker 1 has run its worker_init_fn."""

    def __init__(self, flag: str):
        self.flag = flag

    def __len__(self):
        return 1

    def __getitem__(self, i):
        deadline = time.monotonic() + 60
        while not os.path.exists(self.flag):
            if time.monotonic() > deadline:
                raise TimeoutError("worker 1 did not start within 60 s")
            time.sleep(0.01)
        return i


def _flag_from_worker_1(worker_id):
    if worker_id == 1:
        open(get_worker_info().dataset.flag, "w").close()


def test_the_shared_start_is_released_once_every_worker_has_loaded_it(tmp_path):
    """Worker 1 gets no request (one batch), so it never replies; it marked its start
    arguments loaded before its worker_init_fn ran, so main frees them at worker 0's
    reply."""
    loader = PoolLoader(WaitsForWorker1(str(tmp_path / "started")), batch_size=1, num_workers=2,
                        worker_init_fn=_flag_from_worker_1, timeout=120,
                        multiprocessing_context=multiprocessing.get_context("spawn"))
    it = iter(loader)
    assert it._shared_start is not None
    assert next(it).tolist() == [0]
    assert it._shared_start is None
    assert list(it) == []


def test_fork_workers_pickle_nothing():
    CountedPickles.pickled = 0
    loader = PoolLoader(CountedPickles(), batch_size=4, num_workers=2,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    it = iter(loader)
    assert it._shared_start is None
    assert len(list(it)) == 12 and CountedPickles.pickled == 0


class HoldsAnEvent(Dataset):
    """Holds a multiprocessing Event: it pickles only while a process is spawned."""

    def __init__(self, ctx):
        self.ready = ctx.Event()
        self.ready.set()

    def __len__(self):
        return 8

    def __getitem__(self, i):
        assert self.ready.wait(10)
        return i


def test_arguments_that_pickle_only_for_a_spawn_travel_with_each_worker():
    ctx = multiprocessing.get_context("spawn")
    loader = PoolLoader(HoldsAnEvent(ctx), batch_size=2, num_workers=2, multiprocessing_context=ctx)
    it = iter(loader)
    assert it._shared_start is None  # fell back to DataLoader's way
    assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4, 5], [6, 7]]
