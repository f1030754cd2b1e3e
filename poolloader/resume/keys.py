"""Exact mid-epoch resume: what `PoolLoader.state_dict()` records and how a new
loader continues from it.

The state has torchdata's `StatefulDataLoader` layout and key names, used with
its meanings (`_snapshot` → `_snapshot_step`, `_last_yielded_worker_id`,
`_main_snapshot` {`_num_workers`, `_sampler_iter_yielded`, `_index_sampler_state`,
`_sampler_iter_state`, `_base_seed`, …}, `_worker_snapshots` {"worker_<i>":
{`worker_id`, `fetcher_state`, `dataset_state`}}), so code written for it works.
PoolLoader adds, under keys of its own, what StatefulDataLoader does not keep:
each worker's random state (`random`, `numpy`, `torch`) at the resume point, the
main process's random state at the epoch's start, and the batches not yet
delivered with `in_order=False`. Everything is plain Python, bytes and CPU
tensors: `torch.save` writes it and `torch.load(weights_only=True)` reads it.

How it is exact (in_order=True)
-------------------------------
* Batch k of an epoch goes to worker k % num_workers (DataLoader's round robin,
  skipping workers whose IterableDataset ended), and a worker serves its
  requests strictly in order. So a worker's random state right AFTER producing
  its last delivered batch is its state BEFORE its first undelivered one.
* Every reply carries that state: after each fetch the worker writes its RNG
  states and the number of batches it fetched this epoch into the slot
  (slot_format.write_state, a few KB). Main copies those bytes when it delivers
  the batch (~1 µs) and unpickles nothing on the per-batch path; `state_dict()`
  decodes the records it keeps per worker: O(workers), and it never waits for a
  worker.
* Snapshots (PoolLoader(snapshot_every_n_steps=n)): the dataset's (and an
  IterableDataset iterator's) `state_dict()` rides only with snapshot replies:
  those of the num_workers steps before each multiple of n (StatefulDataLoader's
  rule, from the step the request carries: every worker serves one of them under
  the round robin, so each worker's snapshot is at most about n steps old), and
  a reply after n - 1 without one (WorkerProgress). A record's first byte says
  whether it is a snapshot. Main keeps, per worker, its last snapshot record, the
  indices of its replies since (tracker.Position) and its newest record;
  `state_dict()` writes them as the worker's `dataset_state` (at the snapshot),
  `_snapshot_rng_state`, `_replay_indices`, `_rng_state` and `_batches_fetched`
  (after its last delivered batch). A resumed worker loads the snapshot's state,
  replays the indices (fetch and drop, from the snapshot's RNG; before its first
  snapshot, from the worker as seeded) and then takes the RNG after its last
  delivered batch, so the resumed batches are bit-identical. n=None resolves to 1
  (every reply a snapshot, nothing to replay: StatefulDataLoader's default)
  unless the dataset is an nn.Module (its state_dict() is its tensors: 256).
  `_steps_since_snapshot` stays 0: the state is complete at its step.
* A new iterator that loads the state: fast-forwards the sampler to the first
  undelivered batch (its `state_dict` if it has one, else by drawing and
  dropping the delivered indices, with the main process's generators set to
  their state at the epoch's start, so a shuffling sampler draws the same
  permutation; the caller's global RNG is put back afterwards); takes the
  epoch's base seed; starts the round robin after the last delivered batch's
  worker; and hands each worker its record, which the worker applies after
  torch's seeding and `worker_init_fn` (StatefulDataLoader's order): dataset
  state, RNG at the epoch's start, `iter(dataset)`, iterator state or
  fast-forward, then the RNG after its last delivered batch.
* Batches that sat prefetched in slots at save time were never delivered: after
  the resume they are requested again, from the same worker in the same random
  state, so they come out the same; none is lost, none delivered twice.
* Persistent workers: a worker's state at the start of epoch e is its state
  after its last reply of epoch e-1 (delivered or not); main keeps it (a
  snapshot and the replays since, `_epoch_snapshot_rng_state` and
  `_epoch_replay_indices`: a map-style replay may span epochs; an
  IterableDataset's first and END replies of an epoch are snapshots).
* IterableDataset without `state_dict`: each worker replays the batches it had
  fetched this epoch (fetch and drop, from the epoch's start state) — exact for
  a dataset whose stream depends only on its RNG, and it costs the replayed
  batches' time; a warning says so.

in_order=False
--------------
Delivery order depends on timing (as in DataLoader), and so does which worker
gets which request, so no run is bit-identical to another. What a resume
promises: every batch of indices not yet delivered is delivered exactly once
(the sent-but-undelivered ones are sent again first, then the sampler
continues), and each worker's stream continues from its state after its last
delivered batch (a worker's replies arrive in order, so what it delivered is a
prefix of what it was asked). StatefulDataLoader gives no guarantee there.

What it needs
-------------
The same dataset, sampler, batch size, collate and `num_workers`: a worker's
state belongs to that worker, so another `num_workers` is refused (as
StatefulDataLoader refuses it). Epochs after the resumed one draw their seeds
from `generator=` (restored) or else the global RNG, which is the caller's to
restore. A sampler that keeps drawing from the global RNG during the epoch,
rather than once at its start, cannot be replayed.
"""
from __future__ import annotations

import contextlib
import itertools
import pickle
import random
from array import array

import numpy as np
import torch

# StatefulDataLoader's keys (torchdata.stateful_dataloader), same meanings.
SNAPSHOT = "_snapshot"
STEPS_SINCE_SNAPSHOT = "_steps_since_snapshot"
ITERATOR_FINISHED = "_iterator_finished"
SNAPSHOT_STEP = "_snapshot_step"
LAST_YIELDED_WORKER_ID = "_last_yielded_worker_id"
MAIN_SNAPSHOT = "_main_snapshot"
WORKER_SNAPSHOTS = "_worker_snapshots"
NUM_WORKERS = "_num_workers"
SAMPLER_ITER_STATE = "_sampler_iter_state"
INDEX_SAMPLER_STATE = "_index_sampler_state"
SAMPLER_ITER_YIELDED = "_sampler_iter_yielded"
ITERABLEDATASET_LEN_CALLED = "_IterableDataset_len_called"
SHARED_SEED = "_shared_seed"
BASE_SEED = "_base_seed"
WORKER_ID = "worker_id"
FETCHER_STATE = "fetcher_state"
FETCHER_ENDED = "fetcher_ended"
DATASET_STATE = "dataset_state"
DATASET_ITER_STATE = "dataset_iter_state"

# PoolLoader's additions.
FORMAT = "_poolloader_state"            # format version
IN_ORDER = "_in_order"
MAIN_RNG = "_main_rng_state"            # {"epoch_start": rng + generators, "generators_now": [...]}
PENDING = "_pending_indices"            # in_order=False: sent, not delivered, in send order
WORKER_RNG = "_rng_state"               # after the worker's last delivered batch (None: none yet)
WORKER_EPOCH_RNG = "_epoch_rng_state"   # when this epoch's iter(dataset) was made (None: as seeded)
WORKER_EPOCH_DATASET = "_epoch_dataset_state"
WORKER_FETCHED = "_batches_fetched"     # fetches this epoch up to the last delivered batch
SNAPSHOT_RNG = "_snapshot_rng_state"    # after the worker's snapshot batch (None: the same as _rng_state)
REPLAY = "_replay_indices"              # the worker's fetches after its snapshot, replayed on resume
EPOCH_SNAPSHOT_RNG = "_epoch_snapshot_rng_state"  # the epoch's start, as the two above:
EPOCH_REPLAY = "_epoch_replay_indices"            # a snapshot of the previous epoch and its replays

FORMAT_VERSION = 2  # 2: a worker's dataset state is its last snapshot's (REPLAY follows it)
NUM_YIELDED = "_num_yielded"  # StatefulDataLoader's single-process key

# snapshot_every_n_steps=None (PoolLoader's default) resolves per dataset
# (snapshot_interval): StatefulDataLoader's default, 1 (every batch carries its
# worker's state), unless the dataset is a torch.nn.Module, whose state_dict() is
# its parameters and buffers (often MBs, and rarely what changes per fetch): then
# 256. A worker's state_dict() travels with the batches of the num_workers steps
# before each multiple of it (num_workers / 256 of the batches; pickling a 4 MiB
# buffer takes ~10-20 ms, so at 4 workers that is ~0.3 ms per batch), and a resume
# replays (fetches and drops) at most about 256 / num_workers + 1 batches per
# worker, the workers in parallel. bench/_snapshot_probe.py measures it.
MODULE_SNAPSHOT_EVERY_N_STEPS = 256
# A record (one reply's resume bytes) above this warns once: it rides in the slot,
# and main copies it.
RECORD_WARN_BYTES = 1 << 20


def snapshot_interval(every: int | None, dataset) -> int:
    """PoolLoader(snapshot_every_n_steps=every) for `dataset`: None resolves as above."""
    if every is not None:
        return every
    return MODULE_SNAPSHOT_EVERY_N_STEPS if isinstance(dataset, torch.nn.Module) else 1


def worker_key(worker: int) -> str:
    return f"worker_{worker}"


def is_stateful(obj) -> bool:
    """torchdata's Stateful protocol, without importing torchdata."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


# ---------------------------------------------------------------------------
# random states. "fast": what a worker captures per batch (compact, quick to
# pickle); "plain": what a checkpoint holds (tuples, ints, bytes, a uint8 tensor).

def capture_rng() -> tuple:
    version, internal, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return ((version, array("I", internal).tobytes(), gauss),
            (name, np.asarray(key).tobytes(), pos, has_gauss, cached),
            torch.get_rng_state().numpy().tobytes())


def plain_rng(fast: tuple) -> dict:
    (version, internal, gauss), (name, key, pos, has_gauss, cached), torch_state = fast
    return {"random": (version, tuple(array("I", internal)), gauss),
            "numpy": (name, key, int(pos), int(has_gauss), float(cached)),
            "torch": torch.frombuffer(bytearray(torch_state), dtype=torch.uint8)}


def set_rng(plain: dict) -> None:
    version, internal, gauss = plain["random"]
    random.setstate((version, tuple(internal), gauss))
    name, key, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.frombuffer(key, np.uint32).copy(), pos, has_gauss, cached))
    state = plain["torch"]
    if not isinstance(state, torch.Tensor):
        state = torch.frombuffer(bytearray(state), dtype=torch.uint8)
    torch.set_rng_state(state)


def rng_for_worker(plain: dict | None) -> dict | None:
    """An RNG state to hand a worker at start: its torch part as bytes, so the worker's
    arguments carry no tensor (spawn would send one through torch's fd passing)."""
    if plain is None:
        return None
    state = plain["torch"]
    if isinstance(state, torch.Tensor):
        state = state.contiguous().numpy().tobytes()
    return dict(plain, torch=state)


def sampler_generators(loader) -> list:
    """The torch.Generators the loader's sampler draws from besides the global RNG."""
    found: list[torch.Generator] = []
    index_sampler = loader._index_sampler
    for obj in (loader.generator, index_sampler, getattr(index_sampler, "sampler", None), loader.sampler):
        g = obj if isinstance(obj, torch.Generator) else getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and g.device.type == "cpu" and all(g is not h for h in found):
            found.append(g)
    return found


def main_rng(generators) -> dict:
    state = plain_rng(capture_rng())
    state["generators"] = [g.get_state() for g in generators]
    return state


def set_main_rng(state: dict, generators) -> None:
    set_rng(state)
    set_generators(state.get("generators", []), generators)


def set_generators(states, generators) -> None:
    if len(states) != len(generators):
        raise ValueError(
            f"this state was saved by a loader whose sampler drew from {len(states)} "
            f"torch.Generator(s); this loader's draws from {len(generators)}: build the loader "
            "with the same sampler and generator= as the one that saved it")
    for g, s in zip(generators, states):  # lengths checked above
        g.set_state(s)


def position_sampler(index_sampler, sampler_iter, position: int, index_state, iter_state):
    """A sampler iterator `position` draws into its epoch, for a resume in the main
    process. A stateful sampler (or iterator) with a saved state loads it, in
    torchdata's order: the sampler's state, a new iterator, the iterator's state.
    Any other sampler is drawn `position` times and once more, that first kept
    draw made here: a sampler seeds itself on its first draw, so the caller runs
    this under the epoch's starting RNG (`epoch_rng_drawn`)."""
    if (is_stateful(index_sampler) or is_stateful(sampler_iter)) and (
            index_state is not None or iter_state is not None):
        if index_state is not None and is_stateful(index_sampler):
            index_sampler.load_state_dict(index_state)
        sampler_iter = iter(index_sampler)
        if iter_state is not None and is_stateful(sampler_iter):
            sampler_iter.load_state_dict(iter_state)
        return sampler_iter
    drawn = iter(index_sampler)
    try:
        for _ in range(position):
            next(drawn)
        first = next(drawn)
    except StopIteration:
        return iter(())
    return itertools.chain((first,), drawn)


@contextlib.contextmanager
def epoch_rng_drawn(epoch_rng: dict | None, generators, caller_rng: dict | None,
                    keep_when_caller_at_start: bool = False):
    """Run the block with the main RNG and `generators` at `epoch_rng` (an epoch's
    start, as main_rng() took it; None: as they are), then give the process back
    `caller_rng` (plain_rng of what the caller had before anything drew; None:
    leave it). With `keep_when_caller_at_start`, a caller whose torch RNG is the
    epoch's start itself (a state saved before the first batch, restored by the
    caller) keeps the RNG where the block's draws left it, as in the saved run."""
    try:
        if epoch_rng is not None:
            set_main_rng(epoch_rng, generators)
        yield
    finally:
        at_start = (keep_when_caller_at_start and epoch_rng is not None and caller_rng is not None
                    and torch.equal(caller_rng["torch"], epoch_rng["torch"]))
        if caller_rng is not None and not at_start:
            set_rng(caller_rng)


# ---------------------------------------------------------------------------
# worker side

class WorkerProgress:
    """A worker's part: applies its resume record when the worker starts, and
    captures the record that rides with every reply. Runs in the worker only.

    Every record holds the worker's RNG and its fetch count; a snapshot record
    also holds its dataset's (and iterator's) `state_dict()`. A reply is a
    snapshot when its batch's step falls in the `num_workers` steps before a
    multiple of `snapshot_every` (StatefulDataLoader's rule: under the round
    robin every worker serves one of them), when `snapshot_every` captures went
    by without one (so a worker's replay stays under `snapshot_every` fetches
    whatever the order of requests), for an IterableDataset's first reply of an
    epoch (its iterator is the epoch's; a map-style fetch needs none, so a replay
    may span epochs) and its END reply, and when the dataset has no state to take.
    Before its first snapshot, a worker's replay starts from the worker as seeded."""

    def __init__(self, plan: dict | None, dataset, iterable: bool, snapshot_every: int = 1,
                 num_workers: int = 1):
        self.plan = plan
        self.dataset = dataset
        self.iterable = iterable
        self.dataset_stateful = is_stateful(dataset)
        self.iter_stateful = False
        self.fetched = 0  # fetch() calls this epoch
        self.snapshot_every = snapshot_every
        self.num_workers = num_workers
        # the next capture is a snapshot: an IterableDataset's first of each epoch
        # (its iterator is the epoch's), and the one after a capture that raised
        self.snapshot_due = iterable
        self.since_snapshot = 0  # captures since the last snapshot (across epochs)

    def _track(self, fetcher):
        self.iter_stateful = self.iterable and is_stateful(fetcher.dataset_iter)
        return fetcher

    def epoch_fetcher(self, new_fetcher):
        """A new epoch (persistent workers): count from zero, build the fetcher."""
        self.fetched = 0
        self.snapshot_due = self.snapshot_due or self.iterable
        return self._track(new_fetcher())

    @staticmethod
    def _replay(fetcher, indices) -> None:
        """Fetch and drop: what the saved run fetched after its snapshot."""
        for index in indices:
            try:
                fetcher.fetch(index)
            except StopIteration:
                break
            except Exception:  # it raised the first time too, and was delivered as such
                pass

    def first_fetcher(self, new_fetcher):
        """The fetcher of the worker's first epoch, after seeding and worker_init_fn:
        with a resume record, in StatefulDataLoader's order — dataset state,
        iter(dataset), iterator state — with the epoch's start RNG before iter(),
        then the fetches since the snapshot replayed from the snapshot's RNG and,
        last, the RNG after the last delivered batch."""
        plan, self.plan = self.plan, None
        if plan is None:
            return self._track(new_fetcher())
        dataset_state = plan[DATASET_STATE]
        replay = plan.get(REPLAY) or []
        self.since_snapshot = len(replay)
        # None: the replay starts from the worker as seeded (it had no snapshot yet)
        snapshot_rng = plan.get(SNAPSHOT_RNG)
        if replay and snapshot_rng is None:
            snapshot_rng = plain_rng(capture_rng())
        if dataset_state is not None and self.dataset_stateful:
            self.dataset.load_state_dict(dataset_state)
        if replay and plan[WORKER_RNG] is None:
            # nothing delivered this epoch: its start is a snapshot of the previous
            # epoch and the fetches after it (a map-style fetch needs no iterator; an
            # IterableDataset's last reply of an epoch it finished is a snapshot)
            if not self.iterable:
                if snapshot_rng is not None:
                    set_rng(snapshot_rng)
                self._replay(new_fetcher(), replay)
            replay = []
        if plan[WORKER_EPOCH_RNG] is not None:
            set_rng(plan[WORKER_EPOCH_RNG])
        fetcher = self._track(new_fetcher())
        fetched = plan[WORKER_FETCHED]
        if self.iterable:
            fetcher_state = plan[FETCHER_STATE] or {}
            iter_state = fetcher_state.get(DATASET_ITER_STATE)
            if iter_state is not None and self.iter_stateful:
                fetcher.dataset_iter.load_state_dict(iter_state)
                fetcher.ended = bool(fetcher_state.get(FETCHER_ENDED, False))
            elif dataset_state is not None and self.dataset_stateful:
                fetcher.ended = bool(fetcher_state.get(FETCHER_ENDED, False))
            else:  # nothing to load: replay this epoch's fetches
                self._replay(fetcher, [plan["fast_forward_index"]] * fetched)
                replay = []
        if replay:
            if snapshot_rng is not None:
                set_rng(snapshot_rng)
            self._replay(fetcher, replay)
        self.fetched = fetched
        if plan[WORKER_RNG] is not None:
            set_rng(plan[WORKER_RNG])
        return fetcher

    def snapshot_at(self, seq: int) -> bool:
        """Whether the batch of step `seq` (its send index in the epoch) carries a
        snapshot: StatefulDataLoader's rule, ((step - 1) % n) + num_workers >= n."""
        n = self.snapshot_every
        return seq % n + self.num_workers >= n

    def capture(self, fetcher, seq: int = 0) -> bytes:
        """The record of this reply (see class): one flag byte (SNAPSHOT_RECORD or
        not), then the pickled RNG, dataset/iterator state, fetches and ended."""
        dataset_state = iter_state = None
        ended = False
        takes_dataset = takes_iter = False
        if fetcher is not None:
            takes_dataset = self.dataset_stateful and not (
                self.iterable and fetcher.dataset_iter is self.dataset)
            if self.iterable:
                takes_iter = self.iter_stateful
                ended = fetcher.ended
        snapshot = (not (takes_dataset or takes_iter) or self.snapshot_due or ended
                    or self.snapshot_at(seq) or self.since_snapshot + 1 >= self.snapshot_every)
        self.snapshot_due = True  # until this capture succeeds
        if snapshot:
            if takes_dataset:
                dataset_state = self.dataset.state_dict()
            if takes_iter:
                iter_state = fetcher.dataset_iter.state_dict()
        record = pickle.dumps((capture_rng(), dataset_state, iter_state, self.fetched, ended),
                              protocol=pickle.HIGHEST_PROTOCOL)
        self.snapshot_due = False
        self.since_snapshot = 0 if snapshot else self.since_snapshot + 1
        return (SNAPSHOT_RECORD if snapshot else STEP_RECORD) + record


# A record's first byte: whether it is a snapshot (dataset and iterator state at
# that batch) or a step (RNG and fetch count only; main keeps the batch's index).
SNAPSHOT_RECORD, STEP_RECORD = b"S", b"R"


def is_snapshot(entry) -> bool:
    """Main: whether a reply's record bytes are a snapshot (O(1), nothing decoded)."""
    return entry[:1] == SNAPSHOT_RECORD


def decode_record(entry) -> tuple | None:
    """(plain rng or None, dataset state, iterator state, fetched, ended) of a reply's
    record bytes (a step record has no states); a tuple (carried over from a loaded
    state) is already one."""
    if entry is None or isinstance(entry, tuple):
        return entry
    fast, dataset_state, iter_state, fetched, ended = pickle.loads(memoryview(entry)[1:])
    return plain_rng(fast), dataset_state, iter_state, fetched, ended
