"""PoolLoader: torch.utils.data.DataLoader with batches moved through a slot pool."""
from __future__ import annotations

from typing import Callable, TypeVar

from torch.utils.data import DataLoader

from poolloader.stats import LoaderStats

T_co = TypeVar("T_co", covariant=True)

DEFAULT_SLOT_BYTES = 1 << 20

# Called with every PoolLoader once it is initialised. The runner (`python -m poolloader`)
# adds one to list the loaders in its exit summary; empty otherwise.
new_loader_observers: list[Callable[[PoolLoader], None]] = []


class PoolLoader(DataLoader[T_co]):
    """A drop-in `DataLoader`. With `num_workers=0` it *is* DataLoader.

    With workers, each batch is written by a worker into a preallocated,
    reused shared-memory slot and the main process receives only the slot's
    index; the tensors you get are views over the slot, and the slot is reused
    once every view of the batch is gone.

    Pool options (keyword-only, beyond DataLoader's):
      slot_bytes  initial size of each slot (default 1 MiB); a batch that does
                  not fit grows its slot (×1.25 headroom) and the rest follow.
      slots       slots in the pool (default num_workers × prefetch_factor + 2).
      max_slots   optional cap on the slots in the pool (default: slots, grown
                  to num_workers × prefetch_factor + 2 if smaller, plus as many
                  again on CUDA for slots cooling behind copies). At the cap a
                  request waits (bounded) for a cooling slot, or detaches the
                  oldest batch the consumer holds: it never fails.
      shm_limit   cap in bytes on the pool's shared memory (also the
                  POOLLOADER_SHM_LIMIT environment variable); None: /dev/shm's
                  free space is the only limit.
      device      e.g. "cuda": the loader copies each batch to this device itself,
                  on a side stream one batch ahead, from the page-locked slots,
                  and yields device tensors safe to use on the current stream.
    Nothing is created until the loader is iterated. `stats` holds counters.
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, slot_bytes=DEFAULT_SLOT_BYTES, slots=None, max_slots=None,
                 shm_limit=None, device=None):
        super().__init__(
            dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, pin_memory_device=pin_memory_device,
            in_order=in_order)
        if slot_bytes is None or slot_bytes < 1:
            raise ValueError(f"slot_bytes must be a positive number of bytes, got {slot_bytes!r}")
        if slots is not None and (not isinstance(slots, int) or slots < 1):
            raise ValueError(f"slots must be a positive number of slots, got {slots!r}")
        if shm_limit is not None and (not isinstance(shm_limit, int) or shm_limit < 1):
            raise ValueError(f"shm_limit must be a positive number of bytes, got {shm_limit!r}")
        in_flight = self.num_workers * (self.prefetch_factor or 0)
        if max_slots is not None and (not isinstance(max_slots, int)
                                      or max_slots < max(1, in_flight)):
            raise ValueError(
                f"max_slots={max_slots!r} is below the {self.num_workers} × "
                f"{self.prefetch_factor} requests DataLoader keeps in flight (num_workers × "
                "prefetch_factor); raise it, or leave it None")
        self.shuffle = shuffle
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.max_slots = max_slots
        self.shm_limit = shm_limit
        self.device = device
        self.stats = LoaderStats()
        for observe in new_loader_observers:
            observe(self)

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        from poolloader.iterator import PoolLoaderIter
        self.check_worker_number_rationality()
        return PoolLoaderIter(self)

    # HF Accelerate reads this attribute of every loader given to Accelerator.prepare()
    # and then rebuilds the loader as a plain DataLoader: say (once) that the pool is lost
    # and how to keep it. poolloader.accelerate.prepare() keeps it and stays quiet.
    @property
    def _is_accelerate_prepared(self) -> bool:
        from poolloader.accelerate import note_plain_prepare
        note_plain_prepare(self)
        return self.__dict__.get("_accelerate_prepared", False)

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        self.__dict__["_accelerate_prepared"] = value
