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
  states, its dataset's `state_dict()` (if it has one) and the number of
  batches it fetched this epoch into the slot (slot_format.write_state, a few
  KB). Main copies those bytes when it delivers the batch (~1 µs) and unpickles
  nothing on the per-batch path; `state_dict()` decodes one record per worker:
  O(workers), and it never waits for a worker.
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
  after its last reply of epoch e-1 (delivered or not); main keeps it.
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

import collections
import itertools
import pickle
import random
import warnings
from array import array

import numpy as np
import torch
from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

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

FORMAT_VERSION = 1


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
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
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


def _for_worker(plain: dict | None) -> dict | None:
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


def _set_main_rng(state: dict, generators) -> None:
    set_rng(state)
    _set_generators(state.get("generators", []), generators)


def _set_generators(states, generators) -> None:
    if len(states) != len(generators):
        raise ValueError(
            f"this state was saved by a loader whose sampler drew from {len(states)} "
            f"torch.Generator(s); this loader's draws from {len(generators)}: build the loader "
            "with the same sampler and generator= as the one that saved it")
    for g, s in zip(generators, states, strict=True):
        g.set_state(s)


# ---------------------------------------------------------------------------
# worker side

class WorkerProgress:
    """A worker's part: applies its resume record when the worker starts, and
    captures the record that rides with every reply. Runs in the worker only."""

    def __init__(self, plan: dict | None, dataset, iterable: bool):
        self.plan = plan
        self.dataset = dataset
        self.iterable = iterable
        self.dataset_stateful = is_stateful(dataset)
        self.iter_stateful = False
        self.fetched = 0  # fetch() calls this epoch

    def _track(self, fetcher):
        self.iter_stateful = self.iterable and is_stateful(fetcher.dataset_iter)
        return fetcher

    def epoch_fetcher(self, new_fetcher):
        """A new epoch (persistent workers): count from zero, build the fetcher."""
        self.fetched = 0
        return self._track(new_fetcher())

    def first_fetcher(self, new_fetcher):
        """The fetcher of the worker's first epoch, after seeding and worker_init_fn:
        with a resume record, in StatefulDataLoader's order — dataset state,
        iter(dataset), iterator state — with the epoch's start RNG before iter()
        and, last, the RNG after the last delivered batch."""
        plan, self.plan = self.plan, None
        if plan is None:
            return self._track(new_fetcher())
        dataset_state = plan[DATASET_STATE]
        if dataset_state is not None and self.dataset_stateful:
            self.dataset.load_state_dict(dataset_state)
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
                index = plan["fast_forward_index"]
                for _ in range(fetched):
                    try:
                        fetcher.fetch(index)
                    except StopIteration:
                        break
                    except Exception:  # it raised the first time too, and was delivered as such
                        pass
        self.fetched = fetched
        if plan[WORKER_RNG] is not None:
            set_rng(plan[WORKER_RNG])
        return fetcher

    def capture(self, fetcher) -> bytes:
        """The record of this reply: RNG now, dataset/iterator state, fetches, ended."""
        dataset_state = iter_state = None
        ended = False
        if fetcher is not None:
            if self.dataset_stateful and not (self.iterable and fetcher.dataset_iter is self.dataset):
                dataset_state = self.dataset.state_dict()
            if self.iterable:
                if self.iter_stateful:
                    iter_state = fetcher.dataset_iter.state_dict()
                ended = fetcher.ended
        return pickle.dumps((capture_rng(), dataset_state, iter_state, self.fetched, ended),
                            protocol=pickle.HIGHEST_PROTOCOL)


def _record(entry) -> tuple | None:
    """(plain rng or None, dataset state, iterator state, fetched, ended) of a reply's
    record bytes; a tuple (carried over from a loaded state) is already one."""
    if entry is None or isinstance(entry, tuple):
        return entry
    fast, dataset_state, iter_state, fetched, ended = pickle.loads(entry)
    return plain_rng(fast), dataset_state, iter_state, fetched, ended


# ---------------------------------------------------------------------------
# main side

class ResumeTracker:
    """Main's record of one iterator's progress, and the state built from it.

    Per batch it stores references only (the reply's record bytes, a counter);
    `state_dict()` does the decoding. It holds no reference to the iterator, so
    the loader may keep it after the iterator is gone (its state stays valid:
    what was delivered was delivered)."""

    def __init__(self, it, loader, plan: ResumePlan | None):
        n = it._num_workers
        self.num_workers = n
        self.in_order = it._in_order
        self.persistent = it._persistent_workers
        self.iterable = it._dataset_kind == _DatasetKind.Iterable
        self.index_sampler = it._index_sampler
        self.generators = sampler_generators(loader)
        self.sampler_stateful = False  # decided per epoch: the sampler or its iterator
        self.shared_seed = it._shared_seed
        self.len_called = it._IterableDataset_len_called
        self.plan = plan
        self.fast_forward_index = next(iter(it._index_sampler)) if self.iterable else None
        self.epoch_blob: list = [None] * n   # each worker's record at this epoch's start
        self._decoded: dict = {}  # worker -> (record, epoch record, snapshot): state_dict()'s cache
        self._new_epoch_counters()
        if plan is not None and plan.finished:
            # a new epoch after the saved one: the sampler's generators as they were then
            _set_generators(plan.generators_now, self.generators)
            if not self.persistent and loader.generator is not None:
                # DataLoader draws each epoch's base seed from it: draw again, from its
                # restored state (without generator= the seed came from the global RNG,
                # as DataLoader's would)
                it._base_seed = torch.empty((), dtype=torch.int64).random_(
                    generator=loader.generator).item()
        if plan is not None and (self.persistent or not plan.finished):
            it._base_seed = plan.base_seed
        self.base_seed = it._base_seed

    def _new_epoch_counters(self) -> None:
        n = self.num_workers
        self.delivered: list = [None] * n    # record after each worker's last delivered batch
        self.latest: list = [(-1, b) for b in self.epoch_blob]  # (seq, record) of its newest reply
        # (worker, seq, record, error): taken from a worker, not yet handed to the caller
        self.handing: collections.deque[tuple[int, int, bytes | None, bool]] = collections.deque()
        self.position = 0        # sampler items consumed by the batches handed over (in order)
        self.draws = 0           # sampler items drawn
        self.yielded = 0
        self.last_worker = n - 1
        self.finished = False
        self.pending: dict = {}  # in_order=False: seq -> index, sent and not handed over
        self.replay: collections.deque = collections.deque()
        self.snapshots: collections.deque = collections.deque()  # (draws, (sampler state, iterator state))
        self.epoch_rng: dict | None = None

    def worker_plan(self, worker: int) -> dict | None:
        if self.plan is None:
            return None
        plan = self.plan.worker(worker)
        if plan is not None:
            plan["fast_forward_index"] = self.fast_forward_index
        return plan

    # -- epochs (the iterator's _reset) --------------------------------------
    def begin_epoch(self) -> None:
        """Before the epoch's sampler iterator is made: where the main process's
        generators stand, i.e. what the sampler will draw from."""
        self._next_epoch_rng = main_rng(self.generators)

    def position_epoch(self, it, first: bool) -> None:
        """After the previous epoch's replies are all in (persistent workers) and the
        epoch's sampler iterator and round robin exist, before the first request.
        A later epoch of persistent workers starts each worker where its last reply
        left it. A loaded state is applied here (sampler, round robin, counters)."""
        if not first:
            for worker, seq, blob, _error in self.handing:
                self.seen(worker, seq, blob)
            self.epoch_blob = [blob for _seq, blob in self.latest]
            self._new_epoch_counters()
        self.epoch_rng = self._next_epoch_rng
        self.sampler_stateful = is_stateful(self.index_sampler) or is_stateful(it._sampler_iter)
        plan, self.plan = self.plan, None
        if plan is not None and not plan.finished:
            self._resume(it, plan)
        if self.sampler_stateful:
            self.snapshots.append((self.draws, self._sampler_states(it._sampler_iter)))

    def _resume(self, it, plan: ResumePlan) -> None:
        self.epoch_rng = plan.epoch_rng
        caller_rng = plan_rng = None
        if plan.epoch_rng is not None:
            caller_rng = plain_rng(capture_rng())
            plan_rng = plan.epoch_rng
            _set_main_rng(plan_rng, self.generators)
        try:
            if self.sampler_stateful and (plan.index_sampler_state is not None
                                          or plan.sampler_iter_state is not None):
                # torchdata's order: the sampler's state, a new iterator, the iterator's state
                if plan.index_sampler_state is not None and is_stateful(self.index_sampler):
                    self.index_sampler.load_state_dict(plan.index_sampler_state)
                it._sampler_iter = iter(self.index_sampler)
                if plan.sampler_iter_state is not None and is_stateful(it._sampler_iter):
                    it._sampler_iter.load_state_dict(plan.sampler_iter_state)
            else:
                sampler_iter = iter(self.index_sampler)
                try:
                    for _ in range(plan.position):
                        next(sampler_iter)
                    # a sampler seeds itself on its first draw: make it under the epoch's state
                    first = next(sampler_iter)
                    it._sampler_iter = itertools.chain((first,), sampler_iter)
                except StopIteration:
                    it._sampler_iter = iter(())
        finally:
            if caller_rng is not None:
                set_rng(caller_rng)
        self.position = self.draws = plan.position
        self.yielded = plan.yielded
        it._num_yielded = plan.yielded
        it._IterableDataset_len_called = plan.len_called
        self.last_worker = plan.last_worker
        for _ in range((plan.last_worker + 1) % self.num_workers):
            next(it._worker_queue_idx_cycle)
        self.replay.extend(plan.pending)
        if self.iterable:  # nothing drew from them this epoch but the base seed
            _set_generators(plan.generators_now, self.generators)
        for worker in range(self.num_workers):
            post, start = plan.records(worker)
            self.delivered[worker] = post
            self.epoch_blob[worker] = start
            self.latest[worker] = (-1, post if post is not None else start)

    def _sampler_states(self, sampler_iter):
        return (self.index_sampler.state_dict() if is_stateful(self.index_sampler) else None,
                sampler_iter.state_dict() if is_stateful(sampler_iter) else None)

    # -- per batch -------------------------------------------------------------
    def next_index(self, sampler_iter, seq: int):
        """The iterator's _next_index: replayed batches first (in_order=False), then
        the sampler; a stateful sampler's state is kept per draw."""
        if self.replay:
            index = self.replay.popleft()
        else:
            index = next(sampler_iter)  # may raise StopIteration
            self.draws += 1
            if self.sampler_stateful:
                snapshots = self.snapshots
                snapshots.append((self.draws, self._sampler_states(sampler_iter)))
                while len(snapshots) > 1 and snapshots[1][0] <= self.position:
                    snapshots.popleft()
        if not self.in_order:
            self.pending[seq] = index
        return index

    def received(self, worker: int, seq: int, blob: bytes | None, error: bool) -> None:
        """A reply main took (decoded, or about to raise): handed over at commit()."""
        self.handing.append((worker, seq, blob, error))

    def commit(self) -> None:
        """The iterator handed one batch (or its error) to the caller."""
        if not self.handing:
            return
        worker, seq, blob, error = self.handing.popleft()
        if blob is not None:  # None: its capture raised, and the caller got that error
            self.delivered[worker] = blob
            self.seen(worker, seq, blob)
        self.last_worker = worker
        self.position += 1
        if not error:
            self.yielded += 1
        if not self.in_order:
            self.pending.pop(seq, None)

    def raised(self, staged: bool) -> None:
        """__next__ raised: a worker's error was handed over (commit it); anything
        else (an interrupt while refilling) lost the batch on the way, so it was
        not delivered: forget it (with device= the next batch stays staged)."""
        if self.handing and self.handing[0][3]:
            self.commit()
        elif not staged:
            self.handing.clear()

    def seen(self, worker: int, seq: int, blob) -> None:
        """Any reply of `worker` (an END, one reclaimed at an epoch's end)."""
        if blob is not None and seq > self.latest[worker][0]:
            self.latest[worker] = (seq, blob)

    def finish(self) -> None:
        self.finished = True

    # -- the state ----------------------------------------------------------------
    def state_dict(self) -> dict:
        n = self.num_workers
        if self.finished:
            # the next epoch: persistent workers start where their last reply left them
            workers = {worker_key(w): self._worker_snapshot(
                w, None, self.latest[w][1] if self.persistent else None) for w in range(n)}
        else:
            workers = {worker_key(w): self._worker_snapshot(w, self.delivered[w], self.epoch_blob[w])
                       for w in range(n)}
        index_state = iter_state = None
        position = self.position if self.in_order else self.draws
        if self.sampler_stateful and self.snapshots:
            wanted = position
            for draws, states in self.snapshots:
                if draws == wanted:
                    index_state, iter_state = states
        main = {
            NUM_WORKERS: n,
            SAMPLER_ITER_STATE: iter_state,
            INDEX_SAMPLER_STATE: index_state,
            SAMPLER_ITER_YIELDED: position,
            ITERABLEDATASET_LEN_CALLED: self.len_called,
            SHARED_SEED: self.shared_seed,
            BASE_SEED: self.base_seed,
            IN_ORDER: self.in_order,
            MAIN_RNG: {"epoch_start": self.epoch_rng,
                       "generators_now": [g.get_state() for g in self.generators]},
            PENDING: ([] if self.in_order else
                      [self.pending[s] for s in sorted(self.pending)] + list(self.replay)),
        }
        return {
            SNAPSHOT: {
                SNAPSHOT_STEP: self.yielded,
                LAST_YIELDED_WORKER_ID: self.last_worker,
                MAIN_SNAPSHOT: main,
                WORKER_SNAPSHOTS: workers,
            },
            STEPS_SINCE_SNAPSHOT: 0,
            ITERATOR_FINISHED: self.finished,
            FORMAT: FORMAT_VERSION,
        }

    def _worker_snapshot(self, worker: int, delivered, epoch_start) -> dict:
        # decoded once per new record: a caller that saves every step decodes only
        # the workers that delivered since (the snapshot's values are immutable but
        # for the RNG tensors, which nothing writes)
        cached = self._decoded.get(worker)
        if cached is None or cached[0] is not delivered or cached[1] is not epoch_start:
            cached = (delivered, epoch_start, self._decode_worker(worker, delivered, epoch_start))
            self._decoded[worker] = cached
        snapshot = dict(cached[2])  # the caller's to change
        if snapshot[FETCHER_STATE] is not None:
            snapshot[FETCHER_STATE] = dict(snapshot[FETCHER_STATE])
        return snapshot

    def _decode_worker(self, worker: int, delivered, epoch_start) -> dict:
        post, start = _record(delivered), _record(epoch_start)
        start_rng, start_dataset = (start[0], start[1]) if start else (None, None)
        snapshot = {WORKER_ID: worker, WORKER_EPOCH_RNG: start_rng, WORKER_EPOCH_DATASET: start_dataset}
        if post is None:
            rng, dataset_state, iter_state, fetched, ended = None, start_dataset, None, 0, False
        else:
            rng, dataset_state, iter_state, fetched, ended = post
        snapshot.update({DATASET_STATE: dataset_state, WORKER_RNG: rng, WORKER_FETCHED: fetched,
                         FETCHER_STATE: ({DATASET_ITER_STATE: iter_state, FETCHER_ENDED: ended}
                                         if self.iterable else None)})
        return snapshot


class ResumePlan:
    """A loaded state, checked against the loader that will continue from it."""

    def __init__(self, state: dict, loader):
        self.state = state
        if isinstance(state, dict) and SNAPSHOT not in state and NUM_YIELDED in state:
            raise ValueError(
                f"this state was saved by a loader with num_workers=0; this one has num_workers="
                f"{loader.num_workers}. The state is per worker, so it loads only into a loader "
                "with the same num_workers (torchdata's StatefulDataLoader refuses it too): pass "
                "num_workers=0.")
        if not isinstance(state, dict) or SNAPSHOT not in state:
            raise ValueError(
                "PoolLoader.load_state_dict() expects a dict from PoolLoader.state_dict() (or "
                f"StatefulDataLoader.state_dict()) with a {SNAPSHOT!r} key; got "
                f"{type(state).__name__} with keys {sorted(state)[:8] if isinstance(state, dict) else '-'}")
        snapshot = state[SNAPSHOT]
        try:
            main = snapshot[MAIN_SNAPSHOT]
            saved_workers = main[NUM_WORKERS]
            self.position = int(main[SAMPLER_ITER_YIELDED])
            self.yielded = int(snapshot[SNAPSHOT_STEP]) + int(state.get(STEPS_SINCE_SNAPSHOT, 0))
            self.last_worker = int(snapshot[LAST_YIELDED_WORKER_ID])
            self.base_seed = int(main[BASE_SEED])
            self.workers = snapshot[WORKER_SNAPSHOTS]
        except KeyError as e:
            raise ValueError(f"PoolLoader.load_state_dict(): the state has no {e.args[0]!r} entry; "
                             "pass the dict PoolLoader.state_dict() returned") from None
        if saved_workers != loader.num_workers:
            raise ValueError(
                f"this state was saved by a loader with num_workers={saved_workers}; this one has "
                f"num_workers={loader.num_workers}. The state is per worker (each worker's random "
                "state and dataset position), so it loads only into a loader with the same "
                f"num_workers (torchdata's StatefulDataLoader refuses it too): pass "
                f"num_workers={saved_workers}.")
        if STEPS_SINCE_SNAPSHOT in state and state[STEPS_SINCE_SNAPSHOT] and FORMAT not in state:
            raise ValueError(
                f"this StatefulDataLoader state is {state[STEPS_SINCE_SNAPSHOT]} steps past its last "
                "snapshot (snapshot_every_n_steps > 1): PoolLoader resumes from a snapshot only; "
                "save it with snapshot_every_n_steps=1")
        self.finished = bool(state.get(ITERATOR_FINISHED, False))
        self.index_sampler_state = main.get(INDEX_SAMPLER_STATE)
        self.sampler_iter_state = main.get(SAMPLER_ITER_STATE)
        self.len_called = main.get(ITERABLEDATASET_LEN_CALLED)
        rng = main.get(MAIN_RNG) or {}
        self.epoch_rng = rng.get("epoch_start")
        self.generators_now = rng.get("generators_now", [])
        self.pending = list(main.get(PENDING) or [])
        if self.finished:
            self.position = self.yielded = 0
            self.last_worker = loader.num_workers - 1
            self.pending = []
        self.persistent = loader.persistent_workers
        iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
        if iterable and not self.finished:
            replays = [s.get(WORKER_FETCHED, 0) for s in self.workers.values()
                       if s and s.get(DATASET_STATE) is None
                       and (s.get(FETCHER_STATE) or {}).get(DATASET_ITER_STATE) is None]
            if any(replays) and not is_stateful(loader.dataset):
                warnings.warn(
                    "PoolLoader resume: the IterableDataset has no state_dict()/load_state_dict(), so "
                    f"each worker replays the batches it fetched this epoch (up to {max(replays)}) to "
                    "get back to where it was. Implement them on the dataset (or its iterator) "
                    "to resume without the replay.", stacklevel=3)

    def worker_snapshot(self, worker: int) -> dict:
        return self.workers.get(worker_key(worker)) or {WORKER_ID: worker}

    def records(self, worker: int) -> tuple:
        """(after its last delivered batch, at the epoch's start) as tracker records."""
        s = self.worker_snapshot(worker)
        fetcher_state = s.get(FETCHER_STATE) or {}
        post: tuple | None = (
            s.get(WORKER_RNG), s.get(DATASET_STATE), fetcher_state.get(DATASET_ITER_STATE),
            int(s.get(WORKER_FETCHED, 0) or 0), bool(fetcher_state.get(FETCHER_ENDED, False)))
        if post is not None and post[0] is None and post[1] is None and post[2] is None and not post[3]:
            post = None
        start = None
        if s.get(WORKER_EPOCH_RNG) is not None or s.get(WORKER_EPOCH_DATASET) is not None:
            start = (s.get(WORKER_EPOCH_RNG), s.get(WORKER_EPOCH_DATASET), None, 0, False)
        return post, start

    def worker(self, worker: int) -> dict | None:
        """What worker `worker` applies at start (WorkerProgress.first_fetcher)."""
        s = self.worker_snapshot(worker)
        if self.finished:
            if not self.persistent:
                return None  # a fresh epoch of fresh workers
            # a persistent worker starts the next epoch where its last reply left it
            rng, dataset_state = s.get(WORKER_EPOCH_RNG), s.get(WORKER_EPOCH_DATASET)
            return {DATASET_STATE: dataset_state, WORKER_EPOCH_RNG: _for_worker(rng),
                    WORKER_RNG: None, WORKER_FETCHED: 0, FETCHER_STATE: None}
        return {DATASET_STATE: s.get(DATASET_STATE),
                WORKER_EPOCH_RNG: _for_worker(s.get(WORKER_EPOCH_RNG)),
                WORKER_RNG: _for_worker(s.get(WORKER_RNG)),
                WORKER_FETCHED: int(s.get(WORKER_FETCHED, 0) or 0),
                FETCHER_STATE: s.get(FETCHER_STATE)}


# ---------------------------------------------------------------------------
# num_workers=0: DataLoader's own single-process iterator, counted

NUM_YIELDED = "_num_yielded"  # StatefulDataLoader's single-process key


class SingleProcessIter(_SingleProcessDataLoaderIter):
    """DataLoader's single-process iterator plus what a state needs, in
    StatefulDataLoader's single-process layout. The dataset runs in the caller's
    process and draws from its global RNG, interleaved with whatever else the
    process draws: batches after a resume are identical when the caller also
    restores that RNG (as for the rest of its training); the indices (and an
    IterableDataset's position) always are."""

    def __init__(self, loader, plan: dict | None):
        caller_rng = plain_rng(capture_rng()) if continues_epoch(plan) else None
        super().__init__(loader)
        self._finished = False
        self._position = 0
        self._generators = sampler_generators(loader)
        # the sampler draws on its first next(): this is the state it will draw from
        self._epoch_rng = main_rng(self._generators)
        if plan is None:
            return
        if caller_rng is None:  # saved after its epoch ended: a new epoch
            _set_generators((plan.get(MAIN_RNG) or {}).get("generators_now", []), self._generators)
            self._epoch_rng = main_rng(self._generators)
            return
        epoch_rng = (plan.get(MAIN_RNG) or {}).get("epoch_start")
        try:
            if epoch_rng is not None:
                self._epoch_rng = epoch_rng
                _set_main_rng(epoch_rng, self._generators)
            self._resume(plan)
        finally:
            # The caller's RNG as it was (this iterator's base seed was drawn when the
            # epoch began) — unless it is the very state the epoch started from (saved
            # before the first batch and restored by the caller): then it goes on from
            # where the sampler's first draw left it, as it did in the saved run.
            if epoch_rng is None or not torch.equal(caller_rng["torch"], epoch_rng["torch"]):
                set_rng(caller_rng)

    def _resume(self, state: dict) -> None:
        """Under the epoch's starting RNG: sampler, dataset state, fetcher, replay."""
        position = int(state[SAMPLER_ITER_YIELDED])
        index_state, iter_state = state.get(INDEX_SAMPLER_STATE), state.get(SAMPLER_ITER_STATE)
        if (is_stateful(self._index_sampler) or is_stateful(self._sampler_iter)) and (
                index_state is not None or iter_state is not None):
            if index_state is not None and is_stateful(self._index_sampler):
                self._index_sampler.load_state_dict(index_state)
            self._sampler_iter = iter(self._index_sampler)
            if iter_state is not None and is_stateful(self._sampler_iter):
                self._sampler_iter.load_state_dict(iter_state)
        elif self._dataset_kind == _DatasetKind.Map:
            sampler_iter = iter(self._index_sampler)
            try:
                for _ in range(position):
                    next(sampler_iter)
                first = next(sampler_iter)  # a sampler seeds itself on its first draw
                self._sampler_iter = itertools.chain((first,), sampler_iter)
            except StopIteration:
                self._sampler_iter = iter(())
        else:  # nothing drew from them but the base seed
            _set_generators((state.get(MAIN_RNG) or {}).get("generators_now", []), self._generators)
        self._position = position
        self._num_yielded = int(state[NUM_YIELDED])
        self._IterableDataset_len_called = state.get(ITERABLEDATASET_LEN_CALLED)
        dataset_state = state.get(DATASET_STATE)
        if dataset_state is not None and is_stateful(self._dataset):
            self._dataset.load_state_dict(dataset_state)  # type: ignore[attr-defined]
        self._dataset_fetcher = _DatasetKind.create_fetcher(
            self._dataset_kind, self._dataset, self._auto_collation, self._collate_fn, self._drop_last)
        if self._dataset_kind == _DatasetKind.Iterable:
            fetcher = self._dataset_fetcher
            fetcher_state = state.get(FETCHER_STATE) or {}
            if fetcher_state.get(DATASET_ITER_STATE) is not None and is_stateful(fetcher.dataset_iter):
                fetcher.dataset_iter.load_state_dict(fetcher_state[DATASET_ITER_STATE])
                fetcher.ended = bool(fetcher_state.get(FETCHER_ENDED, False))
            elif dataset_state is not None and is_stateful(self._dataset):
                fetcher.ended = bool(fetcher_state.get(FETCHER_ENDED, False))
            elif self._num_yielded:
                warnings.warn(
                    "PoolLoader resume: the IterableDataset has no state_dict()/load_state_dict(), so "
                    f"its first {self._num_yielded} batches are fetched again and dropped to get back "
                    "to where it was. Implement them on the dataset (or its iterator) to resume "
                    "without the replay.", stacklevel=5)
                index = next(iter(self._index_sampler))
                for _ in range(self._num_yielded):
                    try:
                        fetcher.fetch(index)
                    except StopIteration:
                        break

    def _next_index(self):
        index = next(self._sampler_iter)  # may raise StopIteration
        self._position += 1
        return index

    def __next__(self):
        try:
            return super().__next__()
        except StopIteration:
            self._finished = True
            raise

    def state_dict(self) -> dict:
        fetcher = self._dataset_fetcher
        iterable = self._dataset_kind == _DatasetKind.Iterable
        dataset_state = fetcher_state = None
        if iterable:
            fetcher_state = {DATASET_ITER_STATE: (fetcher.dataset_iter.state_dict()
                                                  if is_stateful(fetcher.dataset_iter) else None),
                             FETCHER_ENDED: fetcher.ended}
            if fetcher.dataset_iter is not fetcher.dataset and is_stateful(fetcher.dataset):
                dataset_state = fetcher.dataset.state_dict()
        elif is_stateful(self._dataset):
            dataset_state = self._dataset.state_dict()  # type: ignore[attr-defined]
        stateful_sampler = is_stateful(self._index_sampler) or is_stateful(self._sampler_iter)
        return {
            INDEX_SAMPLER_STATE: (self._index_sampler.state_dict()
                                  if stateful_sampler and is_stateful(self._index_sampler) else None),
            SAMPLER_ITER_STATE: (self._sampler_iter.state_dict()
                                 if stateful_sampler and is_stateful(self._sampler_iter) else None),
            SAMPLER_ITER_YIELDED: self._position,
            NUM_YIELDED: self._num_yielded,
            ITERABLEDATASET_LEN_CALLED: self._IterableDataset_len_called,
            SHARED_SEED: self._shared_seed,
            FETCHER_STATE: fetcher_state,
            DATASET_STATE: dataset_state,
            ITERATOR_FINISHED: self._finished,
            MAIN_RNG: {"epoch_start": self._epoch_rng,
                       "generators_now": [g.get_state() for g in self._generators]},
            FORMAT: FORMAT_VERSION,
        }


def continues_epoch(plan) -> bool:
    """A loaded state that continues an epoch (not one saved after its end)."""
    if plan is None:
        return False
    if isinstance(plan, ResumePlan):
        return not plan.finished
    return not plan.get(ITERATOR_FINISHED, False)


def check_single_process_state(state: dict) -> dict:
    """A state for a num_workers=0 loader: refuse one saved with workers."""
    if SNAPSHOT in state:
        saved = state[SNAPSHOT].get(MAIN_SNAPSHOT, {}).get(NUM_WORKERS, "?")
        raise ValueError(
            f"this state was saved by a loader with num_workers={saved}; this one has num_workers=0. "
            "The state is per worker, so it loads only into a loader with the same num_workers "
            f"(torchdata's StatefulDataLoader refuses it too): pass num_workers={saved}.")
    if NUM_YIELDED not in state or SAMPLER_ITER_YIELDED not in state:
        raise ValueError(
            "PoolLoader.load_state_dict() expects the dict PoolLoader.state_dict() returned "
            f"(for num_workers=0: with {NUM_YIELDED!r} and {SAMPLER_ITER_YIELDED!r}); got keys "
            f"{sorted(state)[:8]}")
    return state
