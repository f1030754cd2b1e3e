"""DataLoader at the edges (issue 12): each case with the stock DataLoader in the same
test as the reference, real workers, real shared memory, bounded waits."""
from __future__ import annotations

import gc
import inspect
import os
import pickle
import re
import signal
import subprocess
import sys
import warnings

import loader_datasets as ds
import pytest
import torch
from compare import assert_same, both_loaders, pool_only
from helpers import communicate_within
from torch.utils.data import DataLoader, TensorDataset

from poolloader import PoolLoader, WorkerDied
from poolloader.errors import ShmSpaceError
from poolloader.main.iterator import PoolLoaderIter

BOTH = (DataLoader, PoolLoader)


@pytest.mark.timeout(180)
def test_batch_size_40960_delivers_every_row_once():
    rows = 200_000
    data = TensorDataset(torch.arange(rows, dtype=torch.int64))
    seen = {}
    for cls in BOTH:
        loader = cls(data, batch_size=40_960, shuffle=True, num_workers=2,
                     generator=torch.Generator().manual_seed(3))
        seen[cls] = [b[0] for b in loader]
    assert [len(b) for b in seen[PoolLoader]] == [len(b) for b in seen[DataLoader]]
    for a, b in zip(seen[DataLoader], seen[PoolLoader]):
        assert torch.equal(a, b)
    assert torch.equal(torch.sort(torch.cat(seen[PoolLoader])).values, torch.arange(rows))


class OneHugeBatch:
    """A batch sampler with one index list far over the request area among normal ones."""

    def __init__(self, n=64):
        self.n = n

    def __iter__(self):
        yield [0, 1]
        yield list(range(self.n)) * 400  # ~25,600 indices
        yield [2, 3]

    def __len__(self):
        return 3


def test_a_huge_index_list_among_normal_ones():
    data = TensorDataset(torch.arange(64))
    out = {cls: [b[0].sum().item() for b in cls(data, batch_sampler=OneHugeBatch(), num_workers=2)]
           for cls in BOTH}
    assert out[PoolLoader] == out[DataLoader]


class FailingBatchSampler:
    """Yields 6 batches, then raises while the loader refills its pipeline."""

    def __iter__(self):
        for i in range(6):
            yield [2 * i, 2 * i + 1]
        raise ValueError("sampler broke after 6 batches")

    def __len__(self):
        return 8


def test_refill_error_never_replaces_a_decoded_batch():
    data = TensorDataset(torch.arange(16))
    delivered = {}
    for cls in BOTH:
        it = iter(cls(data, batch_sampler=FailingBatchSampler(), num_workers=2, prefetch_factor=1))
        got = []
        with pytest.raises(ValueError, match="sampler broke"):
            while True:
                got.append(next(it)[0].tolist())
        delivered[cls] = got
        del it
    # DataLoader raises from the next() whose refill failed and loses that batch;
    # PoolLoader delivers it and raises on the call after
    assert delivered[PoolLoader][:len(delivered[DataLoader])] == delivered[DataLoader]
    assert len(delivered[PoolLoader]) == len(delivered[DataLoader]) + 1
    assert delivered[PoolLoader] == [[2 * i, 2 * i + 1] for i in range(len(delivered[PoolLoader]))]


def _deliveries(it, clone=lambda b: b[0].clone()):
    """One delivered batch: (a copy of it, the requests sent so far: the prefetch depth)."""
    batch = next(it)
    return clone(batch), it._send_idx


def test_a_request_refused_for_shared_memory_is_sent_later():
    """With shm_limit, a request that needs a new slot while the consumer holds batches
    fails (ShmSpaceError, raised by the next call, and again while they are held); once
    they are dropped, the index drawn for it goes out: every batch of DataLoader's
    arrives, and the prefetch depth is DataLoader's again (one short only between the
    refusal and the retry)."""
    data = TensorDataset(torch.arange(24 * 100_000, dtype=torch.float32).view(24, 100_000))
    limit = (5 << 20) + 4096 + (512 << 10)  # 5 one-MiB slots and the control block, not 6

    def run(loader):
        it = iter(loader)
        held, out = [], []
        for _ in range(2):  # the consumer keeps the first two batches
            held.append(next(it))
            out.append((held[-1][0].clone(), it._send_idx))
        if isinstance(loader, PoolLoader):
            for _ in range(2):  # the refill's error, then the retry while still held
                with pytest.raises(ShmSpaceError, match="still hold"):
                    next(it)
        del held
        gc.collect()
        while True:
            try:
                out.append(_deliveries(it))
            except StopIteration:
                return out
    ref, got = both_loaders(lambda cls: cls(
        data, batch_size=2, num_workers=2, prefetch_factor=2,
        **pool_only(cls, slots=5, max_slots=6, shm_limit=limit)), run)
    assert_same([b for b, _ in ref], [b for b, _ in got])
    depth_ref, depth_got = [d for _, d in ref], [d for _, d in got]
    assert depth_got[1] == depth_ref[1] - 1, (depth_ref, depth_got)
    del depth_got[1], depth_ref[1]
    assert depth_got == depth_ref


class FlakyIndex(list):
    """A batch of indices whose first pickling fails (in this process only)."""

    failed: set = set()

    def __reduce__(self):
        if self[0] not in FlakyIndex.failed:
            FlakyIndex.failed.add(self[0])
            raise pickle.PicklingError(f"index {list(self)} cannot be pickled (once)")
        return list, (list(self),)


class FlakyOnce:
    """Batches of 2; the one starting at `flaky` is a FlakyIndex (None: none is)."""

    def __init__(self, n, flaky):
        self.n, self.flaky = n, flaky

    def __iter__(self):
        for i in range(0, self.n, 2):
            yield FlakyIndex([i, i + 1]) if i == self.flaky else [i, i + 1]

    def __len__(self):
        return self.n // 2


def test_an_index_that_fails_to_pickle_once_is_sent_on_the_next_call():
    """A request that cannot be pickled raises on the next call (as a refill error);
    the call after sends it again, and nothing is lost: the batches are DataLoader's
    for the same indices (with DataLoader the index is pickled by a queue thread, where
    an error loses it and the loader waits for it forever: it gets plain lists)."""
    data = TensorDataset(torch.arange(40))
    FlakyIndex.failed.clear()

    def run(loader):
        it = iter(loader)
        out = []
        while True:
            try:
                out.append(_deliveries(it, lambda b: b[0].tolist()))
            except StopIteration:
                return out
            except pickle.PicklingError:
                assert isinstance(loader, PoolLoader)
                out.append(("raised", None))
    ref, got = both_loaders(lambda cls: cls(
        data, batch_sampler=FlakyOnce(40, 10 if cls is PoolLoader else None), num_workers=2,
        prefetch_factor=2), run)
    assert ("raised", None) in got
    raised = got.index(("raised", None))
    got.pop(raised)
    assert [b for b, _ in got] == [b for b, _ in ref] == [[i, i + 1] for i in range(0, 40, 2)]
    depth_ref, depth_got = [d for _, d in ref], [d for _, d in got]
    # one short right after the failed refill, DataLoader's again from the next batch
    assert depth_got[raised - 1] == depth_ref[raised - 1] - 1, (raised, depth_ref, depth_got)
    del depth_got[raised - 1], depth_ref[raised - 1]
    assert depth_got == depth_ref


def test_a_batch_of_only_empty_tensors_equals_dataloaders():
    """Every small tensor of the batch is empty (shape (40960, 0), and a (0,) label): no
    small block is copied, and the batch is still DataLoader's."""
    data = TensorDataset(torch.empty(2 * 40_960, 0), torch.empty(2 * 40_960, 0, dtype=torch.int64))
    ref, got = both_loaders(lambda cls: cls(data, batch_size=40_960, num_workers=2))
    assert len(got) == len(ref) == 2 and got[0][0].shape == (40_960, 0)
    assert_same(ref, got)


def nested_collate(batch):
    return torch.nested.nested_tensor([b[0][: int(b[0][0]) + 1] for b in batch])


def test_nested_tensors_take_the_pickled_fallback():
    data = TensorDataset(torch.arange(40, dtype=torch.float32).view(10, 4) % 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        out = {cls: list(cls(data, batch_size=3, num_workers=2, collate_fn=nested_collate))
               for cls in BOTH}
    assert len(out[PoolLoader]) == len(out[DataLoader]) == 4
    for a, b in zip(out[DataLoader], out[PoolLoader]):
        assert b.is_nested
        assert [x.tolist() for x in a.unbind()] == [x.tolist() for x in b.unbind()]


def test_a_worker_killed_by_a_signal_is_reported_in_dataloaders_words():
    """Code that recognises a dead worker by DataLoader's message (PyTorch's own
    test_segfault does) finds it in PoolLoader's too."""
    for cls in BOTH:
        loader = cls(ds.SegfaultDataset(), batch_size=2, num_workers=2,
                     worker_init_fn=ds.quiet_stderr)
        with pytest.raises(RuntimeError) as died:
            next(iter(loader))
        text = f"{died.value} {died.value.__cause__}"
        assert re.search(r"DataLoader worker \(pid \d+\) is killed by signal: Segmentation fault",
                         text), (cls.__name__, text)
        # PoolLoader's own words, not DataLoader's SIGCHLD handler raising for its own
        # dead workers inside PoolLoader's code (it checks them on every SIGCHLD while
        # their iterator lives): that iterator is dropped before PoolLoader's turn
        assert cls is DataLoader or "PoolLoader worker" in text, text
        del died
        gc.collect()


def test_persistent_loader_after_a_worker_died_says_so():
    for cls in BOTH:
        # timeout: DataLoader's second epoch waits for the dead worker's reply until then
        loader = cls(ds.PidDataset(n=40), batch_size=2, num_workers=2, persistent_workers=True,
                     timeout=5)
        it = iter(loader)
        os.kill(int(next(it)[0, 1]), signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            for _ in it:
                pass
        # iterating the loader again: a clear error, never an AttributeError from internals
        with pytest.raises(RuntimeError) as again:
            for _ in loader:
                pass
        assert not isinstance(again.value, AttributeError)
        if cls is PoolLoader:
            assert "shut down by the error raised before" in str(again.value)
            assert "WorkerDied" in str(again.value) and "build the loader again" in str(again.value)
            with pytest.raises(RuntimeError, match="WorkerDied"):
                next(it)
        # `again`'s traceback holds the iterator's frames: drop it too, so the iterator
        # shuts its workers down here. Left to the leak check's SIGKILL, DataLoader's
        # surviving worker would fire DataLoader's SIGCHLD handler inside pytest itself.
        del it, loader, again
        gc.collect()


def test_forkserver_unpicklable_init_fn_warns_then_raises():
    """PoolLoader warns with DataLoader's words (torch 2.13 says them; 2.6 only raises),
    then raises what the start raised."""
    def local_init(worker_id):  # a local function: not picklable
        pass
    for cls in BOTH:
        loader = cls(TensorDataset(torch.arange(8)), batch_size=2, num_workers=1,
                     multiprocessing_context="forkserver", worker_init_fn=local_init)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises((AttributeError, TypeError, Exception)) as raised:
                iter(loader)
        assert "local_init" in str(raised.value) or "pickle" in str(raised.value).lower()
        warned = any("Got pickle error when attempting to start a worker" in str(w.message)
                     for w in caught)
        assert warned or cls is DataLoader, caught


def test_worker_objects_still_join_and_report_exit_codes():
    for cls in BOTH:
        it = iter(cls(TensorDataset(torch.arange(8)), batch_size=2, num_workers=2))
        workers = list(it._workers)
        assert all(w.is_alive() and w.exitcode is None for w in workers)
        workers[0].join(0.05)  # alive: times out, no error
        assert workers[0].is_alive()
        assert len(list(it)) == 4  # the epoch ends: the loader stops its workers
        for w in workers:
            w.join(10)
            assert not w.is_alive() and w.exitcode is not None
    # a worker killed under a PoolLoader: join returns and the exit code says how it died
    it = iter(PoolLoader(TensorDataset(torch.arange(8)), batch_size=2, num_workers=2))
    os.kill(it._workers[1].pid, signal.SIGKILL)
    it._workers[1].join(10)
    assert it._workers[1].exitcode == -signal.SIGKILL
    with pytest.raises(WorkerDied, match="signal 9"):
        list(it)


class _Interrupt:
    """A trace function that raises KeyboardInterrupt once, at a chosen line of a chosen
    function (`after=True`: at the next line it runs after that one, i.e. as soon as
    that line's calls returned): an asynchronous exception placed exactly, where a
    signal handler's could land, without mocking anything."""

    def __init__(self, code, line, after=False):
        self.code, self.line, self.after, self.fired = code, line, after, False
        self._passed = False

    def __call__(self, frame, event, arg):
        if frame.f_code is self.code:
            return self.local
        return None

    def local(self, frame, event, arg):
        if event != "line" or self.fired:
            return self.local
        if frame.f_lineno == self.line and not self.after:
            self.fired = True
            raise KeyboardInterrupt
        if self._passed and frame.f_lineno != self.line:
            self.fired = True
            raise KeyboardInterrupt
        if frame.f_lineno == self.line:
            self._passed = True
        return self.local


def test_keyboard_interrupt_after_decode_loses_no_slot():
    """KeyboardInterrupt right after a batch was decoded, before next() returns it: the
    batch is gone (as with DataLoader) but its slot comes back, epoch after epoch."""
    from poolloader.main.iterator import PoolLoaderIter
    code = PoolLoaderIter._process_data.__code__
    source, first = __import__("inspect").getsourcelines(PoolLoaderIter._process_data)
    line = first + next(i for i, text in enumerate(source) if "del _lease" in text)
    data = TensorDataset(torch.arange(40 * 20_000, dtype=torch.float32).view(40, 20_000))
    loader = PoolLoader(data, batch_size=2, num_workers=2, persistent_workers=True)
    for _epoch in range(3):
        it = iter(loader)
        next(it)
        trace = _Interrupt(code, line)
        sys.settrace(trace)
        try:
            with pytest.raises(KeyboardInterrupt):
                next(it)
        finally:
            sys.settrace(None)
        assert trace.fired
        assert sum(1 for _ in it) == 18
    gc.collect()
    ledger = it._ledger
    ledger.drain()
    assert len(ledger.free) == ledger.pool.num_slots and not ledger.leases
    assert loader.stats.detaches == 0 and loader.stats.pool_growths == 0
    ref = [b[0] for b in DataLoader(data, batch_size=2)]
    assert len(ref) == 20


# -- interrupts between a ring operation and main's record of it (issue 33, item 2) --------

def _line(function, text: str) -> tuple:
    """(code, line number) of the first line of `function` that contains `text`."""
    source, first = inspect.getsourcelines(function)
    return function.__code__, first + next(i for i, t in enumerate(source) if text in t)


def _request_sender():
    """The PoolLoaderIter method that pushes a request on a worker's request ring."""
    for name in ("_send", "_put_one"):
        function = getattr(PoolLoaderIter, name, None)
        if function is not None and ".push(" in inspect.getsource(function):
            return function
    raise AssertionError("no PoolLoaderIter method pushes requests")


class _TracedInterrupt:
    """Arms an _Interrupt at `text` of `function` (a PoolLoaderIter method) for the
    calls made inside the `with`."""

    def __init__(self, function, text, after):
        self.trace = _Interrupt(*_line(function, text), after=after)

    def __enter__(self):
        sys.settrace(self.trace)
        return self.trace

    def __exit__(self, *exc):
        sys.settrace(None)


class _UnlinkInterrupt:
    """KeyboardInterrupt from the first pool.unlink_mapped() main calls once it took a
    reply off a done ring (the one function it calls there), then the real one."""

    def __init__(self, it):
        self.pool, self.fired = it._pool, False

    def __enter__(self):
        real = type(self.pool).unlink_mapped.__get__(self.pool)

        def unlink_mapped():
            if not self.fired:
                self.fired = True
                raise KeyboardInterrupt
            return real()
        self.pool.unlink_mapped = unlink_mapped
        return self

    def __exit__(self, *exc):
        del self.pool.unlink_mapped


INTERRUPT_POINTS = {
    # a reply was popped from a done ring, main has not recorded it yet
    "after_pop": lambda it: _UnlinkInterrupt(it),
    "after_pop_in_next": lambda it: _TracedInterrupt(
        PoolLoaderIter._next_host, "idx, worker = ledger.inflight[slot]", after=False),
    # a request was recorded, not yet pushed on the worker's request ring
    "before_push": lambda it: _TracedInterrupt(_request_sender(), ".push(", after=False),
    # the push returned (a signal handler runs as a call returns)
    "after_push": lambda it: _TracedInterrupt(_request_sender(), ".push(", after=True),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("then", ["go_on", "next_epoch"])
@pytest.mark.parametrize("point", sorted(INTERRUPT_POINTS))
def test_an_interrupt_between_a_ring_and_the_ledger_loses_nothing(point, then):
    """KeyboardInterrupt at the exact points where a slot has left a ring but is not yet
    in main's record, or is recorded but not yet on a ring: the epoch goes on with
    every batch DataLoader delivers ("go_on"), or the next epoch of the persistent
    loader starts without waiting for a phantom slot ("next_epoch"), and its batches
    are DataLoader's. timeout= turns a wait for a lost reply into an error.

    A request is sent by the refill after a batch was decoded: the interrupt there
    loses that one batch with the call, as DataLoader's would (and as in
    test_keyboard_interrupt_after_decode_loses_no_slot), but the request goes out
    once, its index neither skipped nor sent twice; an interrupt after a pop loses
    nothing (the next call delivers that reply)."""
    data = TensorDataset(torch.arange(40 * 20_000, dtype=torch.float32).view(40, 20_000))
    interrupted_at = []

    def run(loader):
        it = iter(loader)
        first = [next(it)[0].clone() for _ in range(3)]
        if isinstance(loader, PoolLoader):
            with INTERRUPT_POINTS[point](it) as armed:
                while not armed.fired:  # the point is reached within a next() or two
                    try:
                        first.append(next(it)[0].clone())
                    except KeyboardInterrupt:
                        assert armed.fired
                        interrupted_at.append(len(first))
        if then == "go_on" or isinstance(loader, DataLoader):
            first += [b[0].clone() for b in it]
        second = [b[0].clone() for b in loader]
        return first, second

    ref, got = both_loaders(lambda cls: cls(
        data, batch_size=2, shuffle=True, num_workers=2, persistent_workers=True, timeout=20,
        generator=torch.Generator().manual_seed(5)), run)
    [k] = interrupted_at
    expected = list(ref[0])
    if point.endswith("push"):
        del expected[k]  # the batch the interrupted call had decoded
    if then == "go_on":
        assert_same(expected, got[0], "interrupted epoch")
    else:
        assert_same(expected[:len(got[0])], got[0], "interrupted epoch")
    assert_same(ref[1], got[1], "next epoch")


# -- a failed slot replacement (issue 33, item 4) -------------------------------------------

@pytest.mark.timeout(180)
def test_a_slot_whose_replacement_failed_is_not_lost():
    """take() finds a FREE slot smaller than the pool's size since a batch grew one, and
    its replacement fails for space (injected once, where the new segment is created):
    the request's next() raises ShmSpaceError, and the slot comes back, so the epoch
    goes on with all its slots: no detach, no "the consumer still holds batches"
    warning, DataLoader's batches."""
    items = [torch.full((64_000,), float(i)) for i in range(30)]  # 256 KB: in a 1 MiB slot
    items[6] = torch.full((600_000,), 6.0)  # 2.4 MB: its slot grows, the others follow lazily
    data = ds.ListDataset(items)
    kw = dict(batch_size=None, num_workers=2)
    ref = [b.clone() for b in DataLoader(data, **kw)]
    loader = PoolLoader(data, slot_bytes=1 << 20, **kw)
    it = iter(loader)
    pool = it._pool
    ledger = it._ledger
    real_take, real_replace, real_create = ledger.take, pool.replace, pool.segments.create
    failed, taking = [], []

    def create(*args, **kwargs):
        pool.segments.create = real_create
        raise ShmSpaceError("injected: no room for the replacement segment")

    def take(*args, **kwargs):
        taking.append(True)
        try:
            return real_take(*args, **kwargs)
        finally:
            taking.pop()

    def replace(slot, nbytes, written=None):
        # take()'s, not a worker's request to grow (a worker that finds its slot smaller
        # than the largest batch it wrote asks before it fetches: poolloader.worker)
        if not failed and taking:
            failed.append(slot)
            pool.segments.create = create
        return real_replace(slot, nbytes, written)
    ledger.take, pool.replace = take, replace
    got, errors = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = None  # the one the loop holds while the next is fetched, as `for` does
        while True:
            try:
                batch = next(it)
            except ShmSpaceError as e:  # a user who logs it and goes on (keeping it would
                errors.append(str(e))   # keep the batch its traceback reaches)
                continue
            except StopIteration:
                break
            got.append(batch.clone())
    del batch
    assert failed and len(errors) == 1 and "injected" in errors[0], (failed, errors)
    held = [str(w.message) for w in caught if "still holds" in str(w.message)]
    assert not held and loader.stats.detaches == 0, held
    assert_same(ref, got)


_COLLECTED_UNDER_THE_LIVE_LOCK = """
import gc
import torch
from torch.utils.data import TensorDataset
from poolloader import PoolLoader
from poolloader.main import supervise

it = iter(PoolLoader(TensorDataset(torch.arange(8)), batch_size=2, num_workers=1))
next(it)
workers = list(it._workers)
it.cycle = it  # only the collector frees it
del it
with supervise._live_lock:  # as in track(): the collector runs on an allocation there
    gc.collect()
print("stopped" if not any(w.is_alive() for w in workers) else "alive", flush=True)
"""


def test_an_iterator_collected_inside_track_shuts_down():
    """The collector can finalise a dead iterator while this thread holds the live-set
    lock (track() allocates under it); the teardown's untrack takes it again. Run in a
    child: with a lock that is not reentrant it would wait for itself forever."""
    child = subprocess.Popen([sys.executable, "-c", _COLLECTED_UNDER_THE_LIVE_LOCK],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_within(child, 60, "collecting an iterator under the live-set lock")
    assert child.returncode == 0 and out.strip() == "stopped", (out, err[-2000:])
