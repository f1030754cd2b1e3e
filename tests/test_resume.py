"""Mid-epoch resume: state_dict() → torch.save → a NEW PROCESS → load_state_dict() → the
rest of the epoch, compared bit for bit with the same loader run without interruption.

How: each case's loader runs uninterrupted in this process, and at batch k its
state is written with torch.save (state_dict() neither waits for nor disturbs the
workers, so the run goes on as if nothing happened: it is the reference). One
spawned child process (tests/_resume_child.py, seeded differently) then builds a
fresh loader per case, loads the state (torch.load(weights_only=True)) and runs to
the end. Batches prefetched into slots at save time must come out again, exactly
once, from the same worker in the same random state.

Datasets draw from torch, numpy and random per sample (tests/_resume_cases.py;
the IterableDatasets also in __iter__), so a worker resumed in the wrong random
state shows. torchdata's StatefulDataLoader runs the same cases as the reference
where it applies: it resumes the indices but not the workers' random state, and
the test shows that difference instead of hiding it. Cross-loading states between
the two loaders is checked for the indices.
"""
from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from poolloader import PoolLoader
from poolloader.resume import keys as resume_mod

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _resume_cases import canon, indices, make_loader  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_TIMEOUT_S = 240

try:
    import torchdata.stateful_dataloader  # noqa: F401
    HAVE_TORCHDATA = True
except ImportError:
    HAVE_TORCHDATA = False

MAP = dict(dataset="augment", n=37, batch_size=3, num_workers=2)          # 13 batches
STREAM = dict(dataset="stream", n=41, batch_size=4, num_workers=2)         # 12 batches
STATEFUL = dict(dataset="stateful_stream", n=41, batch_size=4, num_workers=2)

# name: (loader kwargs, k, epochs run before the one saved in (or a tuple: batches taken
# from each, then `break`), epochs the child runs)
CASES = {
    "map_shuffle": (dict(MAP, shuffle=True), 5, 0, 1),
    "map_shuffle_k0": (dict(MAP, shuffle=True), 0, 0, 1),
    "map_shuffle_last": (dict(MAP, shuffle=True), 13, 0, 1),
    "map_generator_next_epoch": (dict(MAP, shuffle=True, generator=7), 6, 0, 2),
    "map_persistent_epoch2": (dict(MAP, shuffle=True, persistent_workers=True, generator=3), 4, 1, 2),
    "map_persistent_epoch2_k1": (dict(MAP, shuffle=True, persistent_workers=True, generator=5), 1, 1, 2),
    "map_persistent_after_break": (dict(MAP, shuffle=True, persistent_workers=True, generator=5), 1, (3,), 1),
    "map_persistent_no_generator": (dict(MAP, shuffle=True, persistent_workers=True), 7, 0, 1),
    "map_after_epoch_end": (dict(MAP, shuffle=True, generator=11), "end", 0, 1),
    "map_persistent_after_epoch_end": (dict(MAP, shuffle=True, persistent_workers=True, generator=13),
                                       "end", 0, 1),
    "map_spawn": (dict(MAP, shuffle=True, multiprocessing_context="spawn"), 4, 0, 1),
    "map_three_workers": (dict(MAP, shuffle=True, num_workers=3, prefetch_factor=3), 8, 0, 1),
    "stream_fast_forward": (dict(STREAM), 5, 0, 1),
    "stream_persistent_epoch2": (dict(STREAM, persistent_workers=True), 3, 1, 2),
    "stream_uneven_workers": (dict(STREAM, n=20, batch_size=3, num_workers=3), 4, 0, 1),
    "stateful_stream": (dict(STATEFUL), 5, 0, 1),
    "stateful_stream_persistent_epoch2": (dict(STATEFUL, persistent_workers=True), 6, 1, 2),
    "map_num_workers_0": (dict(MAP, shuffle=True, num_workers=0), 5, 0, 1),
    "stream_num_workers_0": (dict(STREAM, num_workers=0), 4, 0, 1),
}
IN_ORDER_FALSE = dict(MAP, shuffle=True, in_order=False)
IN_ORDER_FALSE_KS = (0, 3, 7)
# torchdata's StatefulDataLoader: the same datasets, shuffle off so both loaders'
# samplers agree (StatefulDataLoader brings its own RandomSampler)
REFERENCE_CASES = {
    "map": (dict(MAP), 5),
    "stateful_stream": (dict(STATEFUL), 5),
}


def _save(state) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _run_and_save(kwargs, k, epochs_before, epochs_after, seed=2024):
    """The reference batches (saved epoch and after) and the torch.save'd state at k.
    With num_workers=0 the dataset draws from this process's RNG, which the caller
    restores with the loader's state: it is saved too."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    loader = make_loader(**kwargs)
    for taken in (epochs_before if isinstance(epochs_before, tuple) else (None,) * epochs_before):
        for i, _batch in enumerate(loader):
            if i + 1 == taken:
                break  # persistent workers: the epoch's prefetched replies are reclaimed, undelivered
    reference, saved, rng = [], None, None
    for epoch in range(epochs_after):
        it = iter(loader)
        while True:
            if epoch == 0 and saved is None and len(reference) == k:  # k batches delivered
                saved = _save(loader.state_dict())
                rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
            try:
                batch = next(it)
            except StopIteration:
                break
            reference.append(canon(batch))
            del batch
        if epoch == 0 and saved is None:  # k past the epoch: saved after its end
            saved = _save(loader.state_dict())
            rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        del it
    del loader
    return reference, saved, rng


def _resume_in_child(jobs, tmp_path):
    jobs_path, out_path = tmp_path / "jobs.pt", tmp_path / "out.pt"
    torch.save(jobs, jobs_path)
    child = subprocess.run(
        [sys.executable, os.path.join(HERE, "_resume_child.py"), str(jobs_path), str(out_path)],
        cwd=HERE, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, child.stderr[-3000:]
    return torch.load(out_path, weights_only=True)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{case: (reference, prefix, resumed)}, every resume done in one child process."""
    references, jobs = {}, []
    for name, (kwargs, k, before, after) in CASES.items():
        k_at = 10 ** 9 if k == "end" else k
        reference, state, rng = _run_and_save(kwargs, k_at, before, after)
        first = len(reference) if k == "end" else min(k_at, len(reference))
        if k == "end":
            # saved after the epoch's StopIteration: the child runs the next epoch
            reference_next, _, _ = _run_and_save(kwargs, 10 ** 9, before, after + 1)
            reference, first = reference_next, len(reference)
        references[name] = (reference, first)
        jobs.append((name, kwargs, torch.load(io.BytesIO(state), weights_only=True), after,
                     rng if kwargs["num_workers"] == 0 else None))
    for k in IN_ORDER_FALSE_KS:
        reference, state, _ = _run_and_save(IN_ORDER_FALSE, k, 0, 1)
        references[f"in_order_false_{k}"] = (reference, k)
        jobs.append((f"in_order_false_{k}", IN_ORDER_FALSE, torch.load(io.BytesIO(state)), 1, None))
    if HAVE_TORCHDATA:
        for name, (kwargs, k) in REFERENCE_CASES.items():
            for loader in ("stateful", "pool"):
                reference, state, _ = _run_and_save(dict(kwargs, loader=loader), k, 0, 1)
                references[f"{loader}_{name}"] = (reference, k)
                jobs.append((f"{loader}_{name}", dict(kwargs, loader=loader),
                             torch.load(io.BytesIO(state)), 1, None))
        # states across loaders: StatefulDataLoader's into a PoolLoader; a PoolLoader's into a
        # StatefulDataLoader whose sampler fast-forwards (its default batch sampler resumes
        # only from its own iterator's state)
        for saver, resumer, kwargs in (("stateful", "pool", dict(MAP)),
                                       ("pool", "stateful", dict(MAP, batch_size=1, batch_sampler=3))):
            reference, state, _ = _run_and_save(dict(kwargs, loader=saver), 5, 0, 1)
            references[f"{saver}_state_into_{resumer}"] = (reference, 5)
            jobs.append((f"{saver}_state_into_{resumer}", dict(kwargs, loader=resumer),
                         torch.load(io.BytesIO(state)), 1, None))
    tmp = tmp_path_factory.mktemp("resume")
    results = _resume_in_child([job[:4] + (_rng_job(job[4]),) for job in jobs], tmp)
    return references, results


def _rng_job(rng):
    """The caller's RNG for a num_workers=0 job, as plain data for weights_only."""
    if rng is None:
        return None
    torch_state, py_state, np_state = rng
    return (torch_state, py_state, (np_state[0], np_state[1].tobytes(), *np_state[2:]))


def _check(resumed, name):
    references, results = resumed
    reference, k = references[name]
    got = results[name]
    assert not isinstance(got, str), got
    return reference, k, got


@pytest.mark.parametrize("name", list(CASES))
def test_resume_in_new_process_is_bit_identical(resumed, name):
    reference, k, got = _check(resumed, name)
    assert len(reference[:k]) + len(got) == len(reference), (k, len(got), len(reference))
    for i, (want, have) in enumerate(zip(reference[k:], got)):
        assert want == have, f"{name}: batch {k + i} differs after resuming at {k}"


@pytest.mark.parametrize("k", IN_ORDER_FALSE_KS)
def test_in_order_false_delivers_each_batch_exactly_once(resumed, k):
    """in_order=False promises no order (nor does DataLoader): every sample index of
    the epoch exactly once across the save, nothing lost, nothing twice."""
    reference, _, got = _check(resumed, f"in_order_false_{k}")
    before = [i for batch in indices(reference[:k]) for i in batch]
    after = [i for batch in indices(got) for i in batch]
    assert sorted(before + after) == list(range(37))


@pytest.mark.skipif(not HAVE_TORCHDATA, reason="torchdata (StatefulDataLoader) is not installed")
@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_statefuldataloader_resumes_indices_but_not_worker_rng(resumed, name):
    """Uninterrupted, both loaders give the same batches. Resumed, PoolLoader's are
    identical; StatefulDataLoader's have the right indices, but its workers restart
    from their seeds, so the randomly augmented values differ."""
    references, results = resumed
    pool_ref, k = references[f"pool_{name}"]
    ref, _ = references[f"stateful_{name}"]
    assert ref == pool_ref  # the same loader semantics when nothing is interrupted
    assert results[f"pool_{name}"] == pool_ref[k:]
    stateful = results[f"stateful_{name}"]
    assert not isinstance(stateful, str), stateful
    assert indices(stateful) == indices(ref[k:])
    differ = sum(a != b for a, b in zip(stateful, ref[k:]))
    assert differ >= 1, "StatefulDataLoader now restores worker RNG: compare bit for bit instead"


@pytest.mark.skipif(not HAVE_TORCHDATA, reason="torchdata (StatefulDataLoader) is not installed")
@pytest.mark.parametrize("job", ["stateful_state_into_pool", "pool_state_into_stateful"])
def test_states_cross_load_between_poolloader_and_statefuldataloader(resumed, job):
    """Same layout and key names: a StatefulDataLoader state continues in a PoolLoader
    at the right indices, and a PoolLoader state in a StatefulDataLoader whose sampler
    fast-forwards (worker RNG: only PoolLoader's state has it)."""
    ref, k, got = _check(resumed, job)
    assert indices(got) == indices(ref[k:])


# ---------------------------------------------------------------------------
# in-process behaviour

def _loader(**kw):
    return make_loader(**dict(MAP, shuffle=True, **kw))


def test_state_is_plain_and_loads_with_weights_only():
    loader = _loader()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    again = torch.load(io.BytesIO(_save(state)), weights_only=True)
    snapshot = again[resume_mod.SNAPSHOT]
    assert snapshot[resume_mod.SNAPSHOT_STEP] == 1
    assert set(snapshot[resume_mod.WORKER_SNAPSHOTS]) == {"worker_0", "worker_1"}
    worker = snapshot[resume_mod.WORKER_SNAPSHOTS]["worker_0"]
    assert set(worker[resume_mod.WORKER_RNG]) == {"random", "numpy", "torch"}
    # worker 1 has delivered nothing yet
    assert snapshot[resume_mod.WORKER_SNAPSHOTS]["worker_1"][resume_mod.WORKER_RNG] is None
    del it


def test_state_before_iterating_is_empty_and_loading_it_does_nothing():
    loader = _loader()
    assert loader.state_dict() == {}
    loader.load_state_dict({})
    assert len(list(loader)) == 13


def test_loaded_state_is_returned_until_iterated():
    loader = _loader()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it
    fresh = _loader()
    fresh.load_state_dict(state)
    assert fresh.state_dict() is state
    assert len(list(fresh)) == 10


def test_other_num_workers_is_refused_with_the_values_and_the_fix():
    loader = _loader()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    for workers in (0, 3):
        with pytest.raises(ValueError, match=rf"num_workers=2; this one has num_workers={workers}"
                                             r".*pass num_workers=2"):
            _loader(num_workers=workers).load_state_dict(state)
    with pytest.raises(ValueError, match="_snapshot"):
        _loader().load_state_dict({"epoch": 3})


def test_state_dict_does_not_wait_for_busy_workers():
    """Workers stuck in a slow __getitem__: state_dict() still returns at once (it reads
    only what main already holds). Bounded by a thread join, not a timing assertion."""
    from loader_datasets import SlowDataset
    loader = PoolLoader(SlowDataset(n=8, delay=0.2), batch_size=1, num_workers=2)
    it = iter(loader)
    next(it)
    loader.dataset.delay = 0  # (the workers' copies keep sleeping)
    box = []
    t = threading.Thread(target=lambda: box.append(loader.state_dict()), daemon=True)
    t.start()
    t.join(timeout=5.0)
    assert box and box[0][resume_mod.SNAPSHOT][resume_mod.SNAPSHOT_STEP] == 1
    del it


def test_persistent_iterator_is_replaced_on_load():
    loader = _loader(persistent_workers=True)
    list(loader)
    it = loader._iterator
    state = loader.state_dict()
    assert state[resume_mod.ITERATOR_FINISHED]
    loader.load_state_dict(state)
    assert loader._iterator is None and it._shutdown
    assert len(list(loader)) == 13


def test_a_state_saved_in_the_epoch_after_loading_an_ended_one_resumes_exactly():
    """Persistent workers: a state saved after an epoch's end is loaded, and a state
    saved two batches into the next epoch then resumes it exactly. The workers that had
    delivered nothing yet in that epoch start it where their last reply of the saved
    epoch left them; the loaded epoch's start must carry that (it once carried
    nothing, and those workers began from their seed)."""
    def make():
        return make_loader("pool", n=24, batch_size=3, shuffle=True, num_workers=4,
                           persistent_workers=True, generator=5)
    torch.manual_seed(0)
    ref = make_loader("torch", n=24, batch_size=3, shuffle=True, num_workers=4,
                      persistent_workers=True, generator=5)
    expected = [[canon(b) for b in ref] for _ in range(2)]
    ref._iterator._shutdown_workers()
    torch.manual_seed(0)
    loaders = [make(), make(), make()]
    try:
        first, second, third = loaders
        assert [canon(b) for b in first] == expected[0]
        second.load_state_dict(first.state_dict())
        it = iter(second)
        head = [canon(next(it)) for _ in range(2)]
        third.load_state_dict(second.state_dict())
        assert head + [canon(b) for b in third] == expected[1]
    finally:
        for loader in loaders:
            if loader._iterator is not None:
                loader._iterator._shutdown_workers()


def test_per_batch_record_is_small():
    """The record a worker adds to each reply fits the request area (no extra slot bytes)."""
    loader = _loader()
    it = iter(loader)
    next(it)
    blob = loader._resume_tracker.delivered[0]
    assert 0 < len(blob) <= 16384
    del it


# ---------------------------------------------------------------------------
# Lightning: a Trainer.fit preempted mid-epoch, resumed from its checkpoint

class _Preempted(Exception):
    pass


@pytest.mark.parametrize("loader", ["pool", "stateful"])
def test_lightning_fit_preempted_mid_epoch_resumes_the_remaining_batches(tmp_path, loader):
    """Lightning saves a loader's state in its checkpoint when the loader has
    state_dict()/load_state_dict() (fit_loop's "combined_loader" entry) and loads it
    back before iterating. Run A: one uninterrupted epoch. Run B: the same, with a
    checkpoint after step 5 and an exception at step 6 (a preemption). Run C: a new
    Trainer, a new model and a new PoolLoader, differently seeded, fit(ckpt_path=...):
    it must train on exactly A's batches 6..12, values included. The same with
    torchdata's StatefulDataLoader: the indices resume, the augmented values do not."""
    pl = pytest.importorskip("lightning.pytorch")
    if loader == "stateful" and not HAVE_TORCHDATA:
        pytest.skip("torchdata (StatefulDataLoader) is not installed")
    from torch import nn
    from torch.utils.data import Dataset

    class Augmented(Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            x = torch.rand(4) + float(np.random.rand()) + random.random()
            return torch.tensor(i), x

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.seen = []

        def training_step(self, batch, batch_idx):
            index, x = batch
            self.seen.append((index.tolist(), x.numpy().tobytes()))
            return self.layer(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class PreemptAt(pl.Callback):
        def __init__(self, step):
            self.step = step

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == self.step:
                raise _Preempted(f"preempted before batch {batch_idx}")

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            if loader == "stateful":
                from torchdata.stateful_dataloader import StatefulDataLoader as Loader
            else:
                Loader = PoolLoader
            return Loader(Augmented(), batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=True)

    def trainer(**kw):
        return pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=tmp_path, **kw)

    pl.seed_everything(0, verbose=False)
    full = Model()
    trainer(enable_checkpointing=False).fit(full, Data())
    assert len(full.seen) == 12

    pl.seed_everything(0, verbose=False)
    first = Model()
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5,
                                              save_top_k=-1)
    with pytest.raises(_Preempted):
        trainer(callbacks=[checkpoint, PreemptAt(6)]).fit(first, Data())
    assert first.seen == full.seen[:6]
    path = tmp_path / "ckpt" / "epoch=0-step=5.ckpt"
    saved = torch.load(path, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert saved[0][resume_mod.SNAPSHOT][resume_mod.SNAPSHOT_STEP] == 5

    pl.seed_everything(1234, verbose=False)
    rest = Model()
    trainer(enable_checkpointing=False).fit(rest, Data(), ckpt_path=path)
    assert [s[0] for s in rest.seen] == [s[0] for s in full.seen[5:]]
    if loader == "pool":
        assert rest.seen == full.seen[5:]
    else:  # its workers restart from their seeds: other augmentations
        assert sum(a != b for a, b in zip(rest.seen, full.seen[5:])) >= 1


def test_dataset_state_dict_error_reaches_the_caller_like_a_fetch_error():
    """The worker captures the dataset's state_dict() with every batch: when that
    raises, next() raises it (original type, worker traceback), as DataLoader
    delivers a __getitem__ error; the other batches still come."""
    from _resume_cases import StateFailsDataset
    loader = PoolLoader(StateFailsDataset(), batch_size=2, num_workers=2)
    got, errors = [], []
    it = iter(loader)
    while True:
        try:
            got.append(next(it).view(-1).tolist())
        except StopIteration:
            break
        except ValueError as e:
            errors.append(str(e))
    assert errors and "state of item 5 cannot be saved" in errors[0]
    assert "in DataLoader worker process" in errors[0]
    assert [0, 1] in got and [2, 3] in got
