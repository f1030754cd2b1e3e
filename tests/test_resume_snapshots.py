"""Resume with snapshots (PoolLoader(snapshot_every_n_steps=)): a worker's dataset and
iterator state ride only with snapshot batches; `state_dict()` holds each worker's last
snapshot and the indices it fetched since, which a resumed worker replays (fetch and
drop, from the snapshot's random state). The resumed batches must be bit-identical to
an uninterrupted run's, random augmentation and per-fetch dataset state included.

Each case runs a loader uninterrupted and takes its state at step k on the way
(state_dict() does not disturb the workers), then a new loader in this process loads
that state (through torch.save / torch.load(weights_only=True)) and runs to the end.
"""
from __future__ import annotations

import io
import os
import random
import sys
import warnings

import numpy as np
import pytest
import torch

from poolloader import PoolLoader
from poolloader.resume import keys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _resume_cases import canon  # noqa: E402
from _snapshot_cases import DATASETS, CallCounter, HistoryModule  # noqa: E402

TIMEOUT_S = 60  # every wait for a batch is bounded
SIZES = {"map": dict(n=37, batch_size=3), "module": dict(n=37, batch_size=3),
         "stream": dict(n=41, batch_size=4)}


def _loader(dataset, persistent, every, loader=PoolLoader, **kw):
    size = SIZES[dataset]
    ds = DATASETS[dataset](size["n"])
    # generator=: the epochs after the resumed one draw their base seed from it (without
    # it, from the global RNG, which is the caller's to restore)
    kw["generator"] = torch.Generator().manual_seed(7)
    if dataset != "stream":
        kw["shuffle"] = True
    if loader is PoolLoader:
        kw["snapshot_every_n_steps"] = every
    return loader(ds, batch_size=size["batch_size"], num_workers=2, persistent_workers=persistent,
                  timeout=TIMEOUT_S, **kw)


def _reseed(seed=2024):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _save(state) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _run(loader, epochs, save_at=None):
    """Canonical batches of `epochs` epochs; with save_at=(epoch, k), also the state
    once batch k of that epoch was delivered (k + 1 batches; "end": after it ended)."""
    batches, state = [], None
    for epoch in range(epochs):
        for k, batch in enumerate(loader):
            if save_at == (epoch, k):
                state = _save(loader.state_dict())
            batches.append(canon(batch))
        if save_at == (epoch, "end"):
            state = _save(loader.state_dict())
    return batches, state


CASES = [(dataset, persistent, every)
         for dataset in ("map", "stream", "module")
         for persistent in (False, True)
         for every in (1, 3, 1000, None)]


@pytest.mark.parametrize("dataset,persistent,every", CASES)
def test_resume_mid_epoch_with_snapshots_is_exact(dataset, persistent, every):
    """Saved after step 6 of the second epoch (after a whole first one, so a persistent
    worker's epoch starts where its first epoch's snapshot and replays left it),
    resumed in a new loader: the rest of that epoch and the next are the same bytes."""
    _reseed()
    reference, state = _run(_loader(dataset, persistent, every), 3, save_at=(1, 6))
    per_epoch = len(reference) // 3
    assert state is not None and per_epoch > 6
    _reseed(99)  # the resumed run's process draws differently: the state must carry it all
    resumed = _loader(dataset, persistent, every)
    resumed.load_state_dict(state)
    got, _ = _run(resumed, 2)
    assert got == reference[per_epoch + 7:]


@pytest.mark.parametrize("dataset", ["map", "stream"])
@pytest.mark.parametrize("every", [3, 1000])
def test_resume_after_an_epoch_end_with_persistent_workers_is_exact(dataset, every):
    """Saved after the first epoch ended: each persistent worker's next epoch starts
    from its last snapshot and the fetches after it."""
    _reseed()
    reference, state = _run(_loader(dataset, True, every), 2, save_at=(0, "end"))
    _reseed(99)
    resumed = _loader(dataset, True, every)
    resumed.load_state_dict(state)
    got, _ = _run(resumed, 1)
    assert got == reference[len(reference) // 2:]


@pytest.mark.parametrize("dataset", ["map", "stream"])
def test_uninterrupted_run_with_snapshots_matches_dataloader(dataset):
    """Snapshots change nothing in the batches: PoolLoader with snapshot_every_n_steps=3
    gives DataLoader's bytes (same seeds)."""
    _reseed()
    ours, _ = _run(_loader(dataset, False, 3), 2)
    _reseed()
    theirs, _ = _run(_loader(dataset, False, None, loader=torch.utils.data.DataLoader), 2)
    assert ours == theirs


def test_snapshots_fall_at_statefuldataloaders_steps_and_the_rest_is_replayed():
    """With snapshot_every_n_steps=8 and 2 workers, a worker takes its dataset's
    state_dict() with the batches of the 2 steps before each multiple of 8 (steps 6,
    7, 14, 15, ...); the state holds the last one and the indices since."""
    loader = PoolLoader(CallCounter(40), batch_size=1, num_workers=2, snapshot_every_n_steps=8,
                        timeout=TIMEOUT_S)
    it = iter(loader)
    for _ in range(12):  # steps 0..11: worker 0 served 0, 2, ..., 10; worker 1 1, 3, ..., 11
        next(it)
    workers = loader.state_dict()[keys.SNAPSHOT][keys.WORKER_SNAPSHOTS]
    w0, w1 = workers["worker_0"], workers["worker_1"]
    assert w0[keys.DATASET_STATE] == {"calls": 1}  # step 6
    assert w0[keys.REPLAY] == [[8], [10]]
    assert w1[keys.DATASET_STATE] == {"calls": 1}  # step 7
    assert w1[keys.REPLAY] == [[9], [11]]
    assert w0[keys.WORKER_FETCHED] == w1[keys.WORKER_FETCHED] == 6
    for _ in range(28):  # to step 39: snapshots at 14, 15, 22, 23, 30, 31, 38, 39
        next(it)
    workers = loader.state_dict()[keys.SNAPSHOT][keys.WORKER_SNAPSHOTS]
    assert workers["worker_0"][keys.DATASET_STATE] == {"calls": 5}
    assert workers["worker_0"][keys.REPLAY] == []
    assert workers["worker_1"][keys.DATASET_STATE] == {"calls": 5}
    assert workers["worker_1"][keys.REPLAY] == []
    with pytest.raises(StopIteration):
        next(it)


def test_default_snapshots_every_batch_unless_the_dataset_is_a_module():
    """snapshot_every_n_steps=None: every batch (StatefulDataLoader's 1) for a plain
    dataset; every 256 steps for an nn.Module, whose state_dict() is its tensors
    (before its first snapshot a worker's state is its fetches since it was seeded)."""
    plain = PoolLoader(CallCounter(12), batch_size=1, num_workers=2, timeout=TIMEOUT_S)
    it = iter(plain)
    for _ in range(10):
        next(it)
    workers = plain.state_dict()[keys.SNAPSHOT][keys.WORKER_SNAPSHOTS]
    assert workers["worker_0"][keys.DATASET_STATE] == {"calls": 5}
    assert workers["worker_0"][keys.REPLAY] == []
    del it
    module = PoolLoader(HistoryModule(40), batch_size=1, num_workers=2, timeout=TIMEOUT_S)
    it = iter(module)
    for _ in range(10):
        next(it)
    w0 = module.state_dict()[keys.SNAPSHOT][keys.WORKER_SNAPSHOTS]["worker_0"]
    assert w0[keys.DATASET_STATE] is None and w0[keys.SNAPSHOT_RNG] is None
    assert len(w0[keys.REPLAY]) == 5
    del it


def test_a_large_record_warns_once_naming_the_dataset_size_limit_and_knobs():
    loader = PoolLoader(HistoryModule(24, weight_bytes=3 << 20), batch_size=2, num_workers=2,
                        snapshot_every_n_steps=4, timeout=TIMEOUT_S)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _epoch in range(2):  # a new iterator each epoch: still one warning
            assert len(list(loader)) == 12
    large = [w for w in caught if "resume record" in str(w.message)]
    assert len(large) == 1, [str(w.message) for w in caught]
    message = str(large[0].message)
    assert "HistoryModule" in message
    assert f"over the {keys.RECORD_WARN_BYTES} bytes" in message
    size = int(message.split(" is ")[1].split(" bytes")[0])
    assert size > 3 << 20
    assert "snapshot_every_n_steps= (now 4" in message and "stateful=False" in message
    assert large[0].filename == __file__  # at the user's line


def test_a_small_record_does_not_warn():
    loader = PoolLoader(HistoryModule(24, weight_bytes=1 << 16), batch_size=2, num_workers=2,
                        snapshot_every_n_steps=1, timeout=TIMEOUT_S)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(list(loader)) == 12
    assert not [w for w in caught if "resume record" in str(w.message)]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_snapshot_every_n_steps_must_be_a_positive_int_or_none(bad):
    with pytest.raises(ValueError, match=f"snapshot_every_n_steps must be a positive number of "
                                         f"steps or None, got {bad!r}"):
        PoolLoader(torch.arange(4.0), num_workers=1, snapshot_every_n_steps=bad)


@pytest.mark.parametrize("every", [3, 1000])
def test_in_order_false_resume_with_snapshots_delivers_each_batch_once(every):
    """in_order=False: which worker serves which batch depends on timing, so no run is
    bit-identical to another; a resume delivers every batch of indices not yet
    delivered exactly once (the workers replay their fetches since their snapshots)."""
    _reseed()
    loader = _loader("map", False, every, in_order=False)
    before, state = [], None
    for k, batch in enumerate(loader):
        before.append(batch["index"].tolist())
        if k == 6:
            state = _save(loader.state_dict())
            break
    _reseed(99)
    resumed = _loader("map", False, every, in_order=False)
    resumed.load_state_dict(state)
    after = [batch["index"].tolist() for batch in resumed]
    delivered = sorted(i for b in before + after for i in b)
    assert delivered == list(range(37))
    assert len(before) + len(after) == 13
