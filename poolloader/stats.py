"""Counters a user reads to tell whether the loader is the bottleneck, and which side.

Main-side counters are plain attributes updated on the iterator's own path
(an add per batch, nothing measurable).
"""
from __future__ import annotations


class LoaderStats:
    """Live counters of one PoolLoader (across its iterators and epochs).

    batches       batches delivered to the consumer
    main_wait_s   seconds next() spent blocked waiting for a worker
    slot_growths  slots replaced by a bigger segment (a batch did not fit)
    pool_growths  slots added because the consumer held every slot
    slot_count, slot_bytes, pool_bytes: the pool now (0 before the first iteration)
    """

    def __init__(self) -> None:
        self.batches = 0
        self.main_wait_s = 0.0
        self.slot_growths = 0
        self.pool_growths = 0
        self._pool = None

    def _attach(self, pool) -> None:
        self._pool = pool

    @property
    def slot_count(self) -> int:
        return self._pool.num_slots if self._pool is not None and self._pool.mappings else 0

    @property
    def slot_bytes(self) -> int:
        if self._pool is None or not self._pool.mappings:
            return 0
        return max(m.size for m in self._pool.mappings)

    @property
    def pool_bytes(self) -> int:
        return self._pool.total_bytes if self._pool is not None and self._pool.mappings else 0

    def as_dict(self) -> dict:
        return {
            "batches": self.batches, "main_wait_s": round(self.main_wait_s, 6),
            "slot_growths": self.slot_growths, "pool_growths": self.pool_growths,
            "slot_count": self.slot_count, "slot_bytes": self.slot_bytes,
            "pool_bytes": self.pool_bytes,
        }

    def __repr__(self) -> str:
        return "LoaderStats(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"
