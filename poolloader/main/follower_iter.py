"""A share_batches follower's iterator (poolloader.main.share): its own sampler's
batches, decoded from its leader's slots, no worker of its own."""
from __future__ import annotations

import weakref

from torch.utils.data.dataloader import _BaseDataLoaderIter

from poolloader.main.share_follower import ShareFollower
from poolloader.main.tracked import TrackedNext
from poolloader.resume.tracker import IteratorSetup, ResumeTracker
from poolloader.wire import codec
from poolloader.wire import slot_format as fmt


class FollowerIter(TrackedNext, _BaseDataLoaderIter):
    """A follower's iterator: its own sampler's batches, decoded from its leader's slots.

    It keeps its own resume state (poolloader.resume.tracker), fed with the records the
    leader's workers wrote into the same slots: its `state_dict()` is the leader's at the
    same step, and a loaded one positions its sampler where the leader resumes."""

    def __init__(self, loader, link: ShareFollower, resume_plan=None) -> None:
        self._link = link  # the loader's side of its group (join)
        link.acquire()  # the loader may go before this iterator
        weakref.finalize(self, link.release)
        super().__init__(loader)
        setup = IteratorSetup(self._num_workers, self._base_seed, True, self._persistent_workers,
                              self._dataset_kind, self._index_sampler, self._shared_seed,
                              self._IterableDataset_len_called)
        self._resume = ResumeTracker(setup, loader, resume_plan)
        self._base_seed = self._resume.base_seed
        self._stateful = loader.stateful
        # pinning or device= copies as an ordinary iterator's, with the link's gate
        cuda = link.cuda_side(loader, self._pin_memory, getattr(self, "_pin_memory_device", None))
        self._stager = cuda.stager
        self._small_buffer = cuda.gate.small_buffer if cuda.gate is not None else None
        if self._stager is not None:
            self._stager.reset()  # an earlier iterator's staged batch: given back
        self._reset(loader, first_iter=True)

    @property
    def resume_tracker(self) -> ResumeTracker:
        return self._resume

    def _reset(self, loader, first_iter=False) -> None:
        self._resume.begin_epoch()  # before the sampler's iterator draws anything
        super()._reset(loader, first_iter)
        if not first_iter and self._stager is not None:
            self._stager.reset()  # a staged batch's slot cools behind its copy event
        self._epoch = self._link.begin_epoch()
        self._n = 0
        # the indices drawn for batch self._n whose receive() raised (an interrupt or
        # timeout= while waiting, before its message was read): a retry waits for it again
        self._drawn: object | None = None
        resumed = self._resume.position_epoch(self._sampler_iter, first_iter)
        if resumed is not None:
            self._sampler_iter = resumed.sampler_iter
            self._num_yielded = resumed.yielded

    def _next_data(self):
        if self._stager is None:
            return self._next_host()
        return self._stager.next(self._next_host)  # pinning, or device= one batch ahead

    def _next_host(self):
        link = self._link
        link.flush()
        n = self._n
        if self._drawn is not None:
            index = self._drawn  # as DataLoader's retry waits for the same batch
        else:
            # in order, so the leader's batch n answers its request n, as here
            index = self._resume.next_index(self._sampler_iter, n)  # StopIteration: epoch over
            self._drawn = index
        view, source, key = link.receive(self._epoch, n, index, self._resume)
        self._drawn = None
        self._n += 1
        header = fmt.header_view(source)
        record = (fmt.reply_state(source, header) or None) if self._stateful else None
        self._resume.received(int(header[fmt.F_WORKER]), n, record, fmt.reply_is_error(header))
        payload, lease = codec.decode(view, header, link.leases, link.on_release, key,
                                      small_buffer=self._small_buffer)
        del lease
        if fmt.reply_is_error(header):
            payload.reraise()
        return payload

    def _shutdown_workers(self) -> None:
        """Nothing to stop: the leader's workers make this rank's batches."""
        self._link.flush()
