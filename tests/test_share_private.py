"""PoolLoader(share_batches=[ranks]): a batch stays each rank's own.

The ranks of a group read the same slot pages, but a write by one rank to its batch is
never seen by another, as with each rank's own DataLoader: each rank decodes from a
copy-on-write view of the slot whose copied pages are dropped when the slot is reused
(poolloader.main.share). Two ranks started as torchrun starts them
(test_node_pool._ranks), running tests/_share_private_children.py.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import test_node_pool
from test_node_pool import _ranks

from poolloader.shm._shm import Lease, Mapping

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_share_private_children.py")


@pytest.mark.parametrize("arg", ["", "pin"])
def test_a_write_by_one_rank_is_never_seen_by_another(tmp_path, monkeypatch, arg):
    """Two epochs in which, batch by batch, the follower or the leader writes every
    tensor of its batch in place while the other holds its own; a third that writes
    nothing. "pin": pin_memory=True under the CUDA stand-in, each rank's copies queued
    after the write and run then."""
    monkeypatch.setattr(test_node_pool, "CHILD", CHILD)
    results, codes, logs = _ranks(tmp_path, "write", 2, arg)
    assert codes == [0, 0], logs
    leader, follower = results
    assert (leader["role"], follower["role"]) == ("leader", "follower"), results
    for rank, r in enumerate(results):
        # (a) the other rank's writes: never seen, and every batch still this rank's
        # DataLoader's (its own earlier writes to a slot gone when the slot came back)
        assert r["checked"] == 2 * 12 // 2, r
        assert r["changed"] == [], f"rank {rank} saw the other rank's writes in {r['changed']}"
        assert r["equal"], f"rank {rank}: its batches differ from its DataLoader's\n{logs}"
        # (b) writable, and the write is there for the rank that made it
        assert len(r["writable"]) == 12 and all(r["writable"]), r
        assert len(r["memory"]) == 12, r
        for m in r["memory"]:
            assert m["perms"] == "rw-p" and m["rss"] > 0, r["memory"]  # a private mapping
            if arg == "":
                # (c) with no writes, each batch's slot pages are the segment's own (no
                # resident page of the mapping is a copy), so every rank reads the same
                # physical pages; the copies the writes made were dropped at reuse
                assert m["anonymous"] == 0, r["memory"]
            else:
                # registered with CUDA: the pages are the rank's own, pinned, and each
                # batch is copied in (docs/node.md, share_batches, "On CUDA")
                assert m["anonymous"] == m["rss"], r["memory"]
        if arg == "pin":
            # (d) the slot tensor views registered memory (no pin copy), the copies read
            # this rank's own bytes, and no copy read unregistered memory
            assert all(r["slot_views"]) and all(r["copies_ok"]), r
            assert r["violations"] == [] and r["errors"] == [] and r["still_registered"] == 0, r
        assert r["children_gone"], r
    # the same segments behind both ranks' batches
    assert [m["inode"] for m in leader["memory"]] == [m["inode"] for m in follower["memory"]]


def test_a_private_mapping_drops_its_copies_only_when_no_batch_views_it():
    """poolloader.shm._shm.Mapping(private=True), on its own: what each rank's view does."""
    size = 3 * 4096 + 512  # not a whole number of pages
    fd = os.memfd_create("pltest-share-private")
    try:
        os.ftruncate(fd, size)
        shared = Mapping(fd, size, True)
        view = Mapping(fd, size, True, True)
    finally:
        os.close(fd)
    assert view.private and not shared.private
    segment, mine = np.frombuffer(shared, np.uint8), np.frombuffer(view, np.uint8)
    segment[:] = 1
    assert (mine == 1).all()  # the segment's pages: what a worker wrote
    mine[4096 + 7] = 9  # copies that page alone
    segment[:] = 2
    assert mine[4096 + 7] == 9 and mine[4096 + 6] == 1 and (mine[:4096] == 2).all()
    assert (mine[2 * 4096:] == 2).all() and segment[4096 + 7] == 2
    lease = Lease(view, 4096, 4096)
    with pytest.raises(BufferError, match="1 batches view"):
        view.discard(4096, size - 4096)
    with pytest.raises(BufferError):
        view.pull(shared, 4096, 4096)
    del lease
    view.discard(4096, size - 4096)
    assert (mine == 2).all()  # the segment's again
    mine[:] = 5
    segment[:] = 3
    view.pull(shared, 4096, size - 4096)  # a registered view: copied in, pages kept
    assert (mine[:4096] == 5).all() and (mine[4096:] == 3).all()
    with pytest.raises(ValueError, match="shared mapping"):
        shared.discard(0, 4096)
    with pytest.raises(ValueError, match="outside a mapping"):
        view.discard(4096, size)
    del segment, mine
    view.close()
    shared.close()
