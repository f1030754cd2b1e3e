"""A KeyboardInterrupt (or any exception a signal handler raises) at the points where
main's record of a batch or a request is in two places at once (issue 44, item 9).

A signal handler runs between bytecodes, as a call returns or a function is entered.
Each test places the exception exactly there with a trace function (sys.settrace),
without mocking anything: the loader's own code path raises it. DataLoader loses the
batch whose next() is interrupted; so may PoolLoader, but no more: the next next()
and the next epoch give DataLoader's batches minus at most that one, with no batch
twice, no hang (timeout= bounds every wait) and every slot back.

The share_batches windows (FollowerIter between receive() and its counters, and a
leader interrupted as it enters _process_data) run on real ranks (test_share_review's
launcher, tests/_review_children.py).
"""
from __future__ import annotations

import gc
import inspect
import sys

import loader_datasets as ds
import pytest
import test_node_pool
import torch
from compare import assert_same, both_loaders

from poolloader import PoolLoader
from poolloader.main.iterator import PoolLoaderIter

HERE = test_node_pool.HERE
REVIEW_CHILD = f"{HERE}/_review_children.py"


def _line(function, text: str) -> int:
    """The number of the first line of `function` that contains `text`."""
    source, first = inspect.getsourcelines(function)
    return first + next(i for i, t in enumerate(source) if text in t)


class _AfterLine:
    """Raises KeyboardInterrupt once, in `function`, at the first line it runs after
    the first line holding `text` (so as soon as that line's calls returned)."""

    def __init__(self, function, text: str):
        self.code, self.line = function.__code__, _line(function, text)
        self.passed = self.fired = False

    def __call__(self, frame, event, arg):
        return self.local if frame.f_code is self.code else None

    def local(self, frame, event, arg):
        if event != "line" or self.fired:
            return self.local
        if self.passed and frame.f_lineno != self.line:
            self.fired = True
            raise KeyboardInterrupt
        if frame.f_lineno == self.line:
            self.passed = True
        return self.local


class _AtEntry:
    """Raises KeyboardInterrupt once, as `function` is entered (where a signal handler
    runs at a function's first instruction): its arguments are its caller's only record."""

    def __init__(self, function):
        self.code, self.fired = function.__code__, False

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code is self.code and not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return None


def _two_epochs(loader, trap_for, fired: list, keep=lambda batch: batch, after=None) -> list:
    """Two epochs of `loader` next() by next(); call k of the first runs under the trace
    function `trap_for(k)` gives (None: none), and one it interrupts is recorded in
    `fired` (KeyboardInterrupt must come from that trap). Each batch is kept as
    `keep(batch)`, then `after(it)` runs. After each of a PoolLoader's epochs, every
    slot is back FREE, none was detached and no move is left half done."""
    epochs = []
    for epoch in range(2):
        it = iter(loader)
        got, batch, k = [], None, 0
        while True:
            trap = trap_for(k) if epoch == 0 and isinstance(loader, PoolLoader) else None
            if trap is not None:
                sys.settrace(trap)
            try:
                batch = next(it)
            except StopIteration:
                break
            except KeyboardInterrupt:
                assert trap is not None and trap.fired
                fired.append(k)
                k += 1
                continue
            finally:
                if trap is not None:
                    sys.settrace(None)
            got.append(keep(batch))
            k += 1
            if after is not None:
                after(it)
        del batch
        epochs.append(got)
        if isinstance(loader, PoolLoader):
            gc.collect()
            ledger = loader._iterator._ledger
            ledger.drain()
            assert not ledger.leases and not ledger.inflight, (ledger.leases, ledger.inflight)
            assert sorted(ledger.free) == list(range(ledger.pool.num_slots)), \
                f"slots not back after epoch {epoch}: free {sorted(ledger.free)} " \
                f"of {ledger.pool.num_slots}"
            assert loader.stats.detaches == 0 and ledger.moving is None
    return epochs


def _clone_tensors(batch: dict) -> dict:
    """What an epoch keeps of a batch: its tensors copied, so that no slot stays held."""
    return {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in batch.items()}


def _assert_epochs(ref: list, got: list, k: int) -> bool:
    """The interrupted epoch is DataLoader's less at most call k's batch, none twice; the
    next epoch is DataLoader's. True when batch k was lost."""
    first, expected = got[0], ref[0]
    lost = len(first) != len(expected)  # else cut short before its batch left: none lost
    assert_same(expected[:k] + expected[k + 1:] if lost else expected, first, "interrupted epoch")
    assert_same(ref[1], got[1], "next epoch")
    return lost


WINDOWS = {
    # _draw: the sampler's index returned (the tracker drew it), not yet held
    "draw_index": lambda: _AfterLine(PoolLoaderIter._draw, "self._next_index()"),
    # _draw: the round robin gave its worker, not yet held
    "draw_worker": lambda: _AfterLine(PoolLoaderIter._draw, "self._worker_queue_idx_cycle"),
    # _next_host hands the READY batch to _process_data
    "process_data_entry": lambda: _AtEntry(PoolLoaderIter._process_data),
    # the batch was decoded; its refill (DataLoader's _try_put_index) not yet owed
    "refill_entry": lambda: _AtEntry(PoolLoaderIter._refill),
}
K = 3  # the next() interrupted (0-based): batches 0..2 were delivered


@pytest.mark.timeout(240)
@pytest.mark.parametrize("window", sorted(WINDOWS))
def test_an_interrupted_next_loses_at_most_its_batch(window):
    """The interrupted next() raises KeyboardInterrupt; the next next()s give the rest
    of DataLoader's epoch, less at most batch K (lost with the call, as DataLoader
    loses it), none twice, and the next epoch is DataLoader's. Each batch is held
    while the next is fetched, as a `for` loop holds it, and all slots come back: a
    slot lost on the way would be missed by the pool (a detach), and DataLoader's
    prefetch depth (num_workers × prefetch_factor requests out) holds after each next().

    Today's draws lose the batch after K too (the sampler's index, or the worker the
    round robin gave, went with the interrupt, so every later batch comes from the
    other worker); an interrupt as _process_data is entered loses batch K's slot; one
    as the refill is entered loses the refill: no batch (the sampler is drawn to its
    end all the same), but one request fewer is out for the rest of the epoch."""
    data = ds.AugmentDataset(n=37, shape=(64,))
    fired: list[int] = []
    depths: list[int] = []

    def depth(it):
        if isinstance(it, PoolLoaderIter) and not it._sampler_exhausted:
            # DataLoader's prefetch: num_workers × prefetch_factor requests out
            depths.append(it._slots_out() + len(it._held))

    def run(loader):
        return _two_epochs(loader, lambda k: WINDOWS[window]() if k == K else None, fired,
                           after=depth)

    ref, got = both_loaders(lambda cls: cls(
        data, batch_size=3, shuffle=True, num_workers=2, persistent_workers=True, timeout=30,
        generator=torch.Generator().manual_seed(7)), run)
    assert fired == [K], fired
    assert depths and set(depths) == {2 * 2}, depths
    if not _assert_epochs(ref, got, K):
        assert window == "process_data_entry"


# -- share_batches: real ranks (tests/_review_children.py) ---------------------------------

def _review_ranks(tmp_path, monkeypatch, case: str, arg: str = ""):
    monkeypatch.setattr(test_node_pool, "CHILD", REVIEW_CHILD)
    return test_node_pool._ranks(tmp_path, case, 2, arg)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["follower_interrupt", "leader_interrupt"])
def test_an_interrupted_rank_of_a_share_group_loses_at_most_its_batch(tmp_path, monkeypatch,
                                                                      case):
    """share_batches=[0, 1], persistent workers, two epochs. "follower_interrupt": the
    follower's third next() is interrupted as soon as link.receive() returned (before
    its counters moved); "leader_interrupt": the leader's, as it enters _process_data.
    Every rank's epochs are its DataLoader's, less at most that one batch on the rank
    interrupted, and the next epoch is whole.

    Today the follower's next next() waits for the batch it already read and gets the
    one after ("internal error: ... got batch 3 ..., expecting batch 2"); the leader's
    lost batch leaves its publishing one behind its follower's sampler (a ValueError on
    the follower: the batch's samples are not its sampler's)."""
    results, codes, logs = _review_ranks(tmp_path, monkeypatch, case)
    assert codes == [0, 0], logs
    trapped = 1 if case == "follower_interrupt" else 0
    for rank, r in enumerate(results):
        assert r["fired"] == ([2] if rank == trapped else []), (rank, r, logs)
        assert r["equal0"] and r["equal1"], (rank, r, logs)
        assert r["lost"] in ((0, 1) if rank == trapped else (0,)), (rank, r)


# -- a request moved before its worker starts on it (issue 45: PoolLoaderIter._move_newest) --

MOVE_WINDOWS = {
    # recorded in ledger.moving, the target not yet off `free` nor in `inflight`
    "move_recorded": lambda: _AfterLine(PoolLoaderIter._move_newest, "ledger.moving = ("),
    # the claim swapped and the target pushed (one C call), nothing recorded after it
    "move_pushed": lambda: _AtEntry(PoolLoaderIter._settle_move),
    # _settle_move half done: the old slot out of `inflight`, not yet FREE
    "move_settling": lambda: _AfterLine(PoolLoaderIter._settle_move, "self._sent_indices.pop"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("window", sorted(MOVE_WINDOWS))
def test_an_interrupted_move_loses_at_most_its_batch(window):
    """A worker-bound loop (moves happen at most calls); the first next() that reaches
    the window is interrupted there. The epoch is DataLoader's less at most that call's
    batch, none twice; the next epoch is DataLoader's; every slot comes back, none is
    detached, and no request is lost (the epoch ends: timeout= bounds every wait)."""
    data = ds.SlowAugmentDataset(n=40, delay=0.02)
    fired: list[int] = []

    def run(loader):
        return _two_epochs(loader, lambda k: None if fired else MOVE_WINDOWS[window](), fired,
                           keep=_clone_tensors)

    ref, got = both_loaders(lambda cls: cls(
        data, batch_size=2, shuffle=True, num_workers=2, persistent_workers=True, timeout=30,
        generator=torch.Generator().manual_seed(9)), run)
    assert len(fired) == 1, fired
    _assert_epochs(ref, got, fired[0])


class _CountingBell:
    """A process's real doorbell, noting what `ledger.moving` was at each ring."""

    def __init__(self, bell, ledger, rings: list):
        self.bell, self.ledger, self.rings = bell, ledger, rings

    def ring(self):
        self.rings.append(self.ledger.moving)
        self.bell.ring()


@pytest.mark.timeout(240)
def test_a_move_interrupted_after_its_push_rings_its_hosts_doorbell_at_the_next_call():
    """node_workers=1: one process hosts both workers and sleeps on a doorbell when its
    rings are empty. A move interrupted after its push, before the ring, is rung by the
    next call's settle, while that move is still recorded (else its host could sleep a
    whole wait slice, 0.25 s, with a request on its ring). The batches are as above."""
    data = ds.SlowAugmentDataset(n=40, delay=0.02)
    fired: list[int] = []
    pending: list = []  # ledger.moving as the trap found it
    rings: list = []

    class _Trap(_AtEntry):
        def __call__(self, frame, event, arg):
            if event == "call" and frame.f_code is self.code and not self.fired:
                pending.append(frame.f_locals["self"]._ledger.moving)
            return _AtEntry.__call__(self, frame, event, arg)

    def run(loader):
        def trap_for(k):
            it = loader._iterator
            if not isinstance(it._request_bells[0], _CountingBell):
                it._request_bells = [_CountingBell(b, it._ledger, rings) for b in it._request_bells]
            return None if fired else _Trap(PoolLoaderIter._settle_move)

        return _two_epochs(loader, trap_for, fired,
                           keep=_clone_tensors)

    ref, got = both_loaders(lambda cls: cls(
        data, batch_size=2, shuffle=True, num_workers=2, persistent_workers=True, timeout=30,
        generator=torch.Generator().manual_seed(9),
        **({"node_workers": 1} if cls is PoolLoader else {})), run)
    assert len(fired) == 1 and len(pending) == 1 and pending[0] is not None, (fired, pending)
    assert any(moving is pending[0] for moving in rings), "the interrupted move was never rung"
    _assert_epochs(ref, got, fired[0])
