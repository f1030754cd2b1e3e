"""pool.py on its own: segments, names, generations, detach, acks, space checks —
main's SlotPool and a worker's WorkerSlots over the same real shared memory, in one
process (the protocol does not care which process maps)."""
from __future__ import annotations

import gc
import os

import pytest

from poolloader.errors import ShmSpaceError
from poolloader.pool import SlotPool, WorkerSlots
from poolloader.segments import PAGE, page_round


def exists(name: str) -> bool:
    return os.path.exists("/dev/shm" + name)


@pytest.fixture
def pool():
    p = SlotPool(num_workers=1, slots=2, max_slots=3, slot_bytes=100_000)
    try:
        yield p
    finally:
        gc.collect()
        p.close()


def test_slots_are_page_rounded_and_named_until_every_worker_maps_them(pool):
    assert [m.size for m in pool.mappings] == [page_round(100_000)] * 2
    assert pool.total_bytes == 2 * page_round(100_000) and page_round(1) == PAGE
    names = pool.live_names
    assert len(names) == 3 and all(exists(n) for n in names)
    assert pool.unlink_mapped() == 2  # no worker has acknowledged anything yet
    worker = WorkerSlots(pool.prefix, 0)  # maps the control block and both slots, acks them
    assert pool.unlink_mapped() == 0
    # the slot names go; the control block's stays for the pool's life (the owner lock)
    assert pool.live_names == {n for n in names if n.endswith("-ctl")}
    assert [exists(n) for n in sorted(names)] == [n.endswith("-ctl") for n in sorted(names)]
    # the worker's mappings are the same memory as main's
    memoryview(pool.mappings[1])[100:104] = b"abcd"
    assert bytes(memoryview(worker.mapping(1))[100:104]) == b"abcd"


def test_replace_gives_a_new_generation_the_worker_follows(pool):
    worker = WorkerSlots(pool.prefix, 0)
    pool.unlink_mapped()
    old = pool.mappings[0]
    pool.replace(0, 300_000)
    assert pool.mappings[0] is not old and pool.size(0) == page_round(300_000)
    assert pool.target_bytes == page_round(300_000) and pool.needs_resize(1)
    assert old.closed  # nothing viewed it: unmapped at once
    memoryview(pool.mappings[0])[0:2] = b"hi"
    assert bytes(memoryview(worker.mapping(0))[0:2]) == b"hi"
    pool.unlink_mapped()
    assert all(n.endswith("-ctl") for n in pool.live_names)


def test_detach_leaves_the_mapping_to_its_holder_and_refill_restores_the_slot(pool):
    worker = WorkerSlots(pool.prefix, 0)
    pool.unlink_mapped()
    memoryview(pool.mappings[1])[0:3] = b"old"
    held = pool.detach(1)
    assert pool.mappings[1] is None and pool.size(1) == 0 and pool.needs_resize(1)
    assert bytes(memoryview(held)[0:3]) == b"old" and not held.closed
    worker.sync()  # an empty slot: the worker forgets it and maps nothing
    assert 1 not in worker.mappings
    pool.refill(1)
    memoryview(pool.mappings[1])[0:3] = b"new"
    assert bytes(memoryview(worker.mapping(1))[0:3]) == b"new"
    assert bytes(memoryview(held)[0:3]) == b"old"  # the detached segment is untouched
    pool.unmap(held)
    assert held.closed


def test_add_slot_up_to_capacity(pool):
    assert pool.add_slot() == 2 and pool.num_slots == 3
    with pytest.raises(ValueError, match="beyond max_slots"):
        pool.add_slot()


def test_space_cap_is_a_clear_error_before_anything_is_written(pool):
    capped = SlotPool(num_workers=1, slots=1, max_slots=2, slot_bytes=1 << 20, shm_limit=3 << 20)
    try:
        names = capped.live_names
        with pytest.raises(ShmSpaceError, match=r"shm_limit=") as err:
            capped.replace(0, 4 << 20)
        assert "Raise the cap" in str(err.value)
    finally:
        capped.close()
    assert not any(exists(n) for n in names)


def test_close_unlinks_every_name_and_keeps_viewed_memory_mapped(pool):
    names = pool.live_names
    view = memoryview(pool.mappings[0])
    mapping = pool.mappings[0]
    pool.close()
    assert not any(exists(n) for n in names)
    assert not mapping.closed  # a view is alive: unmapped when it dies
    view[0:1] = b"x"
    view.release()
