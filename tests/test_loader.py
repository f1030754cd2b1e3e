"""PoolLoader against DataLoader: one body, two loaders, bit-for-bit equal batches."""
from __future__ import annotations

import copy
import gc
import inspect
import os
import pickle
import signal
import time
import warnings

import loader_datasets as ds
import numpy as np
import proc
import pytest
import torch
from compare import assert_same, both_loaders, pool_only
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from poolloader import PoolLoader, WorkerDied
from poolloader.shm.backends.posix import NAME_TAG


def epochs_and_length(epochs):
    """run= for both_loaders: every batch of `epochs` epochs, kept (as a DataLoader user
    may), and len(loader) where the dataset has one."""
    def run(loader):
        out = [list(loader) for _ in range(epochs)]
        return out, len(loader) if hasattr(loader.dataset, "__len__") else None
    return run


def parity(dataset, epochs=1, generator_seed=None, **kw):
    """The epochs through both loaders (slots=/slot_bytes= for PoolLoader only) must be
    equal, batch for batch; returns PoolLoader's."""
    pool_kw = {k: kw.pop(k) for k in ("slots", "slot_bytes") if k in kw}

    def make(cls):
        gen = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
        return cls(dataset, generator=gen, **kw, **pool_only(cls, **pool_kw))

    (ref, ref_len), (got, got_len) = both_loaders(make, epochs_and_length(epochs))
    assert ref_len == got_len
    assert len(ref) == len(got)
    for e, (a, b) in enumerate(zip(ref, got)):
        assert len(a) == len(b), f"epoch {e}: {len(a)} batches != {len(b)}"
        assert_same(a, b, f"epoch{e}")
    return got


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_parity_augmenting_dataset(workers, shuffle):
    parity(ds.AugmentDataset(), batch_size=4, shuffle=shuffle, num_workers=workers)


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_parity_and_parent_process_under_every_start_method(context):
    """Under every start method: DataLoader's augmented batches bit for bit (seeding,
    worker assignment), and multiprocessing.parent_process() in a worker is alive, has
    main's pid and name, join(timeout) waits, and its sentinel is not ready (PoolLoader
    closes the pipe ends the stock answer comes from; the worker asks the pool's owner
    probe instead)."""
    [batches] = parity(ds.ParentProcessDataset(n=20), batch_size=3, shuffle=True, num_workers=2,
                       multiprocessing_context=context, generator_seed=7)
    assert all(b["alive"].all() and b["join_waited"].all() for b in batches), batches
    assert not any(b["sentinel_ready"].any() for b in batches), batches  # as DataLoader's
    assert all((b["parent_pid"] == os.getpid()).all() for b in batches), batches


def test_parity_drop_last_and_generator():
    parity(ds.AugmentDataset(n=29), batch_size=4, shuffle=True, drop_last=True,
           num_workers=2, generator_seed=3)


def test_parity_batch_sampler():
    data = ds.AugmentDataset(n=31)
    sampler = BatchSampler(RandomSampler(data, generator=torch.Generator().manual_seed(5)), 5, False)
    # the same sampler object is consumed by both runs; reseed between them

    def make(cls):
        sampler.sampler.generator.manual_seed(5)
        return cls(data, batch_sampler=sampler, num_workers=2)

    ref, got = both_loaders(make, seed=99)
    assert_same(ref, got)


def test_parity_batch_size_none_and_varied_structures():
    parity(ds.VariedDataset(), batch_size=None, num_workers=2)


def test_parity_custom_collate_structures():
    parity(ds.VariedDataset(), batch_size=4, collate_fn=ds.list_collate, num_workers=3)


def test_parity_numpy_collate():
    parity(ds.AugmentDataset(n=18), batch_size=4, collate_fn=ds.numpy_collate, num_workers=2)


@pytest.mark.parametrize("persistent", [False, True])
def test_parity_epochs(persistent):
    parity(ds.AugmentDataset(n=22), epochs=3, batch_size=4, shuffle=True, num_workers=2,
           persistent_workers=persistent, generator_seed=11)


def test_parity_worker_info_seed_and_init_fn():
    parity(ds.SeedInfoDataset(), batch_size=2, num_workers=3, worker_init_fn=ds.record_init)


SENTINEL_SCRIPT = """
import multiprocessing, multiprocessing.connection, os, sys, time
from torch.utils.data import Dataset
from poolloader import PoolLoader

out, how = sys.argv[1], sys.argv[2]


class WaitsForMain(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):  # what user code in a worker may do: wait on main's sentinel
        parent = multiprocessing.parent_process()
        ready = bool(multiprocessing.connection.wait([parent.sentinel], timeout=0))
        with open(out + ".waiting", "w") as f:
            f.write(str(ready))
        t0 = time.monotonic()
        ready = bool(multiprocessing.connection.wait([parent.sentinel], timeout=60))
        with open(out + ".tmp", "w") as f:
            f.write(f"{ready} {time.monotonic() - t0:.2f} {parent.is_alive()}")
        os.rename(out + ".tmp", out)
        return i


def refuse_pidfd(worker_id):  # a kernel or seccomp filter without pidfd_open
    def refused(pid, flags=0):
        raise OSError(38, "pidfd_open refused")
    os.pidfd_open = refused


loader = PoolLoader(WaitsForMain(), num_workers=1, multiprocessing_context="fork",
                    worker_init_fn=refuse_pidfd if how == "no-pidfd" else None)
next(iter(loader))
"""


@pytest.mark.parametrize("how", ["pidfd", "no-pidfd"])
def test_parent_sentinel_in_a_worker_is_ready_only_once_main_died(tmp_path, how):
    # issue 33 item 9: main closes its end of the sentinel pipe at the worker's start,
    # so parent_process().sentinel read as ready (main dead) while main lived
    import subprocess
    import sys

    from helpers import communicate_within, leftovers, wait_until

    script, out = tmp_path / "main.py", tmp_path / "result"
    script.write_text(SENTINEL_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    main = subprocess.Popen([sys.executable, str(script), str(out), how], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        waiting = tmp_path / "result.waiting"
        # the file exists before its text is written: wait for the text
        assert wait_until(lambda: waiting.exists() and waiting.read_text() != "", 120), \
            "the worker never fetched"
        assert waiting.read_text() == "False"  # not ready while main lives
        assert not out.exists()
    finally:
        main.kill()
    communicate_within(main, 30, "the killed main")
    assert wait_until(out.exists, 30), "the sentinel did not become ready once main died"
    ready, waited, alive = out.read_text().split()
    assert ready == "True" and alive == "False" and float(waited) < 30
    names, procs = leftovers([main.pid], str(tmp_path), settle_s=10)
    assert not names and not procs


def _warned_at(fn) -> list:
    """(filename, line, first words) of each poolloader warning `fn()` gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [(w.filename, w.lineno, str(w.message)[:50]) for w in caught
            if "PoolLoader" in str(w.message)]


def _first_two_then_close(loader):
    it = iter(loader)
    next(it)
    next(it)
    if loader.num_workers:
        it._shutdown_workers()


def test_warnings_point_at_the_users_line():
    # issue 33 item 9: fixed stacklevels pointed into poolloader (iterator.py, loader.py)
    from _resume_cases import AugmentStream

    # the consumer holds every slot: the oldest batches are detached
    loader = PoolLoader(ds.RFDETRShaped(n=12, hw=64), batch_size=2, collate_fn=ds.rfdetr_collate,
                        num_workers=1, slots=2, max_slots=2, prefetch_factor=1)
    got = _warned_at(lambda: list(loader))
    assert got and {f for f, _, _ in got} == {__file__}, got
    # resuming an IterableDataset without state_dict(): main (num_workers=0) or each
    # worker replays what it fetched
    for workers in (0, 1):
        loader = PoolLoader(AugmentStream(n=12), batch_size=2, num_workers=workers)
        _first_two_then_close(loader)
        resumed = PoolLoader(AugmentStream(n=12), batch_size=2, num_workers=workers)
        state = loader.state_dict()
        got = _warned_at(lambda: (resumed.load_state_dict(state),  # noqa: B023
                                  _first_two_then_close(resumed)))  # noqa: B023
        assert got and {f for f, _, _ in got} == {__file__}, (workers, got)
    # stateful=False: state_dict() says it captures nothing
    loader = PoolLoader(ds.AugmentDataset(n=12), batch_size=2, num_workers=1, stateful=False)
    _first_two_then_close(loader)
    got = _warned_at(loader.state_dict)
    assert got and {f for f, _, _ in got} == {__file__}, got


def test_parity_prefetch_and_out_of_order():
    parity(ds.AugmentDataset(n=25), batch_size=2, num_workers=2, prefetch_factor=4)
    # in_order=False: same multiset of batches
    ref, got = both_loaders(
        lambda cls: cls(ds.AugmentDataset(n=25), batch_size=2, num_workers=2, in_order=False),
        run=lambda loader: sorted(tuple(b["index"].tolist()) for b in loader))
    assert ref == got


def test_growth_keeps_every_batch():
    got = parity(ds.BigDataset(), batch_size=3, collate_fn=ds.pad_collate, num_workers=2,
                 slot_bytes=70_000)
    assert len(got[0]) == 14


def test_rfdetr_shaped_batches_round_trip():
    """batch 16 of 3×576×576 f32 + 576×576 bool masks + 16 target dicts of 7 tensors: 114 tensors."""
    data = ds.RFDETRShaped(n=32)
    loader = PoolLoader(data, batch_size=16, collate_fn=ds.rfdetr_collate, num_workers=2)
    ref = DataLoader(data, batch_size=16, collate_fn=ds.rfdetr_collate, num_workers=0)
    count = 0
    for a, b in zip(ref, loader):
        n_tensors = 2 + sum(len(t) for t in b[2])
        assert n_tensors == 114
        assert_same(a, b)
        count += 1
    assert count == 2


def test_dataloader_surface():
    data = ds.AugmentDataset(n=10)
    loader = PoolLoader[dict](data, batch_size=3, num_workers=2, drop_last=False, timeout=30,
                              prefetch_factor=3, slot_bytes=1 << 16, slots=9)
    assert isinstance(loader, DataLoader)
    assert len(loader) == len(DataLoader(data, batch_size=3)) == 4
    names = [p for p in inspect.signature(PoolLoader.__init__).parameters if p != "self"]
    for name in inspect.signature(DataLoader.__init__).parameters:
        if name != "self":
            assert name in names, name
    # Lightning-style re-instantiation from attributes
    keep = {"dataset", "batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last",
            "timeout", "worker_init_fn", "multiprocessing_context", "generator",
            "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
            "slot_bytes", "slots", "max_slots", "shm_limit"}
    clone = type(loader)(**{k: getattr(loader, k) for k in keep})
    assert clone.slots == 9 and clone.prefetch_factor == 3 and clone.timeout == 30
    assert [b["index"].tolist() for b in clone] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_pickle_and_deepcopy_mid_epoch_as_dataloader(how, persistent):
    """A loader copied mid-epoch: DataLoader's copy works (its iterator is not kept) and
    iterates from the start; with persistent workers DataLoader refuses (its kept
    iterator cannot be pickled): PoolLoader does the same, with the same exception type.
    The copy's stats read what the original's did, and the copy has no pool of its own
    until iterated."""
    copy_of = {"pickle": lambda x: pickle.loads(pickle.dumps(x)), "deepcopy": copy.deepcopy}[how]
    data = TensorDataset(torch.arange(40))

    def run(loader):
        it = iter(loader)
        first = next(it)
        try:
            clone = copy_of(loader)
        except Exception as e:  # noqa: BLE001 - the outcome is what is compared
            return first, type(e), None
        if isinstance(loader, PoolLoader):
            assert clone.stats.batches == loader.stats.batches == 1
            # workers go on prefetching: the original's count may have grown since
            assert 0 < clone.stats.worker_batches <= loader.stats.worker_batches
            assert clone.stats.slot_count == 0 and loader.stats.slot_count > 0
        return first, None, [b[0].tolist() for b in clone]

    ref, got = both_loaders(
        lambda cls: cls(data, batch_size=4, num_workers=2, persistent_workers=persistent), run)
    assert_same(ref[0], got[0])
    assert got[1] is ref[1] and (ref[1] is None) == (not persistent), (ref[1], got[1])
    assert got[2] == ref[2]


def test_creates_nothing_until_iterated():
    def ours():  # other processes on the machine create names meanwhile: count only ours
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"{NAME_TAG}-{os.getpid()}-")}
    before = ours()
    loader = PoolLoader(ds.AugmentDataset(), batch_size=2, num_workers=2)
    assert ours() == before
    assert loader.stats.slot_count == 0


def test_num_workers_zero_is_dataloader():
    parity(ds.AugmentDataset(n=9), batch_size=2, shuffle=True, num_workers=0, generator_seed=1)


# -- leases -------------------------------------------------------------------------------

def test_held_batch_never_changes():
    loader = PoolLoader(ds.AugmentDataset(n=60), batch_size=2, num_workers=2, slots=5)
    it = iter(loader)
    first = next(it)
    snapshot = {k: v.clone() for k, v in first.items() if isinstance(v, torch.Tensor)}
    for _ in it:
        pass
    for k, v in snapshot.items():
        assert torch.equal(first[k], v), k


def test_dropping_batches_reuses_slots_and_holding_all_detaches():
    data = TensorDataset(torch.arange(200 * 20_000, dtype=torch.float32).view(200, 20_000))
    loader = PoolLoader(data, batch_size=1, num_workers=2)  # 80 KB a batch: in the slot
    # dropping each batch: the pool neither grows nor detaches
    for _ in loader:
        pass
    assert loader.stats.pool_growths == 0 and loader.stats.detaches == 0
    held = []
    with pytest.warns(UserWarning, match="detached"):
        for batch in loader:
            held.append(batch)
    assert torch.equal(torch.cat([b[0] for b in held]), data.tensors[0])
    assert loader.stats.detaches > 0 and loader.stats.pool_growths == 0
    del held, batch
    gc.collect()


# -- descriptors ----------------------------------------------------------------------------

def test_open_descriptors_constant():
    data = ds.RFDETRShaped(n=16, hw=96)
    sampler = RandomSampler(data, replacement=True, num_samples=16 * 200,
                            generator=torch.Generator().manual_seed(0))
    loader = PoolLoader(data, batch_size=16, sampler=sampler, collate_fn=ds.rfdetr_collate,
                        num_workers=8)
    counts = []
    for k, _batch in enumerate(loader):
        if k in (5, 199):
            counts.append(proc.fd_count())
    assert k == 199
    assert counts[1] <= counts[0] + 2, counts


# -- faults -----------------------------------------------------------------------------------

@pytest.mark.parametrize("persistent", [False, True])
def test_exception_in_getitem(persistent):
    loader = PoolLoader(ds.FailingDataset(bad=5), batch_size=2, num_workers=2,
                        persistent_workers=persistent)
    for _attempt in range(2):  # the loader can be iterated again afterwards
        got = []
        with pytest.raises(KeyError) as info:
            for batch in loader:
                got.append(batch)
        assert "Traceback" in str(info.value) and "bad sample 5" in str(info.value)
        assert "in DataLoader worker process" in str(info.value)
        assert len(got) == 2


def test_exception_in_collate_and_init():
    with pytest.raises(ValueError, match="collate exploded"):
        next(iter(PoolLoader(ds.FailingDataset(), batch_size=2, num_workers=2,
                             collate_fn=ds.failing_collate)))
    with pytest.raises(OSError, match="init of worker 0 failed"):
        next(iter(PoolLoader(ds.FailingDataset(), batch_size=2, num_workers=2,
                             worker_init_fn=ds.failing_init)))


def test_worker_sigkill_is_reported_quickly():
    loader = PoolLoader(ds.PidDataset(), batch_size=2, num_workers=2)
    it = iter(loader)
    batch = next(it)
    victim = int(batch[0, 1])
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        for _ in it:
            pass
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0
    assert f"pid {victim}" in str(info.value) and "SIGKILL" in str(info.value)
    assert "worker 0" in str(info.value) or "worker 1" in str(info.value)


def test_timeout_fires():
    loader = PoolLoader(ds.SlowDataset(delay=3.0), batch_size=1, num_workers=1, timeout=0.5)
    it = iter(loader)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 0.5 seconds"):
        next(it)
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 2.5


def test_slow_worker_without_timeout_is_waited_for():
    loader = PoolLoader(ds.SlowDataset(n=2, delay=1.2), batch_size=1, num_workers=1)
    assert [int(b) for b in loader] == [0, 1]


def test_del_mid_epoch_cleans_up():
    loader = PoolLoader(ds.PidDataset(n=100, delay=0.01), batch_size=2, num_workers=3)
    it = iter(loader)
    next(it)
    pids = it.worker_pids
    del it
    gc.collect()
    for pid in pids:
        assert not proc.pid_running(pid)


def test_device_cpu_delivery_keeps_order_and_errors():
    parity(ds.AugmentDataset(n=14), batch_size=3, num_workers=2, shuffle=True, generator_seed=2)
    loader = PoolLoader(ds.AugmentDataset(n=14), batch_size=3, num_workers=2, device="cpu",
                        persistent_workers=True)
    for _epoch in range(2):
        assert [b["index"].tolist()[0] for b in loader] == [0, 3, 6, 9, 12]
    # an error met while looking one batch ahead is raised after the batch before it
    got = []
    with pytest.raises(KeyError, match="bad sample 5"):
        for b in PoolLoader(ds.FailingDataset(bad=5), batch_size=2, num_workers=2, device="cpu"):
            got.append(b.tolist())
    assert got == [[[0] * 4, [1] * 4], [[2] * 4, [3] * 4]]


def test_pin_memory_without_cuda_warns_and_behaves_as_dataloader():
    """The same warnings as DataLoader (torch 2.13 says "no accelerator is found"; 2.6
    says nothing) and the same unpinned batches."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")

    def run(loader):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(loader)
        return batches, [str(w.message) for w in caught if "pin" in str(w.message)]

    (ref, ref_warned), (got, warned) = both_loaders(
        lambda cls: cls(ds.FailingDataset(bad=99), batch_size=4, num_workers=2, pin_memory=True), run)
    assert warned == ref_warned
    assert all(not b.is_pinned() for b in got) and len(got) == 3
    assert_same(ref, got)


def test_next_after_worker_death_and_after_the_end():
    loader = PoolLoader(ds.PidDataset(n=40), batch_size=2, num_workers=2)
    it = iter(loader)
    os.kill(int(next(it)[0, 1]), signal.SIGKILL)
    with pytest.raises(WorkerDied):
        for _ in it:
            pass
    with pytest.raises(RuntimeError, match="shut down by the error raised before"):
        next(it)
    it = iter(PoolLoader(ds.AugmentDataset(n=4), batch_size=2, num_workers=2))
    assert len(list(b["index"].tolist() for b in it)) == 2
    with pytest.raises(StopIteration):
        next(it)


class _IndexTypes(torch.utils.data.Dataset):
    """Returns the type names of the index it is given and of its container."""

    def __len__(self):
        return 8

    def __getitems__(self, indices):
        return [(type(indices).__name__, type(i).__name__, int(i)) for i in indices]


class _NumpyBatches(torch.utils.data.Sampler):
    def __iter__(self):
        return iter([[np.int64(0), np.int64(1)], [np.int64(2), 3]])

    def __len__(self):
        return 2


@pytest.mark.parametrize("sampler", ["shuffle", "numpy"])
def test_requests_reach_the_fetcher_with_the_samplers_types(sampler):
    # torch's samplers' lists of ints go raw; any other index is pickled: both reach the
    # dataset exactly as DataLoader's fetcher hands them over
    kw = (dict(shuffle=True, batch_size=2) if sampler == "shuffle"
          else dict(batch_sampler=_NumpyBatches()))
    collate = list
    ref = list(DataLoader(_IndexTypes(), num_workers=2, collate_fn=collate, **kw))
    got = list(PoolLoader(_IndexTypes(), num_workers=2, collate_fn=collate, **kw))
    assert [[t[:2] for t in b] for b in got] == [[t[:2] for t in b] for b in ref]
    types = {t[:2] for b in got for t in b}
    assert types == ({("list", "int")} if sampler == "shuffle" else {("list", "int64"), ("list", "int")})


def test_a_pool_that_shrinks_and_grows_again_delivers_dataloaders_batches(monkeypatch):
    """A pool of 10 slots (slots=10) whose consumer holds five batches (every slot in
    use), then none for a while (the slots it no longer needs give their pages back:
    stats.pages_returned, resident < reserved), then five again (those slots are
    written anew), twice over: every batch, random augmentation included, is
    DataLoader's. (Five, not three: a worker-bound pool keeps one slot clean for the
    newest request, and may give one more back, so three held batches left the busy
    stretch's charge level with the idle one's in one CI run.)"""
    from poolloader.main import ledger
    monkeypatch.setattr(ledger, "IDLE_TAKES", 4)
    pattern = [5] * 8 + [0] * 16 + [5] * 8 + [0] * 16  # batches held, per batch delivered
    figures: dict = {}

    def run(loader):
        out, held = [], []
        for k, batch in enumerate(loader):
            out.append(copy.deepcopy(batch))
            held.append(batch)
            del held[:max(0, len(held) - pattern[k])]
            del batch
            if isinstance(loader, PoolLoader) and k in (7, 23, 31, 47):
                report = loader.stats.memory()
                figures[k] = (report.pool_resident, report.pool_reserved,
                              loader.stats.pages_returned)
        if isinstance(loader, PoolLoader):
            figures["detaches"] = loader.stats.detaches
        return out

    def make(cls):
        return cls(ds.AugmentDataset(n=len(pattern) * 4, shape=(3, 128, 128)), batch_size=4,
                   num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(5),
                   **pool_only(cls, slots=10))

    reference, got = both_loaders(make, run)
    assert len(got) == len(pattern)
    assert_same(got, reference)
    assert figures["detaches"] == 0, figures  # ten slots held what was in use
    # each idle stretch gave pages back, and each busy one took those slots again
    assert figures[7][2] < figures[23][2] <= figures[31][2] < figures[47][2], figures
    for busy, idle in ((7, 23), (31, 47)):
        assert figures[idle][0] < figures[busy][0] <= figures[busy][1], figures
    assert figures[31][0] > figures[23][0], figures  # grown again


class GrowingBatches(torch.utils.data.Dataset):
    """Item i: 3 × (32 + 8·(i // 4)) × 64 floats drawn from torch's RNG, so each batch
    of 4 is larger than the one before (every worker's slots keep growing) and any
    change in the order a worker fetches its requests shows in the values."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.rand(3, 32 + 8 * (i // 4), 64)


@pytest.mark.parametrize("prefetch_factor", [2, 3])
def test_batches_that_keep_growing_are_dataloaders_in_the_order_workers_fetch(prefetch_factor):
    """Slots too small for what a worker already needed are grown before their request
    is fetched, and the requests behind such a one wait for it: every batch, drawn from
    the workers' RNGs, is DataLoader's."""
    def make(cls):
        return cls(GrowingBatches(), batch_size=4, num_workers=2,
                   prefetch_factor=prefetch_factor, **pool_only(cls, slot_bytes=1 << 16))

    reference, got = both_loaders(make, lambda loader: [b.clone() for b in loader])
    assert len(got) == 24
    assert_same(got, reference)


def test_profiler_sees_every_next_as_under_dataloader():
    # torch's record_function region of each next() is entered only while a profiler
    # records (issue 47: it costs ~7 µs a batch otherwise); under one, every call shows
    # as DataLoader's does, StopIteration's included
    def regions(loader):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            batches = list(loader)
        names = [e.name for e in prof.events() if e.name.startswith("enumerate(DataLoader)#")]
        return batches, len(names), {n.split("#")[1] for n in names}

    dl, pl = both_loaders(lambda cls: cls(ds.AugmentDataset(n=10), batch_size=2, num_workers=2),
                          regions)
    assert_same(dl[0], pl[0])
    assert dl[1] == pl[1] == 6, (dl, pl)
    assert pl[2] == {"PoolLoaderIter.__next__"}
    # and outside a profiler the batches are the same
    dl, pl = both_loaders(lambda cls: cls(ds.AugmentDataset(n=10), batch_size=2, num_workers=2))
    assert_same(dl, pl)
