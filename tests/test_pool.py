"""pool.py on its own: segments, names, generations, detach, acks, space checks —
main's SlotPool and a worker's WorkerSlots over the same real shared memory, in one
process (the protocol does not care which process maps), for both backends."""
from __future__ import annotations

import gc
import os
import weakref

import proc
import pytest

from poolloader.errors import ShmSpaceError
from poolloader.shm.backend import PAGE, page_round
from poolloader.shm.control import H_RETURNS
from poolloader.shm.pool import SlotPool, WorkerSlots


def exists(handle) -> bool:
    """A POSIX name is in /dev/shm, or a memfd descriptor is open in this process."""
    if isinstance(handle, int):
        try:
            return os.readlink(f"/proc/self/fd/{handle}").startswith("/memfd:poolloader")
        except OSError:
            return False
    return os.path.exists("/dev/shm" + handle)


@pytest.fixture(params=["memfd", "posix"])
def pool(request):
    p = SlotPool(num_workers=1, slots=2, max_slots=3, slot_bytes=100_000, backend=request.param)
    try:
        yield p
    finally:
        gc.collect()
        p.close()


def test_slots_are_page_rounded_and_findable_until_every_worker_maps_them(pool):
    assert [m.size for m in pool.mappings] == [page_round(100_000)] * 2
    assert pool.total_bytes == 2 * page_round(100_000) and page_round(1) == PAGE
    names = pool.live_names
    # POSIX: two slot names and the control name; memfd: the two slots' descriptors
    assert len(names) == (3 if pool.backend == "posix" else 2) and all(exists(n) for n in names)
    assert pool.unlink_mapped() == 2  # no worker has acknowledged anything yet
    worker = WorkerSlots(pool.locator, 0)  # maps the control block and both slots, acks them
    assert pool.unlink_mapped() == 0
    # the slot names go; the control block's stays for the pool's life (the owner lock)
    kept = {n for n in names if isinstance(n, str) and n.endswith("-ctl")}
    assert pool.live_names == kept
    assert [exists(n) for n in sorted(names)] == [n in kept for n in sorted(names)]
    # the worker's mappings are the same memory as main's
    memoryview(pool.mappings[1])[100:104] = b"abcd"
    assert bytes(memoryview(worker.mapping(1))[100:104]) == b"abcd"


def _dev_shm_used_here() -> set[str]:
    """/dev/shm files this process maps or holds open (other processes on the host make
    names of their own meanwhile: the directory listing is not this test's to judge)."""
    mapped = {path for _, _, path in proc.maps() if path.startswith("/dev/shm/")}
    return mapped | {path for path in proc.fd_targets() if path.startswith("/dev/shm/")}


def test_memfd_pool_names_nothing_in_dev_shm():
    before = _dev_shm_used_here()
    pool = SlotPool(num_workers=1, slots=2, max_slots=3, slot_bytes=100_000, backend="memfd")
    try:
        worker = WorkerSlots(pool.locator, 0)
        pool.replace(0, 300_000)
        worker.sync()
        assert _dev_shm_used_here() == before and pool.prefix is None
        assert len(proc.memfd_segments()) >= 3  # the control block and the slots, as memfds
        assert worker.owner_alive()
    finally:
        pool.close()
    assert not worker.owner_alive()  # main's descriptor, and its lock, are gone


def test_replace_gives_a_new_generation_the_worker_follows_and_drops_the_old(pool):
    worker = WorkerSlots(pool.locator, 0)
    pool.unlink_mapped()
    old = pool.mappings[0]
    worker_old = weakref.ref(worker.mapping(0))
    pool.replace(0, 300_000)
    assert pool.mappings[0] is not old and pool.size(0) == page_round(300_000)
    assert pool.target_bytes == page_round(300_000) and pool.needs_resize(1)
    assert old.closed  # nothing viewed it: unmapped at once
    memoryview(pool.mappings[0])[0:2] = b"hi"
    assert bytes(memoryview(worker.mapping(0))[0:2]) == b"hi"
    assert worker.dropped and worker_old() is None  # the worker unmapped the old segment
    pool.unlink_mapped()
    assert all(isinstance(n, str) and n.endswith("-ctl") for n in pool.live_names)


def test_a_handle_main_replaced_meanwhile_is_retried_not_mapped_wrong(pool):
    worker = WorkerSlots(pool.locator, 0)
    pool.unlink_mapped()
    row = [int(v) for v in pool.control.slot_table[1]]  # what a slow worker read
    pool.replace(1, 200_000)  # releases the old segment's name or descriptor
    assert worker.attachment.open_slot(1, *row[:2], *row[2:]) is None
    assert bytes(memoryview(worker.mapping(1))[0:1]) == b"\0"
    assert worker.mapping(1).size == pool.size(1)


def test_detach_leaves_the_mapping_to_its_holder_and_refill_restores_the_slot(pool):
    worker = WorkerSlots(pool.locator, 0)
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


def test_memfd_space_check_names_the_memory_and_the_knob():
    from poolloader.shm.backends.memfd import memory_available

    def mem_available():
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))

    # read on both sides: other processes (another xdist worker) allocate and free meanwhile
    before = mem_available()
    free, where = memory_available()
    most = max(before, mem_available())
    assert 0 < free <= most * 1.1 and where  # the tighter of the cgroup and the machine
    with pytest.raises(ShmSpaceError) as err:
        SlotPool(num_workers=1, slots=2, max_slots=2, slot_bytes=free, backend="memfd")
    msg = str(err.value)
    assert str(2 * page_round(free)) in msg or "bytes of memory" in msg
    assert "--memory" in msg and "slot_bytes" in msg and "--shm-size does not change it" in msg


def test_memfd_space_check_counts_clean_page_cache_of_either_cgroup_version(tmp_path):
    """The keys each version's memory.stat has (v2's are what this host may not show):
    inactive + active file pages, less dirty and writeback ones; shmem never counts."""
    from poolloader.shm.backends.memfd import reclaimable
    (tmp_path / "memory.stat").write_text(
        "anon 100\nfile 9000\nshmem 4000\ninactive_file 3000\nactive_file 2000\n"
        "file_dirty 400\nfile_writeback 100\n")
    assert reclaimable(str(tmp_path), "v2")[0] == 4500
    (tmp_path / "memory.stat").write_text(
        "cache 1\ninactive_file 1\nactive_file 1\ndirty 1\ntotal_cache 9000\ntotal_shmem 4000\n"
        "total_inactive_file 3000\ntotal_active_file 2000\ntotal_dirty 400\ntotal_writeback 100\n")
    free, counted = reclaimable(str(tmp_path), "v1")
    assert free == 4500 and "total_inactive_file + total_active_file (5000)" in counted
    (tmp_path / "memory.stat").write_text("total_inactive_file 10\ntotal_dirty 50\n")
    assert reclaimable(str(tmp_path), "v1")[0] == 0


@pytest.fixture
def memfd_pool():
    p = SlotPool(num_workers=1, slots=2, max_slots=3, slot_bytes=100_000, backend="memfd")
    try:
        yield p
    finally:
        gc.collect()
        p.close()


def test_return_pages_empties_a_free_slots_data_and_keeps_its_header(memfd_pool):
    """SlotPool.return_pages punches a slot's pages from an offset on (MADV_REMOVE):
    resident_bytes drops, the bytes before the offset stay, those after read as zeros,
    and a later write faults pages in again; an offset past the end is refused. (A
    POSIX pool refuses it all: the next test.)"""
    pool = memfd_pool
    mapping = pool.mappings[0]
    view = memoryview(mapping)
    view[:] = b"\x07" * mapping.size
    assert pool.resident_bytes() >= mapping.size
    before = pool.resident_bytes()
    assert pool.return_pages(0, PAGE) is True
    assert pool.resident_bytes() == before - (mapping.size - PAGE)
    view[PAGE:2 * PAGE] = b"\x01" * PAGE
    assert pool.resident_bytes() == before - (mapping.size - 2 * PAGE)
    assert bytes(view[:PAGE]) == b"\x07" * PAGE
    assert bytes(view[2 * PAGE:]) == bytes(mapping.size - 2 * PAGE)  # (a read faults a page in)
    assert pool.return_pages(0, mapping.size) is False
    view.release()


@pytest.mark.parametrize("kind", ["memfd", "posix", "registered", "private views"])
def test_pages_are_given_back_only_where_nothing_must_keep_them(kind):
    """Workers give back a slot's pages past their reply (H_RETURNS) and main an idle
    slot's (return_pages) only in a memfd pool whose slots are neither registered with
    CUDA (on_map: a pinned page would stay the device's) nor privately viewed
    (share_batches): never in a POSIX pool, whose segments are reserved whole."""
    options = {"registered": {"on_map": lambda mapping, slot: None},
               "private views": {"private_views": True}}.get(kind, {})
    backend = "posix" if kind == "posix" else "memfd"
    pool = SlotPool(num_workers=1, slots=1, max_slots=2, slot_bytes=4 * PAGE,
                    backend=backend, **options)
    try:
        memoryview(pool.mappings[0])[:] = b"x" * (4 * PAGE)
        returns = int(pool.control.header[H_RETURNS])
        returned = pool.return_pages(0, PAGE)
        assert (returns, returned) == ((1, True) if kind == "memfd" else (0, False)), kind
        if kind == "memfd":
            assert pool.mappings[0].resident_bytes() == PAGE
        else:
            assert bytes(memoryview(pool.view(0))[PAGE:2 * PAGE]) == b"x" * PAGE
    finally:
        gc.collect()
        pool.close()
