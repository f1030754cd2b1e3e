"""Resume with num_workers=0: DataLoader's own single-process iterator, counted, in
StatefulDataLoader's single-process layout (see keys.py for the design)."""
from __future__ import annotations

import itertools

import torch
from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

from poolloader.errors import warn
from poolloader.resume.keys import (
    DATASET_ITER_STATE,
    DATASET_STATE,
    FETCHER_ENDED,
    FETCHER_STATE,
    FORMAT,
    FORMAT_VERSION,
    INDEX_SAMPLER_STATE,
    ITERABLEDATASET_LEN_CALLED,
    ITERATOR_FINISHED,
    MAIN_RNG,
    MAIN_SNAPSHOT,
    NUM_WORKERS,
    NUM_YIELDED,
    SAMPLER_ITER_STATE,
    SAMPLER_ITER_YIELDED,
    SHARED_SEED,
    SNAPSHOT,
    capture_rng,
    is_stateful,
    main_rng,
    plain_rng,
    sampler_generators,
    set_generators,
    set_main_rng,
    set_rng,
)
from poolloader.resume.tracker import continues_epoch

# ---------------------------------------------------------------------------
# num_workers=0: DataLoader's own single-process iterator, counted



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
            set_generators((plan.get(MAIN_RNG) or {}).get("generators_now", []), self._generators)
            self._epoch_rng = main_rng(self._generators)
            return
        epoch_rng = (plan.get(MAIN_RNG) or {}).get("epoch_start")
        try:
            if epoch_rng is not None:
                self._epoch_rng = epoch_rng
                set_main_rng(epoch_rng, self._generators)
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
            set_generators((state.get(MAIN_RNG) or {}).get("generators_now", []), self._generators)
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
                warn(
                    "PoolLoader resume: the IterableDataset has no state_dict()/load_state_dict(), so "
                    f"its first {self._num_yielded} batches are fetched again and dropped to get back "
                    "to where it was. Implement them on the dataset (or its iterator) to resume "
                    "without the replay.")
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
