"""A request moved before its worker starts on it (issue 45): the request sent into a
slot whose pages no batch wrote moves, at the next call, to the FREE slot the consumer
just left, so a worker-bound `for` loop keeps one slot of its pool uncharged
(PoolLoaderIter._move_newest). Whoever swaps the slot's claim word first has the
request: its worker, popping it, or main, moving it; the loser leaves it alone.

Real workers over real shared memory: the batches are DataLoader's, bit for bit, what
the pool holds is read from the kernel (Mapping.resident_bytes), and the races between a
move and its worker's pop are run, not simulated.
"""
from __future__ import annotations

import time

import loader_datasets as ds
import pytest
import torch
from compare import assert_same, both_loaders

from poolloader import PoolLoader
from poolloader.wire import slot_format as fmt

SAMPLE_BYTES = (1 << 16) * 4  # SlowAugmentDataset's image


def _copy(batch: dict) -> dict:
    """What the comparison keeps of a batch: copies, so that no slot stays held."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _written_slots(it) -> int:
    """Slots whose data pages hold at least one sample's bytes (the kernel's count)."""
    return sum(m is not None and m.resident_bytes() >= SAMPLE_BYTES for m in it._pool.mappings)


def test_a_worker_bound_loop_keeps_one_slot_clean_and_dataloaders_batches():
    """2 workers × prefetch 2 = 4 requests out, a pool of 6 slots (4 + the batch being
    delivered + the one a `for` loop still holds). Without moves all 6 are written
    after the first few batches; with them 5: the newest request waits in the sixth,
    clean one until the next call moves it. The batches are DataLoader's.

    A move needs main's next call to come before the newest request's worker finishes
    the batch ahead of it: about half a batch, 60 ms here. At 30 ms a loaded machine
    (a -n 2 suite beside two busy loops) once kept main away longer: a race lost, all
    six slots written, and 16 takes until pages went back (RETURN_EVERY)."""
    data = ds.SlowAugmentDataset(n=48, delay=0.06)
    written, moved = [], []

    def run(loader):
        got = []
        it = iter(loader)
        for k, batch in enumerate(it):
            got.append(_copy(batch))
            if isinstance(loader, PoolLoader) and k >= 4 and len(got) < 20:
                written.append(_written_slots(it))
            del batch
        if isinstance(loader, PoolLoader):
            moved.append(loader.stats.requests_moved)
        return got

    ref, got = both_loaders(lambda cls: cls(
        data, batch_size=2, shuffle=True, num_workers=2, timeout=60,
        generator=torch.Generator().manual_seed(5)), run)
    assert_same(ref, got)
    print(f"moved {moved[0]} of {len(got)} requests; slots written {written}")
    assert moved[0] >= len(got) // 2, moved
    assert written and max(written) == 5, written


def test_moves_racing_their_workers_keep_every_batch_over_epochs():
    """Jittered samples and a jittered consumer: moves and their workers' pops race,
    some won by each side. Two epochs with persistent workers (a stale ring entry of
    the first epoch is popped in the second), every batch DataLoader's."""
    data = ds.SlowAugmentDataset(n=240, jitter=0.01, numel=1 << 15)
    moved = []

    def run(loader):
        epochs = []
        for _ in range(2):
            got = []
            for k, batch in enumerate(loader):
                got.append(_copy(batch))
                del batch
                time.sleep(0.004 * (k * 40503 % 997) / 997)
            epochs.append(got)
        if isinstance(loader, PoolLoader):
            moved.append(loader.stats.requests_moved)
        return epochs

    ref, got = both_loaders(lambda cls: cls(
        data, batch_size=1, shuffle=True, num_workers=2, persistent_workers=True, timeout=60,
        generator=torch.Generator().manual_seed(11)), run)
    for epoch, (a, b) in enumerate(zip(ref, got)):
        assert_same(a, b, f"epoch {epoch}")
    print(f"moved {moved[0]} of {2 * len(got[0])} requests")
    assert moved[0] > 0


def test_moves_while_slots_grow_and_one_worker_keeps_a_deep_prefetch():
    """Two ways a move went wrong in review (helper-21), each the run that showed it:
    (1) batches that keep outgrowing their slots, so a worker popped a moved request's
    old entry while main was replacing that slot's segment (generation 0): the worker
    mapped the slot to read its claim word and died (7 runs in 16 of 300 samples; 200
    here, so that DataLoader's batches fit a 64 MiB /dev/shm); the claim word is in
    the control block now. (2) One worker with prefetch_factor=5: its ring held each
    slot in flight and a stale entry per moved request, more than one cell per slot,
    and a push found it full (`SlotCorrupt`). Both loaders' batches are DataLoader's."""
    for make in (
            lambda cls: cls(ds.GrowingDataset(n=200), batch_size=None, num_workers=2,
                            timeout=30),
            lambda cls: cls(ds.SlowAugmentDataset(n=60, delay=0.01), batch_size=1,
                            num_workers=1, prefetch_factor=5, timeout=30)):
        moved = []

        def run(loader, moved=moved):
            got = []
            for batch in loader:
                got.append(_copy(batch) if isinstance(batch, dict) else batch.clone())
                del batch
            if isinstance(loader, PoolLoader):
                moved.append(loader.stats.requests_moved)
            return got

        ref, got = both_loaders(make, run)
        assert_same(ref, got)
        print(f"moved {moved[0]} of {len(got)}")
        assert moved[0] > 0


def test_a_pool_larger_than_a_ring_value_addresses_is_refused():
    """A request ring's value carries the slot in SLOT_BITS bits: a pool that could
    grow past that is refused with the numbers and the options, before any worker."""
    loader = PoolLoader(list(range(4)), num_workers=1, max_slots=fmt.MAX_SLOTS + 1)
    with pytest.raises(ValueError, match=f"more than the {fmt.MAX_SLOTS} .*max_slots="):
        iter(loader)


def _slow_collate(batch):
    time.sleep(0.02)  # worker-bound: moves happen at most calls
    return torch.tensor(batch)


def test_a_request_too_large_for_the_request_area_does_not_move():
    """An index list longer than the request area holds (9000 int64 indices: 72 KB,
    against 64 KiB) is written at the start of the slot's data pages, so the slot it
    went into is written: moving the request from it would leave that slot counted
    clean with the request's pages charged. Such a request stays where it is; no slot
    counted clean holds more than its request area (64 KiB) in memory; the batches are
    DataLoader's."""
    data = list(range(16 * 9000))
    moved, dirty_clean = [], []

    def run(loader):
        got = []
        it = iter(loader)
        for batch in it:
            got.append(batch.clone())
            del batch
            if isinstance(loader, PoolLoader):
                pool, ledger = it._pool, it._ledger
                dirty_clean.extend(s for s in ledger.clean if pool.mappings[s] is not None
                                   and pool.mappings[s].resident_bytes() > fmt.DATA_OFF)
        if isinstance(loader, PoolLoader):
            moved.append(loader.stats.requests_moved)
        return got

    ref, got = both_loaders(lambda cls: cls(
        data, batch_size=9000, num_workers=2, collate_fn=_slow_collate, timeout=30), run)
    assert_same(ref, got)
    assert len(fmt.encode_request(list(range(9000)), True)) > fmt.REQUEST_MAX
    assert moved == [0] and not dirty_clean, (moved, dirty_clean)
