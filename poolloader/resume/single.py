"""Resume with num_workers=0: DataLoader's own single-process iterator, counted, in
StatefulDataLoader's single-process layout (see keys.py for the design)."""
from __future__ import annotations

from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

from poolloader.errors import warn
from poolloader.resume import keys
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
        caller_rng = keys.plain_rng(keys.capture_rng()) if continues_epoch(plan) else None
        super().__init__(loader)
        self._finished = False
        self._position = 0
        self._generators = keys.sampler_generators(loader)
        # the sampler draws on its first next(): this is the state it will draw from
        self._epoch_rng = keys.main_rng(self._generators)
        if plan is None:
            return
        if caller_rng is None:  # saved after its epoch ended: a new epoch
            keys.set_generators((plan.get(keys.MAIN_RNG) or {}).get("generators_now", []), self._generators)
            self._epoch_rng = keys.main_rng(self._generators)
            return
        epoch_rng = (plan.get(keys.MAIN_RNG) or {}).get("epoch_start")
        if epoch_rng is not None:
            self._epoch_rng = epoch_rng
        # The caller's RNG as it was afterwards (this iterator's base seed was drawn
        # when the epoch began) — unless it is the very state the epoch started from
        # (saved before the first batch and restored by the caller): then it goes on
        # from where the sampler's first draw left it, as it did in the saved run.
        with keys.epoch_rng_drawn(epoch_rng, self._generators, caller_rng, keep_when_caller_at_start=True):
            self._resume(plan)

    def _resume(self, state: dict) -> None:
        """Under the epoch's starting RNG: sampler, dataset state, fetcher, replay."""
        position = int(state[keys.SAMPLER_ITER_YIELDED])
        index_state, iter_state = state.get(keys.INDEX_SAMPLER_STATE), state.get(keys.SAMPLER_ITER_STATE)
        saved = index_state is not None or iter_state is not None
        if (saved and (keys.is_stateful(self._index_sampler) or keys.is_stateful(self._sampler_iter))
                or self._dataset_kind == _DatasetKind.Map):
            self._sampler_iter = keys.position_sampler(self._index_sampler, self._sampler_iter, position,
                                                  index_state, iter_state)
        else:  # nothing drew from them but the base seed
            keys.set_generators((state.get(keys.MAIN_RNG) or {}).get("generators_now", []), self._generators)
        self._position = position
        self._num_yielded = int(state[keys.NUM_YIELDED])
        self._IterableDataset_len_called = state.get(keys.ITERABLEDATASET_LEN_CALLED)
        dataset_state = state.get(keys.DATASET_STATE)
        if dataset_state is not None and keys.is_stateful(self._dataset):
            self._dataset.load_state_dict(dataset_state)  # type: ignore[attr-defined]
        self._dataset_fetcher = _DatasetKind.create_fetcher(
            self._dataset_kind, self._dataset, self._auto_collation, self._collate_fn, self._drop_last)
        if self._dataset_kind == _DatasetKind.Iterable:
            fetcher = self._dataset_fetcher
            fetcher_state = state.get(keys.FETCHER_STATE) or {}
            iter_state = fetcher_state.get(keys.DATASET_ITER_STATE)
            if iter_state is not None and keys.is_stateful(fetcher.dataset_iter):
                fetcher.dataset_iter.load_state_dict(iter_state)
                fetcher.ended = bool(fetcher_state.get(keys.FETCHER_ENDED, False))
            elif dataset_state is not None and keys.is_stateful(self._dataset):
                fetcher.ended = bool(fetcher_state.get(keys.FETCHER_ENDED, False))
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
            fetcher_state = {keys.DATASET_ITER_STATE: (fetcher.dataset_iter.state_dict()
                                                  if keys.is_stateful(fetcher.dataset_iter) else None),
                             keys.FETCHER_ENDED: fetcher.ended}
            if fetcher.dataset_iter is not fetcher.dataset and keys.is_stateful(fetcher.dataset):
                dataset_state = fetcher.dataset.state_dict()
        elif keys.is_stateful(self._dataset):
            dataset_state = self._dataset.state_dict()  # type: ignore[attr-defined]
        stateful_sampler = keys.is_stateful(self._index_sampler) or keys.is_stateful(self._sampler_iter)
        return {
            keys.INDEX_SAMPLER_STATE: (self._index_sampler.state_dict()
                                  if stateful_sampler and keys.is_stateful(self._index_sampler) else None),
            keys.SAMPLER_ITER_STATE: (self._sampler_iter.state_dict()
                                 if stateful_sampler and keys.is_stateful(self._sampler_iter) else None),
            keys.SAMPLER_ITER_YIELDED: self._position,
            keys.NUM_YIELDED: self._num_yielded,
            keys.ITERABLEDATASET_LEN_CALLED: self._IterableDataset_len_called,
            keys.SHARED_SEED: self._shared_seed,
            keys.FETCHER_STATE: fetcher_state,
            keys.DATASET_STATE: dataset_state,
            keys.ITERATOR_FINISHED: self._finished,
            keys.MAIN_RNG: {"epoch_start": self._epoch_rng,
                       "generators_now": [g.get_state() for g in self._generators]},
            keys.FORMAT: keys.FORMAT_VERSION,
        }


def check_single_process_state(state: dict) -> dict:
    """A state for a num_workers=0 loader: refuse one saved with workers."""
    if keys.SNAPSHOT in state:
        saved = state[keys.SNAPSHOT].get(keys.MAIN_SNAPSHOT, {}).get(keys.NUM_WORKERS, "?")
        raise ValueError(
            f"this state was saved by a loader with num_workers={saved}; this one has num_workers=0. "
            "The state is per worker, so it loads only into a loader with the same num_workers "
            f"(torchdata's StatefulDataLoader refuses it too): pass num_workers={saved}.")
    if keys.NUM_YIELDED not in state or keys.SAMPLER_ITER_YIELDED not in state:
        raise ValueError(
            "PoolLoader.load_state_dict() expects the dict PoolLoader.state_dict() returned "
            f"(for num_workers=0: with {keys.NUM_YIELDED!r} and {keys.SAMPLER_ITER_YIELDED!r}); got keys "
            f"{sorted(state)[:8]}")
    return state
