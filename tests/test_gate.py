"""The CUDA reuse gate, driven on the CPU through the stand-in of tests/cuda_standin.py.

Loader tests run real workers over real shared memory; only the CUDA surface
(streams, events, copies, registration) is the stand-in, passed as
`loader._cuda_runtime`. Its copies read the slot when the simulated stream runs
them, as a DMA does, so reusing a slot too early shows up as wrong data, and
unregistering it too early as a recorded violation.
"""
import collections
import gc
import multiprocessing
import os
import time
import warnings

import numpy as np
import proc
import pytest
import torch
from cuda_standin import SimCuda
from helpers import running
from torch.utils.data import Dataset

from poolloader import PoolLoader
from poolloader.cuda import gate as cuda
from poolloader.cuda import staging
from poolloader.errors import CudaRegistrationError
from poolloader.shm.backends.posix import NAME_TAG
from poolloader.shm.pool import SlotPool
from poolloader.stats import LoaderStats
from poolloader.wire.slot_format import DATA_OFF

# DataLoader's warning: these machines have no accelerator (the stand-in plays CUDA)
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")

ROW = 4096  # floats per row of a sample: 64 KiB samples, small pools


class Full(Dataset):
    """Sample i is a (4, ROW) tensor full of i: a copy shows which batch it read."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((4, ROW), float(i))


class FullDict(Full):
    def __getitem__(self, i):
        return collections.defaultdict(list, {"x": torch.full((4, ROW), float(i)), "i": i})


def loader_with(sim, dataset, **kw):
    kw.setdefault("batch_size", 2)
    kw.setdefault("num_workers", 2)
    loader = PoolLoader(dataset, **kw)
    loader._cuda_runtime = sim
    return loader


def first_values(outs):
    """The sample index each copied batch holds, per sample (its first element)."""
    return [o[:, 0, 0].tolist() for o in outs]


def expected(n_batches, batch_size=2):
    return [[float(batch_size * k + j) for j in range(batch_size)] for k in range(n_batches)]


def test_gate_release_then_cool_then_ready_in_release_order():
    sim = SimCuda()
    gate = cuda.SlotGate(sim)
    default, side = sim.current_stream(0), sim.stream(0)
    gate.release(0)  # nothing queued anywhere: ready at once, no event
    assert gate.ready() == [0] and not sim.events
    sim.work(default)
    gate.release(1)  # behind the default stream's kernel
    sim.work(side)
    gate.release(2)  # behind both
    gate.release(3)
    assert gate.pending == 3 and gate.ready() == []
    assert {e.stream.name for e in sim.events} == {"default0", "side"}
    with pytest.raises(RuntimeError, match="released twice"):
        gate.release(3)
    sim.run(default)
    assert gate.ready() == [1]
    sim.work(default)  # work queued after a release does not hold it back
    sim.run(side)
    assert gate.ready() == [2, 3]
    gate.release(4)  # behind default only
    sim.work(side)
    gate.release(5)  # behind default and side: completes after 4
    sim.run(side)
    assert gate.ready() == []
    sim.run(default)
    assert gate.ready() == [4, 5] and gate.pending == 0


@pytest.mark.parametrize("max_slots", [2, None])
def test_gate_side_stream_copy_with_next_outside_it(max_slots):
    # issue 14's check: next() on the default stream, the copy queued on a side stream
    # behind a long kernel, the batch dropped at once; a tiny pool reuses slots
    sim = SimCuda()
    loader = loader_with(sim, Full(64), pin_memory=True, slots=2, max_slots=max_slots,
                         prefetch_factor=1)
    side, outs = sim.stream(0), []
    it = iter(loader)
    for _ in range(32):
        b = next(it)
        with sim.use(side):
            sim.work(side, "sleep 30 ms")
            outs.append(sim.copy(b))
        del b
    sim.run_all()  # while the pool is alive: a slot reused too early shows as wrong data
    assert first_values(outs) == expected(32)
    with pytest.raises(StopIteration):
        next(it)
    assert sim.violations == [] and sim.registered == {}
    stats = loader.stats
    if max_slots == 2:
        assert stats.cooling_waits > 0 and stats.pool_growths == 0
    else:  # cooling slots count as in flight: the pool grew instead of waiting
        assert stats.cooling_growths > 0 and stats.slot_count == 0


def test_gate_two_devices_and_data_parallel_copy_streams():
    sim = SimCuda(devices=2)
    loader = loader_with(sim, Full(48), pin_memory=True, slots=2, max_slots=2, prefetch_factor=1)
    outs = []
    it = iter(loader)
    for k in range(24):
        b = next(it)
        if k % 2:  # b.to("cuda:1", non_blocking=True) on device 1's busy current stream
            current1 = sim.current_stream(1)
            sim.work(current1)
            outs.append(sim.copy(b, current1))
        else:  # DataParallel's scatter: per-device copy streams, then current streams wait
            halves = []
            for device in (0, 1):
                copy_stream = sim.stream(device, f"scatter{device}")
                sim.work(copy_stream)
                halves.append(sim.copy(b[device:device + 1], copy_stream))
                sim.stream_wait(sim.current_stream(device), sim.record_event(copy_stream))
            outs.append(halves)
        del b
    sim.run_all()  # while the pool is alive
    outs = [torch.cat(o) if isinstance(o, list) else o for o in outs]
    assert first_values(outs) == expected(24)
    with pytest.raises(StopIteration):
        next(it)
    assert sim.violations == [] and sim.registered == {}
    assert any(e.stream.device == 1 for e in sim.events)  # the marker covered device 1
    assert loader.stats.cooling_waits > 0


def test_gate_device_stager_copy_event_across_stream_switches():
    sim = SimCuda()
    loader = loader_with(sim, FullDict(64), device="cuda", slots=2, max_slots=2, prefetch_factor=1)
    it = iter(loader)
    stager_stream = it._stager.stream
    outs, indices = [], []
    for k in range(32):
        consumer = sim.stream(0, f"consumer{k}")  # a different current stream at every call
        with sim.use(consumer):
            batch = next(it)
        assert type(batch) is collections.defaultdict and batch.default_factory is list
        outs.append(batch["x"])
        indices.append(batch["i"])
        # the consumer's stream waits for the copy before anything it queues later
        assert consumer.ops and consumer.ops[-1][0] == "wait"
        assert consumer.ops[-1][1].stream is stager_stream
        if k == 30:  # (the call after this one meets the end of the epoch: teardown)
            gating_streams = {e.stream.name for e in sim.events}
    sim.run_all()  # while the pool is alive
    assert first_values(outs) == expected(32)
    assert [i.tolist() for i in indices] == [[2 * k, 2 * k + 1] for k in range(32)]
    # reuse was gated on the stager's own copy events, nothing else
    assert gating_streams == {"stager"}
    with pytest.raises(StopIteration):
        next(it)
    assert sim.violations == [] and sim.registered == {}
    assert loader.stats.cooling_waits > 0


def test_gate_teardown_waits_for_leased_cooling_and_staged_copies():
    sim = SimCuda()
    loader = loader_with(sim, Full(40), pin_memory=True, slots=4, prefetch_factor=1)
    it = iter(loader)
    side = sim.stream(0)
    leased = next(it)
    sim.work(side)
    out_leased = sim.copy(leased, side)  # its batch is still held at teardown
    cooling = next(it)
    out_cooling = sim.copy(cooling, side)
    del cooling
    kept = next(it)  # finds the release: that slot is cooling now
    assert it._gate.pending >= 1 and sim.registered
    held = {_registered_span(sim, leased), _registered_span(sim, kept)}
    t0 = time.monotonic()
    it._shutdown_workers()
    assert time.monotonic() - t0 < 5
    # every queued copy ran before anything was unregistered, and everything was but
    # the slots of the batches still held (until their last view dies)
    assert sim.violations == [] and set(sim.registered) == held
    assert first_values([out_leased, out_cooling]) == expected(2)
    assert leased[:, 0, 0].tolist() == [0.0, 1.0] and kept[:, 0, 0].tolist() == [4.0, 5.0]
    del leased, kept, it
    cuda.finish_deferred()
    assert sim.registered == {}

    # device=: the copy of the batch staged one ahead is in flight at teardown
    sim = SimCuda()
    it = iter(loader_with(sim, Full(40), device="cuda", slots=4, prefetch_factor=1))
    first = next(it)
    assert it._stager._staged is not None and not sim.stream_idle(it._stager.stream)
    it._shutdown_workers()
    assert sim.violations == [] and sim.registered == {}
    sim.run_all()
    assert first_values([first]) == expected(1) and sim.violations == []


def test_gate_teardown_from_a_finaliser_makes_no_cuda_call():
    sim = SimCuda()
    loader = loader_with(sim, Full(40), pin_memory=True, slots=4, prefetch_factor=1)
    it = iter(loader)
    side = sim.stream(0)
    batch = next(it)
    dropped = next(it)
    sim.work(side)
    out_dropped = sim.copy(dropped, side)
    del dropped
    next(it)  # its slot cools behind the side stream
    old = dict(sim.registered)
    held = _registered_span(sim, batch)
    calls = len(sim.calls)
    del it  # __del__ stops the workers and unlinks the names ...
    gc.collect()
    assert len(sim.calls) == calls  # ... but makes no CUDA call
    assert sim.registered == old  # the pool stays registered and mapped meanwhile
    out_later = sim.copy(batch, side)  # the user's batch still copies asynchronously
    it2 = iter(loader)  # the next gate finishes the deferred teardown first
    later = [name for _pid, name in sim.calls[calls:]]
    unregistered = [i for i, name in enumerate(later) if name == "host_unregister"]
    assert len(unregistered) == len(old) - 1  # all but the slot of the batch still held
    assert max(unregistered) < later.index("host_register")  # before the new pool registered
    assert held in sim.registered
    assert sim.violations == []
    assert first_values([out_dropped, out_later]) == [[2.0, 3.0], [0.0, 1.0]]
    assert batch[:, 0, 0].tolist() == [0.0, 1.0]
    it2._shutdown_workers()
    assert set(sim.registered) == {held}
    del batch
    cuda.finish_deferred()
    assert sim.registered == {}


def test_gate_abandoned_pool_is_finished_by_another_loaders_releases():
    sim = SimCuda()
    other = iter(loader_with(sim, Full(40), pin_memory=True, slots=4, prefetch_factor=1))
    abandoned = iter(loader_with(sim, Full(40), pin_memory=True, slots=4, prefetch_factor=1))
    addresses = {m.address for m in abandoned._pool.mappings}
    held = next(abandoned)
    del abandoned  # `for batch in loader: break`: the finaliser defers the CUDA part
    gc.collect()
    calls = len(sim.calls)
    for _ in range(3):
        next(other)  # releases of a live loader look at the abandoned pool, never wait
    assert addresses <= set(sim.registered)  # the user still holds a batch of it
    side = sim.stream(0)
    sim.work(side)
    out = sim.copy(held, side)
    del held
    next(other)
    next(other)
    assert addresses <= set(sim.registered)  # its last copy is still queued
    sim.run(side)
    next(other)
    next(other)
    assert not addresses & set(sim.registered)
    assert "wait_events" not in [name for _pid, name in sim.calls[calls:]]
    assert sim.violations == [] and first_values([out]) == expected(1)
    other._shutdown_workers()
    assert sim.registered == {}


def test_gate_waits_are_bounded_when_a_stream_never_finishes(monkeypatch):
    sim = SimCuda()
    stats = LoaderStats()
    gate = cuda.SlotGate(sim, stats)
    side = sim.stream(0)
    sim.work(side)
    side.hung = True
    gate.release("k")
    t0 = time.monotonic()
    assert gate.wait_any(0.3) == []
    assert 0.3 <= time.monotonic() - t0 < 5.0
    assert stats.cooling_waits == 1 and stats.cooling_wait_s >= 0.3

    # teardown: bounded, then the pool stays registered and mapped until a later gate
    monkeypatch.setattr(cuda, "CLOSE_TIMEOUT_S", 0.3)
    loader = loader_with(sim, Full(40), pin_memory=True, slots=4, prefetch_factor=1)
    it = iter(loader)
    batch = next(it)
    out = sim.copy(batch, side)
    del batch
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not finish within"):
        it._shutdown_workers()
    assert 0.3 <= time.monotonic() - t0 < 5.0
    stuck = dict(sim.registered)
    assert stuck
    side.hung = False
    cuda.finish_deferred()
    assert not set(stuck) & set(sim.registered) and sim.violations == []
    assert first_values([out]) == expected(1)


def _our_shm_maps(prefix):
    return [path for _, _, path in proc.maps() if path.startswith(f"/dev/shm{prefix}")]


def test_gate_registration_failure_names_slot_size_and_error_and_leaves_nothing():
    sim = SimCuda()
    sim.fail_register = {2: 2}  # the third cudaHostRegister: out of memory
    gate = cuda.SlotGate(sim)
    prefix = f"/{NAME_TAG}-{os.getpid()}-"
    with pytest.raises(CudaRegistrationError,
                       match=r"slot 2 \(69632 bytes at 0x[0-9a-f]+\) failed with "
                             r"cudaErrorMemoryAllocation \(2\)\. Lower slot_bytes"):
        SlotPool(1, 4, 4, 69632, on_map=gate.register, on_unmap=gate.unregister)
    assert sim.last_error == 0  # cleared: torch would not report it on a later kernel
    assert sim.registered == {} and sim.unregister_calls == 2
    assert _our_shm_maps(prefix) == []

    # through the loader: the iterator fails cleanly (conftest checks names and children)
    sim = SimCuda()
    sim.fail_register = {1: 2}
    with pytest.raises(CudaRegistrationError, match="slot 1"):
        iter(loader_with(sim, Full(8), pin_memory=True))
    assert sim.registered == {} and sim.last_error == 0 and _our_shm_maps(prefix) == []


def test_gate_unregister_failure_is_cleared_reported_and_teardown_goes_on():
    sim = SimCuda()
    sim.fail_unregister = {1: 1}
    gate = cuda.SlotGate(sim)
    pool = SlotPool(1, 3, 3, 65536, on_map=gate.register, on_unmap=gate.unregister)
    failing = pool.mappings[1].address
    with pytest.warns(RuntimeWarning, match=r"cudaHostUnregister of slot 1 \(65536 bytes at "
                                            r"0x[0-9a-f]+\) failed with cudaErrorInvalidValue"):
        pool.close()
    assert list(sim.registered) == [failing]  # the other two went on
    assert sim.last_error == 0 and len(gate.errors) == 1
    assert _our_shm_maps(pool.prefix) == []


LAG = 6


@pytest.mark.parametrize("max_slots", [None, 6])
def test_gate_starved_pool_grows_or_waits_but_never_collects_garbage(max_slots):
    # GPU-bound steady state: each batch queues a copy and a training step on the
    # default stream, and the GPU runs LAG steps behind the host: as many as the
    # pool has slots, so releases alone would starve it
    sim = SimCuda()
    loader = loader_with(sim, Full(80), pin_memory=True, prefetch_factor=2, max_slots=max_slots)
    default = sim.current_stream(0)
    collections_run = []

    def count(phase, info):
        if phase == "start":
            collections_run.append(info["generation"])

    outs = []
    gc.disable()  # so that any collection seen is an explicit gc.collect()
    gc.callbacks.append(count)
    try:
        for b in loader:
            outs.append(sim.copy(b, default))
            sim.work(default, "step")
            del b
            sim.run(default, max(default.done, len(default.ops) - 2 * LAG))
    finally:
        gc.callbacks.remove(count)
        gc.enable()
    assert collections_run == []
    sim.run_all()
    assert first_values(outs) == expected(40) and sim.violations == []
    stats = loader.stats
    if max_slots is None:
        assert stats.cooling_growths >= 1 and stats.cooling_waits == 0
        assert stats.pool_growths == stats.cooling_growths
    else:
        assert stats.cooling_waits > 0 and stats.pool_growths == 0


def test_gate_retired_mapping_stays_registered_until_its_copies_finish():
    # a detached slot: the pool gets a fresh segment, the old one lives with the batch
    sim = SimCuda()
    gate = cuda.SlotGate(sim)
    detached = []

    def on_unmap(mapping, slot):
        if not any(mapping is m for m in detached):
            gate.unregister(mapping, slot)

    pool = SlotPool(1, 2, 2, 2 * DATA_OFF, on_map=gate.register, on_unmap=on_unmap)
    old = pool.mappings[0]
    view = torch.from_numpy(np.frombuffer(old, np.float32, count=ROW, offset=DATA_OFF))
    view.fill_(7.0)
    side = sim.stream(0)
    sim.work(side)
    out = sim.copy(view, side)
    detached.append(old)
    pool.replace(0, old.size)  # detach
    assert pool.mappings[0] is not old and old.address in sim.registered
    del view  # the batch is released: the iterator hands the gate the mapping
    gate.release(old)
    assert gate.ready() == [] and old.address in sim.registered
    assert gate.wait_any(1.0) == [old]  # the copy ran first
    assert gate.unregister(old, 0) and old.address not in sim.registered
    address = old.address
    del old, detached[:]
    assert not any(lo == address for lo, _, _ in proc.maps())
    assert out.tolist() == [7.0] * ROW and sim.violations == []
    pool.close()
    assert sim.registered == {}


class Sub(torch.Tensor):
    pass


class Custom:
    def __init__(self, t, pinned=False):
        self.t, self.pinned = t, pinned

    def pin_memory(self):
        return Custom(self.t, pinned=True)


Pair = collections.namedtuple("Pair", "tensor label")


class Mixed(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return collections.defaultdict(list, {
            "view": torch.arange(20_000.0) + i,  # over 64 KiB: stays a view of the slot
            "small": torch.arange(6.0) + i,      # copied out into the batch's small buffer
            "sparse": torch.sparse_coo_tensor([[0, 2]], [float(i), 1.0], (4,)),
            "grad": torch.ones(3, requires_grad=True),
            "sub": torch.ones(2).as_subclass(Sub),
            "custom": Custom(torch.full((2,), float(i))),
            "pair": Pair(torch.zeros(20_000) + i, "label"),
            "np": np.arange(3) + i,
            "name": f"s{i}",
        })


def first_sample(batch):
    return batch[0]


def test_gate_pins_like_dataloader_and_keeps_container_types():
    sim = SimCuda()
    loader = loader_with(sim, Mixed(), batch_size=1, collate_fn=first_sample, pin_memory=True,
                         pin_memory_device="cuda:0")
    it = iter(loader)
    batch = next(it)
    gate = it._gate
    assert type(batch) is collections.defaultdict and batch.default_factory is list
    pinned = {id(t) for t in sim.pinned}
    # slot views are page-locked already: left as they are
    assert gate.is_slot_view(batch["view"]) and id(batch["view"]) not in pinned
    assert type(batch["pair"]) is Pair and gate.is_slot_view(batch["pair"].tensor)
    # what was pickled into the skeleton is pinned, as DataLoader's pin thread would
    for key in ("sparse", "grad", "sub"):
        assert id(batch[key]) in pinned, key
        assert not gate.is_slot_view(batch[key])
    # small tensors are in the batch's own buffer, allocated page-locked: kept as they are
    assert id(batch["small"]) not in pinned and not gate.is_slot_view(batch["small"])
    assert sim.is_pinned(batch["small"]) and len(sim.pinned_buffers) == 1
    assert batch["sparse"].is_sparse and batch["sparse"].to_dense().tolist() == [0.0, 0.0, 1.0, 0.0]
    assert type(batch["sub"]) is Sub and batch["grad"].requires_grad
    assert batch["custom"].pinned is True  # the batch type's own pin_memory()
    assert isinstance(batch["np"], np.ndarray) and batch["name"] == "s0"
    assert set(sim.pin_devices) == {"cuda:0"}  # pin_memory_device reaches the pinning
    del batch, it

    # to_device keeps defaultdict (and its factory), namedtuples and batch types
    moved = staging.to_device(collections.defaultdict(int, {"a": torch.ones(2),
                                                            "p": Pair(torch.zeros(1), 1)}),
                           "cpu", non_blocking=False)
    assert type(moved) is collections.defaultdict and moved.default_factory is int
    assert type(moved["p"]) is Pair and moved["a"].tolist() == [1.0, 1.0]


def test_gate_registers_each_mapping_once_per_pool_lifetime():
    sim = SimCuda()
    loader = loader_with(sim, Full(12), pin_memory=True, persistent_workers=True, slot_bytes=1 << 20)
    for _epoch in range(3):
        assert sum(1 for _ in loader) == 6
    slots = loader.stats.slot_count
    assert slots > 0 and loader.stats.slot_growths == 0
    assert sim.register_calls == slots and sim.unregister_calls == 0
    loader._iterator._shutdown_workers()
    assert sim.unregister_calls == slots and sim.registered == {}


def _use_inherited_gate(gate, sim):
    n = len(sim.calls)
    gate.release(99)
    gate.ready()
    gate.close()
    gate.unregister(next(iter(gate._registered.values()))[0])
    del gate
    gc.collect()
    os._exit(0 if len(sim.calls) == n else 1)


def test_gate_forked_children_make_no_cuda_call():
    read_fd, write_fd = os.pipe()
    try:
        os.set_blocking(read_fd, False)
        sim = SimCuda(alarm_fd=write_fd)
        # workers forked from a process whose gate holds events and registrations
        loader = loader_with(sim, Full(16), pin_memory=True, multiprocessing_context="fork")
        side = sim.stream(0)
        outs = []
        for b in loader:
            sim.work(side)
            outs.append(sim.copy(b, side))
        sim.run_all()
        assert first_values(outs) == expected(8)
        # a forked child that calls into an inherited gate: every call is a no-op
        gate = cuda.SlotGate(sim)
        pool = SlotPool(1, 1, 1, 65536, on_map=gate.register, on_unmap=gate.unregister)
        sim.work(side)
        gate.release(0)
        child = multiprocessing.get_context("fork").Process(target=_use_inherited_gate,
                                                            args=(gate, sim))
        with running(child):
            pass
        assert child.exitcode == 0
        pool.close()
        try:
            alarms = os.read(read_fd, 4096)
        except BlockingIOError:
            alarms = b""
        assert alarms == b""
    finally:
        os.close(read_fd)
        os.close(write_fd)


class Labelled(Dataset):
    """Sample i: a 64 KiB image full of i (a view of the slot) and `small` label tensors
    (each copied into the batch's small buffer)."""

    def __init__(self, n, small):
        self.n, self.small = n, small

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((4, ROW), float(i)), [torch.tensor([i, k]) for k in range(self.small)]


# CUDA runtime calls main makes per batch with pin_memory, in steady state (here 6
# with nothing cooling, 9 with 20 slots cooling, 12 where the pool is at its cap and
# waits for the oldest): one look at the devices, one listing of the streams that may
# hold copies (default and side), a query and at most an event per such stream, polls
# of the oldest cooling slot, a bounded wait when the pool may not grow, the small
# buffer and its one pinning check. It does not depend on the slots cooling or the
# small tensors of the batch (before: every event of every cooling slot was polled,
# and every small tensor was pinned on its own), nor on torch's stream pool
# (TorchCuda lists only the pool streams handed out; test_cuda.py checks it on a GPU).
CALLS_PER_BATCH = 14


@pytest.mark.parametrize("small, lag, max_slots", [(1, 0, None), (60, 0, None), (1, 8, None),
                                                   (60, 8, None), (1, 20, 40)])
def test_gate_cuda_calls_per_batch_are_a_small_constant(small, lag, max_slots):
    sim = SimCuda()
    side = sim.stream(0)  # a prefetcher's copy stream, taken before the loader
    loader = loader_with(sim, Labelled(64, small), pin_memory=True, prefetch_factor=2,
                         max_slots=max_slots)
    it = iter(loader)
    per_batch, outs, cooling = [], [], []
    for _ in range(32):
        before = len(sim.calls)
        images, labels = next(it)
        per_batch.append(len(sim.calls) - before)
        cooling.append(it._gate.pending)
        assert len(labels) == small and sim.is_pinned(labels[-1])
        sim.work(side, "step")
        outs.append(sim.copy(images, side))
        del images, labels
        # the GPU runs `lag` batches behind the host: that many slots cool at once
        sim.run(side, max(side.done, len(side.ops) - 2 * lag))
    sim.run_all()
    assert first_values(outs) == expected(32) and sim.violations == []
    steady = per_batch[8:]
    assert max(steady) <= CALLS_PER_BATCH, (steady, collections.Counter(
        name for _pid, name in sim.calls))
    assert (max(cooling[8:]) >= min(lag, 12) - 1) if lag else max(cooling[8:]) <= 1
    it._shutdown_workers()
    assert sim.registered == {}


class Detections(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        n = i % 3
        target = {"boxes": torch.full((n, 4), i / 7), "labels": torch.arange(n) + i}
        return torch.full((4, ROW), float(i)), target


def _packed_collate(samples):
    from poolloader import pack_targets
    return torch.stack([s[0] for s in samples]), pack_targets([s[1] for s in samples])


def test_gate_pins_packed_targets_per_storage_without_copies():
    # PackedTargets' own pin_memory() would ask torch about each field; the gate treats
    # its tensors as the batch's: slot views and small-buffer fields stay where they are
    sim = SimCuda()
    loader = loader_with(sim, Detections(), batch_size=4, collate_fn=_packed_collate,
                         pin_memory=True)
    ref = [_packed_collate([Detections()[i] for i in range(k, k + 4)]) for k in (0, 4)]
    batches = list(loader)
    names = [name for _pid, name in sim.calls]
    # per batch one look at the images' storage and one at the small buffer's
    assert names.count("is_pinned") <= 2 * len(batches) and "pin_tensor" not in names
    for (images, targets), (want_images, want_targets) in zip(batches, ref):
        assert type(targets).__name__ == "PackedTargets" and len(targets) == 4
        assert torch.equal(images, want_images)
        for got, want in zip(targets, want_targets):
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        assert all(sim.is_pinned(t) for t in (*targets.fields.values(), targets.counts))
    assert sim.pinned == []  # nothing was copied to be pinned


def _registered_span(sim, tensor):
    """The registered range (address) `tensor`'s storage lies in, or None."""
    start = tensor.untyped_storage().data_ptr()
    return next((a for a, n in sim.registered.items() if a <= start < a + n), None)


@pytest.mark.parametrize("close", ["shutdown", "finaliser"])
def test_gate_held_batch_stays_registered_after_teardown_until_its_last_view_dies(close):
    # issue 33 item 10: teardown (pool.close, gate._finish(block=True) from the next
    # loader's iter()) unregistered every mapping, the one a held batch views included
    sim = SimCuda()
    loader = loader_with(sim, Full(40), pin_memory=True, slots=4, prefetch_factor=1)
    it = iter(loader)
    held = next(it)
    address = _registered_span(sim, held)
    assert address is not None
    if close == "shutdown":
        it._shutdown_workers()
        assert set(sim.registered) == {address}  # the rest of the pool is unregistered
    else:
        del it  # the finaliser defers the CUDA part to the next gate
        gc.collect()
    it2 = iter(loader)  # a new gate finishes deferred teardowns, blocking
    next(it2)
    assert address in sim.registered  # the held batch is still page-locked
    assert len(sim.registered) == 1 + it2._pool.num_slots  # the old pool's rest is not
    side = sim.stream(0)
    sim.work(side)
    out = sim.copy(held, side)  # queued: it reads the slot when the stream runs
    assert held[:, 0, 0].tolist() == [0.0, 1.0]
    sim.run(side)
    assert sim.violations == [] and first_values([out]) == expected(1)
    sim.work(side)
    out = sim.copy(held, side)
    del held  # the last view: unregistered once a marker after it completed
    gc.collect()
    next(it2)
    assert address in sim.registered  # its copy is still queued
    sim.run(side)
    next(it2)
    next(it2)
    assert address not in sim.registered
    assert not any(lo == address for lo, _, _ in proc.maps())  # and unmapped
    assert sim.violations == [] and first_values([out]) == expected(1)
    it2._shutdown_workers()
    assert sim.registered == {}


def _warnings_of(fn, match) -> list:
    """(filename, message) of each warning `fn()` gives whose message holds `match`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [(w.filename, str(w.message)) for w in caught if match in str(w.message)]


def test_gate_warnings_point_at_the_users_line(monkeypatch):
    # issue 33 item 9: stacklevel=3 pointed into poolloader (pool.py, iterator.py)
    sim = SimCuda()
    sim.fail_unregister = {0: 1}
    loader = loader_with(sim, Full(8), pin_memory=True, slots=4, prefetch_factor=1)
    got = _warnings_of(lambda: [None for _batch in loader], "cudaHostUnregister")
    assert got and {f for f, _ in got} == {__file__}, got

    monkeypatch.setattr(cuda, "CLOSE_TIMEOUT_S", 0.3)
    sim = SimCuda()  # (the first one keeps the failed registration)
    loader = loader_with(sim, Full(8), pin_memory=True, slots=4, prefetch_factor=1)
    side = sim.stream(0)
    sim.work(side)
    side.hung = True
    it = iter(loader)
    batch = next(it)
    out = sim.copy(batch, side)
    del batch
    got = _warnings_of(it._shutdown_workers, "did not finish within")
    assert got and {f for f, _ in got} == {__file__}, got
    side.hung = False
    cuda.finish_deferred()
    assert sim.registered == {} and sim.violations == []
    assert first_values([out]) == expected(1)
