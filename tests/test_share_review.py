"""share_batches' follower and leader at run time (issue 44, item 8): a follower waiting
on a stuck leader is warned as any loader; a normal end is quiet, a follower that leaves
mid-epoch is not; a copy of a node_pool or share_batches loader is an ordinary loader.

Ranks run tests/_review_children.py through test_node_pool's launcher (torchrun's
variables, 2 local ranks, both in share_batches=[0, 1]).
"""
from __future__ import annotations

import copy
import pickle

import pytest
import test_node_pool
import torch
from torch.utils.data import TensorDataset

from poolloader import PoolLoader

REVIEW_CHILD = f"{test_node_pool.HERE}/_review_children.py"


def _review_ranks(tmp_path, monkeypatch, case: str, arg: str = ""):
    monkeypatch.setattr(test_node_pool, "CHILD", REVIEW_CHILD)
    return test_node_pool._ranks(tmp_path, case, 2, arg)


@pytest.mark.timeout(180)
def test_a_follower_waiting_on_a_stuck_leader_gets_one_stall_warning(tmp_path, monkeypatch):
    """stall_warning=1: the leader waits 3 s between two next()s, so the follower waits
    that long for batch 1; it gets one StallWarning (once per stall), which names the
    leader's rank and pid and the batch; the leader, whose workers kept up, gets none.
    Today the follower waits in silence."""
    results, codes, logs = _review_ranks(tmp_path, monkeypatch, "stall")
    assert codes == [0, 0], logs
    leader, follower = results
    assert leader["equal"] and follower["equal"], logs
    assert leader["stalls"] == [], leader
    [message] = follower["stalls"]
    assert "rank 0" in message and f"pid {follower['leader_pid']}" in message, message
    assert "batch 1 of epoch 1" in message and "stall_warning=1.0" in message, message


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["exit", "collected", "mid"])
def test_only_a_follower_that_leaves_mid_epoch_is_warned_about(tmp_path, monkeypatch, how):
    """"exit": the follower finishes its epoch and its process exits (its last batch
    still held, as a `for` loop leaves it); "collected": its loader and iterator are
    collected after the epoch, the process goes on. Either is a normal end: the
    leader, which ends that epoch afterwards and begins another, warns nothing (today:
    "rank 1 (pid …) … left"). "mid": its loader is closed two batches into the epoch
    the leader is still in: the leader warns, once."""
    results, codes, logs = _review_ranks(tmp_path, monkeypatch, "end", how)
    assert codes == [0, 0], logs
    left = results[0]["left"]
    if how == "mid":
        assert len(left) == 1 and "rank 1" in left[0] and "during epoch 1" in left[0], left
    else:
        assert left == [], left


@pytest.mark.timeout(180)
def test_a_copy_of_a_share_or_node_pool_loader_is_an_ordinary_loader(tmp_path, monkeypatch):
    """copy.deepcopy and pickle of a share_batches loader and of a node_pool loader (on
    the leader, local rank 0, and on the follower): an ordinary PoolLoader with the same
    arguments (share_batches, node_pool kept), no link, whose epoch is the rank's
    DataLoader's. Today: "TypeError: cannot pickle '_thread.RLock' object"."""
    results, codes, logs = _review_ranks(tmp_path, monkeypatch, "copy")
    assert codes == [0, 0], logs
    for rank, r in enumerate(results):
        for name in ("share_deepcopy", "share_pickle", "node_deepcopy", "node_pickle"):
            c = r[name]
            assert c["error"] is None, (rank, name, c)
            assert c["linked"] and not c["node"] and not c["share"], (rank, name, c)
            assert c["type"] == "PoolLoader" and c["equal"], (rank, name, c)
            assert c["node_pool"] is (True if name.startswith("node") else None)
            assert c["share_batches"] == ([0, 1] if name.startswith("share") else None)


def test_a_copy_of_an_ordinary_loader_is_unchanged():
    """Without a node or group nothing is dropped: the copy iterates the same batches."""
    loader = PoolLoader(TensorDataset(torch.arange(10)), batch_size=3, num_workers=2,
                        share_batches=[0, 1], node_pool=True)
    for twin in (copy.deepcopy(loader), pickle.loads(pickle.dumps(loader))):
        assert twin.share_batches == [0, 1] and twin.node_pool is True
        assert [b[0].tolist() for b in twin] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
