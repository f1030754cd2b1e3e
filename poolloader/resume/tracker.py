"""Main's side of mid-epoch resume (see keys.py for the design): `ResumeTracker`
follows an iterator's epoch (the records of delivered batches, the sampler's position,
the round robin) and builds `state_dict()`; `ResumePlan` is a loaded state, applied
by the next iterator and handed, per worker, to the worker process.

The tracker is handed the iterator's settings (`IteratorSetup`) and never writes its
fields: where a loaded
state moves the iterator (its base seed, its sampler iterator, its counters, its round
robin), the tracker returns the values (`base_seed`, `Resumed`) and the iterator sets
them on itself.
"""
from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.utils.data.dataloader import _DatasetKind

from poolloader.errors import warn
from poolloader.resume.keys import (
    BASE_SEED,
    DATASET_ITER_STATE,
    DATASET_STATE,
    EPOCH_REPLAY,
    EPOCH_SNAPSHOT_RNG,
    FETCHER_ENDED,
    FETCHER_STATE,
    FORMAT,
    FORMAT_VERSION,
    IN_ORDER,
    INDEX_SAMPLER_STATE,
    ITERABLEDATASET_LEN_CALLED,
    ITERATOR_FINISHED,
    LAST_YIELDED_WORKER_ID,
    MAIN_RNG,
    MAIN_SNAPSHOT,
    NUM_WORKERS,
    NUM_YIELDED,
    PENDING,
    RECORD_WARN_BYTES,
    REPLAY,
    SAMPLER_ITER_STATE,
    SAMPLER_ITER_YIELDED,
    SHARED_SEED,
    SNAPSHOT,
    SNAPSHOT_RNG,
    SNAPSHOT_STEP,
    STEPS_SINCE_SNAPSHOT,
    WORKER_EPOCH_DATASET,
    WORKER_EPOCH_RNG,
    WORKER_FETCHED,
    WORKER_ID,
    WORKER_RNG,
    WORKER_SNAPSHOTS,
    capture_rng,
    decode_record,
    epoch_rng_drawn,
    is_snapshot,
    is_stateful,
    main_rng,
    plain_rng,
    position_sampler,
    rng_for_worker,
    sampler_generators,
    set_generators,
    snapshot_interval,
    worker_key,
)


class IteratorSetup(NamedTuple):
    """What the tracker reads of its iterator, once, at its start: DataLoader's iterator
    fields (_BaseDataLoaderIter's _num_workers, _base_seed, ...), handed over by name."""
    num_workers: int
    base_seed: int | float       # an int (torch types its .item() draw int | float)
    in_order: bool
    persistent: bool
    dataset_kind: int            # torch's _DatasetKind
    index_sampler: object        # the batch sampler (or sampler) the epoch draws from
    shared_seed: int | None      # DataLoader's _shared_seed (IterDataPipe shuffles)
    len_called: int | None       # DataLoader's _IterableDataset_len_called


class Position(NamedTuple):
    """Where a worker stands, as main keeps it: its last snapshot record, the indices
    of its fetches after it (the first `kept` of `replays`: later positions of the
    same worker share the list and append to it), and its newest record. A record is
    reply bytes (keys.WorkerProgress.capture) or a decoded tuple from a loaded state;
    `snapshot` None: the worker as seeded."""
    snapshot: bytes | tuple | None
    replays: list
    kept: int
    last: bytes | tuple | None

    def indices(self) -> list:
        return self.replays[:self.kept]


class _Once:
    """A flag one loader's trackers share (plain data: a tracker stays picklable)."""

    def __init__(self):
        self.done = False


# loader -> whether it warned of a large resume record (one warning per loader)
_large_record_warned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Resumed(NamedTuple):
    """Where a loaded state puts the iterator at the start of its epoch."""
    sampler_iter: Iterator      # the epoch's sampler iterator, positioned
    yielded: int                # batches yielded before (DataLoader's _num_yielded)
    len_called: int | None      # DataLoader's _IterableDataset_len_called
    round_robin_done: int       # workers the round robin has passed this epoch


# ---------------------------------------------------------------------------
# main side

class ResumeTracker:
    """Main's record of one iterator's progress, and the state built from it.

    Per batch it stores references only (the reply's record bytes, a counter);
    `state_dict()` does the decoding. It holds no reference to the iterator, so
    the loader may keep it after the iterator is gone (its state stays valid:
    what was delivered was delivered)."""

    def __init__(self, it: IteratorSetup, loader, plan: ResumePlan | None):
        n = it.num_workers
        base_seed = it.base_seed
        self.num_workers = n
        self.in_order = it.in_order
        self.persistent = it.persistent
        self.iterable = it.dataset_kind == _DatasetKind.Iterable
        self.index_sampler = it.index_sampler
        self.generators = sampler_generators(loader)
        self.sampler_stateful = False  # decided per epoch: the sampler or its iterator
        self.shared_seed = it.shared_seed
        self.len_called = it.len_called
        self.plan = plan
        self.dataset_name = type(loader.dataset).__name__
        self.large_record_warned = _large_record_warned.setdefault(loader, _Once())
        # PoolLoader(snapshot_every_n_steps=), resolved for the dataset (the workers' rule)
        self.snapshot_every = snapshot_interval(getattr(loader, "snapshot_every_n_steps", None),
                                                loader.dataset)
        self.fast_forward_index = next(iter(it.index_sampler)) if self.iterable else None  # type: ignore[call-overload]
        self.epoch_blob: list = [None] * n   # each worker's record at this epoch's start
        self._decoded: dict = {}  # worker -> (record, epoch record, snapshot): state_dict()'s cache
        self._new_epoch_counters()
        if plan is not None and plan.finished:
            # a new epoch after the saved one: the sampler's generators as they were then
            set_generators(plan.generators_now, self.generators)
            if not self.persistent and loader.generator is not None:
                # DataLoader draws each epoch's base seed from it: draw again, from its
                # restored state (without generator= the seed came from the global RNG,
                # as DataLoader's would)
                base_seed = torch.empty((), dtype=torch.int64).random_(
                    generator=loader.generator).item()
        if plan is not None and (self.persistent or not plan.finished):
            base_seed = plan.base_seed
        self.base_seed = base_seed  # the iterator takes it as its own

    def _new_epoch_counters(self) -> None:
        n = self.num_workers
        self.delivered: list = [None] * n    # Position after each worker's last delivered batch
        self.latest: list = [(-1, b) for b in self.epoch_blob]  # (seq, Position) of its newest reply
        self.sent: dict = {}     # seq -> index, sent and not yet recorded (replays after a snapshot)
        self._drawing: tuple[int, bool] = (-1, False)  # (seq, from the replay) of the last draw
        self._counted = -1       # the last seq whose draw was counted (next_index)
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

    def settle_handing(self) -> None:
        """At an epoch's end, the replies taken and not handed over (a batch staged by
        device=) count as seen: before the replies reclaimed after them (their seqs
        are lower), so each worker's replays stay in its fetch order."""
        for worker, seq, blob, _error in self.handing:
            self.seen(worker, seq, blob)
        self.handing.clear()

    def position_epoch(self, sampler_iter: Iterator, first: bool) -> Resumed | None:
        """After the previous epoch's replies are all in (persistent workers) and the
        epoch's sampler iterator and round robin exist, before the first request.
        A later epoch of persistent workers starts each worker where its last reply
        left it. A loaded state is applied here (sampler, round robin, counters)."""
        if not first:
            self.settle_handing()
            self.epoch_blob = [blob for _seq, blob in self.latest]
            self._new_epoch_counters()
        self.epoch_rng = self._next_epoch_rng
        self.sampler_stateful = is_stateful(self.index_sampler) or is_stateful(sampler_iter)
        plan, self.plan = self.plan, None
        resumed = None
        if plan is not None and not plan.finished:
            resumed = self._resume(plan, sampler_iter)
            sampler_iter = resumed.sampler_iter
        elif plan is not None and self.persistent:
            # a new epoch after the saved one: each worker starts it where its last reply
            # left it (the saved epoch record: ResumePlan.worker), which a state saved in
            # this epoch must carry for a worker that has not delivered yet
            for worker in range(self.num_workers):
                start = plan.records(worker)[1]
                self.epoch_blob[worker] = start
                self.latest[worker] = (-1, start)
        if self.sampler_stateful:
            self.snapshots.append((self.draws, self._sampler_states(sampler_iter)))
        return resumed

    def _resume(self, plan: ResumePlan, sampler_iter: Iterator) -> Resumed:
        self.epoch_rng = plan.epoch_rng
        caller_rng = plain_rng(capture_rng()) if plan.epoch_rng is not None else None
        with epoch_rng_drawn(plan.epoch_rng, self.generators, caller_rng):
            sampler_iter = position_sampler(self.index_sampler, sampler_iter,
                                            plan.position, plan.index_sampler_state,
                                            plan.sampler_iter_state)
        self.position = self.draws = plan.position
        self.yielded = plan.yielded
        self.last_worker = plan.last_worker
        self.replay.extend(plan.pending)
        if self.iterable:  # nothing drew from them this epoch but the base seed
            set_generators(plan.generators_now, self.generators)
        for worker in range(self.num_workers):
            post, start = plan.records(worker)
            self.delivered[worker] = post
            self.epoch_blob[worker] = start
            self.latest[worker] = (-1, post if post is not None else start)
        return Resumed(sampler_iter, plan.yielded, plan.len_called,
                       (plan.last_worker + 1) % self.num_workers)

    def _sampler_states(self, sampler_iter):
        return (self.index_sampler.state_dict() if is_stateful(self.index_sampler) else None,
                sampler_iter.state_dict() if is_stateful(sampler_iter) else None)

    # -- per batch -------------------------------------------------------------
    def next_index(self, sampler_iter, seq: int):
        """The iterator's _next_index for the request it will send as `seq`: replayed
        batches first (in_order=False), then the sampler; a stateful sampler's state is
        kept per draw.

        Interrupts (KeyboardInterrupt, or any exception a signal handler raises) come
        as a call returns, so an index returned to a caller can be lost with it: the
        draw records its index under `seq` in the same C-level call that takes it,
        and a second call for the same `seq` (the caller's retry) returns that index
        again instead of drawing another; what the draw counts is counted once."""
        sent = self.sent
        if seq not in sent:
            if self.replay:
                self._drawing = (seq, True)
                sent.update(zip((seq,), itertools.starmap(self.replay.popleft, ((),))))
            else:
                self._drawing = (seq, False)
                sent.update(zip((seq,), itertools.islice(sampler_iter, 1)))
                if seq not in sent:
                    raise StopIteration
        index = sent[seq]
        if self._counted != seq:
            self._counted = seq  # with the steps up to the first call: no interrupt between
            replayed = self._drawing[0] == seq and self._drawing[1]
            if not replayed:
                self.draws += 1
            if not self.in_order:
                self.pending[seq] = index
            if not replayed and self.sampler_stateful:
                snapshots = self.snapshots
                snapshots.append((self.draws, self._sampler_states(sampler_iter)))
                while len(snapshots) > 1 and snapshots[1][0] <= self.position:
                    snapshots.popleft()
        return index

    def received(self, worker: int, seq: int, blob: bytes | None, error: bool) -> None:
        """A reply main took (decoded, or about to raise): handed over at commit().
        Once: a delivery an interrupt cut short before its decode is taken again."""
        handing = self.handing
        if not handing or handing[-1][1] != seq:
            handing.append((worker, seq, blob, error))

    def commit(self) -> None:
        """The iterator handed one batch (or its error) to the caller."""
        if not self.handing:
            return
        worker, seq, blob, error = self.handing.popleft()
        index = self.sent.pop(seq, None)
        if blob is not None:  # None: its capture raised, and the caller got that error
            before = self.delivered[worker]
            position = self._advance(before if before is not None else self.epoch_blob[worker],
                                     index, blob)
            self.delivered[worker] = position
            if seq > self.latest[worker][0]:
                self.latest[worker] = (seq, position)
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

    def seen(self, worker: int, seq: int, blob):
        """A reply of `worker` that is not delivered (an END, one reclaimed at an
        epoch's end). Returns what a share_batches follower's `learned` needs of it
        (worker, seq, record, indices), or None if it moved nothing."""
        index = self.sent.pop(seq, None)
        if blob is not None and seq > self.latest[worker][0]:
            self.latest[worker] = (seq, self._advance(self.latest[worker][1], index, blob))
            return worker, seq, blob, index
        return None

    def learned(self, worker: int, _seq: int, blob: bytes, index) -> None:
        """A share_batches follower's tracker, at the start of an epoch of persistent
        workers: one reply the leader reclaimed, never delivered, at the end of the last
        one (what its `seen` returned there), in the leader's order."""
        position = self._advance(self.epoch_blob[worker], index, blob)
        self.epoch_blob[worker] = position
        self.latest[worker] = (-1, position)

    def _advance(self, position: Position | None, index, blob: bytes) -> Position:
        """The worker's Position after its reply to `index` with record `blob`."""
        if len(blob) > RECORD_WARN_BYTES:
            self._warn_large(blob)
        if is_snapshot(blob):
            return Position(blob, [], 0, blob)
        if position is None:  # no snapshot yet: replayed from the worker as seeded
            position = Position(None, [], 0, None)
        replays = position.replays
        if len(replays) != position.kept:  # another Position extends this list
            replays = replays[:position.kept]
        replays.append(index)
        return Position(position.snapshot, replays, position.kept + 1, blob)

    def _warn_large(self, blob: bytes) -> None:
        if self.large_record_warned.done:
            return
        self.large_record_warned.done = True
        every = self.snapshot_every
        warn(
            f"PoolLoader resume: a worker's resume record for {self.dataset_name} is "
            f"{len(blob)} bytes, over the {RECORD_WARN_BYTES} bytes (1 MiB) a record should stay "
            "under: the dataset's (or its iterator's) state_dict() is pickled into the batch's "
            "slot and copied by the main process on every snapshot, and the slots grow to hold "
            f"it. Pass a larger snapshot_every_n_steps= (now {every}; a resume then replays "
            "more batches) or stateful=False if you do not resume mid-epoch; or keep large "
            "tensors (an nn.Module's parameters and buffers) out of the dataset's state_dict().")

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
        snapshot[REPLAY], snapshot[EPOCH_REPLAY] = list(snapshot[REPLAY]), list(snapshot[EPOCH_REPLAY])
        if snapshot[FETCHER_STATE] is not None:
            snapshot[FETCHER_STATE] = dict(snapshot[FETCHER_STATE])
        return snapshot

    def _decode_worker(self, worker: int, delivered, epoch_start) -> dict:
        post, start = _decode_position(delivered), _decode_position(epoch_start)
        start_rng = start_dataset = start_snapshot_rng = None
        start_replay: list = []
        if start is not None:
            base, start_replay, last = start
            start_rng = last[0] if last else None
            if base is not None:
                start_dataset = base[1]
                start_snapshot_rng = base[0] if start_replay else None
        snapshot = {WORKER_ID: worker, WORKER_EPOCH_RNG: start_rng, WORKER_EPOCH_DATASET: start_dataset,
                    EPOCH_SNAPSHOT_RNG: start_snapshot_rng, EPOCH_REPLAY: start_replay}
        if post is None:  # nothing delivered this epoch: where it started
            rng, dataset_state, iter_state, fetched, ended = None, start_dataset, None, 0, False
            snapshot_rng, replay = start_snapshot_rng, start_replay
        else:
            base, replay, last = post
            rng, fetched, ended = last[0], last[3], last[4]
            dataset_state = iter_state = snapshot_rng = None
            if base is not None:
                dataset_state, iter_state = base[1], base[2]
                snapshot_rng = base[0] if replay else None
        snapshot.update({DATASET_STATE: dataset_state, WORKER_RNG: rng, WORKER_FETCHED: fetched,
                         SNAPSHOT_RNG: snapshot_rng, REPLAY: replay,
                         FETCHER_STATE: ({DATASET_ITER_STATE: iter_state, FETCHER_ENDED: ended}
                                         if self.iterable else None)})
        return snapshot


def _decode_position(position: Position | None) -> tuple | None:
    """(snapshot record, replayed indices, newest record) of a Position, decoded."""
    if position is None:
        return None
    base = decode_record(position.snapshot)
    last = base if position.last is position.snapshot else decode_record(position.last)
    return base, position.indices(), last


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
                warn(
                    "PoolLoader resume: the IterableDataset has no state_dict()/load_state_dict(), so "
                    f"each worker replays the batches it fetched this epoch (up to {max(replays)}) to "
                    "get back to where it was. Implement them on the dataset (or its iterator) "
                    "to resume without the replay.")

    def worker_snapshot(self, worker: int) -> dict:
        return self.workers.get(worker_key(worker)) or {WORKER_ID: worker}

    def records(self, worker: int) -> tuple:
        """(after its last delivered batch, at the epoch's start) as tracker Positions."""
        s = self.worker_snapshot(worker)
        fetcher_state = s.get(FETCHER_STATE) or {}
        rng, dataset_state = s.get(WORKER_RNG), s.get(DATASET_STATE)
        iter_state = fetcher_state.get(DATASET_ITER_STATE)
        fetched = int(s.get(WORKER_FETCHED, 0) or 0)
        ended = bool(fetcher_state.get(FETCHER_ENDED, False))
        replay = list(s.get(REPLAY) or [])
        post = None
        if not (rng is None and (replay or (dataset_state is None and iter_state is None
                                            and not fetched))):
            post = _loaded_position((rng, dataset_state, iter_state, fetched, ended),
                                    s.get(SNAPSHOT_RNG), replay)
        start = None
        if s.get(WORKER_EPOCH_RNG) is not None or s.get(WORKER_EPOCH_DATASET) is not None:
            start = _loaded_position((s.get(WORKER_EPOCH_RNG), s.get(WORKER_EPOCH_DATASET), None, 0, False),
                                     s.get(EPOCH_SNAPSHOT_RNG), list(s.get(EPOCH_REPLAY) or []))
        return post, start

    def worker(self, worker: int) -> dict | None:
        """What worker `worker` applies at start (WorkerProgress.first_fetcher)."""
        s = self.worker_snapshot(worker)
        if self.finished:
            if not self.persistent:
                return None  # a fresh epoch of fresh workers
            # a persistent worker starts the next epoch where its last reply left it
            rng, dataset_state = s.get(WORKER_EPOCH_RNG), s.get(WORKER_EPOCH_DATASET)
            return {DATASET_STATE: dataset_state, WORKER_EPOCH_RNG: rng_for_worker(rng),
                    WORKER_RNG: None, WORKER_FETCHED: 0, FETCHER_STATE: None,
                    SNAPSHOT_RNG: rng_for_worker(s.get(EPOCH_SNAPSHOT_RNG)),
                    REPLAY: list(s.get(EPOCH_REPLAY) or [])}
        return {DATASET_STATE: s.get(DATASET_STATE),
                WORKER_EPOCH_RNG: rng_for_worker(s.get(WORKER_EPOCH_RNG)),
                WORKER_RNG: rng_for_worker(s.get(WORKER_RNG)),
                WORKER_FETCHED: int(s.get(WORKER_FETCHED, 0) or 0),
                FETCHER_STATE: s.get(FETCHER_STATE),
                SNAPSHOT_RNG: rng_for_worker(s.get(SNAPSHOT_RNG)),
                REPLAY: list(s.get(REPLAY) or [])}


def _loaded_position(last: tuple, snapshot_rng, replay: list) -> Position:
    """A Position from a loaded state: `last` (rng, dataset state, iterator state,
    fetched, ended), whose states are its snapshot's when `replay` follows it."""
    if not replay:
        return Position(last, [], 0, last)
    snapshot = (snapshot_rng, last[1], last[2], 0, last[4])
    return Position(snapshot, replay, len(replay), (last[0], None, None, last[3], last[4]))


def continues_epoch(plan) -> bool:
    """A loaded state (a ResumePlan, or a num_workers=0 state dict) that continues an
    epoch, not one saved after its end."""
    if plan is None:
        return False
    if isinstance(plan, ResumePlan):
        return not plan.finished
    return not plan.get(ITERATOR_FINISHED, False)
