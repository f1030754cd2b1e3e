"""share_batches with a batch sampler whose batches are index tensors or numpy arrays
(issue 44 item 6): a follower compares the leader's indices with its own by value.

Two ranks started as torchrun starts them (test_node_pool's `_ranks`, running
tests/_share_indices_child.py), ranks 0 and 1 one share group with the same batch
sampler; it yields each batch as an int64 tensor, or a numpy array.
"""
from __future__ import annotations

import os

import pytest
import test_node_pool
from test_node_pool import _ranks

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_share_indices_child.py")


@pytest.fixture
def share_indices_child(monkeypatch):
    monkeypatch.setattr(test_node_pool, "CHILD", CHILD)


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_a_group_shares_batches_whose_indices_are_tensors_or_arrays(
        tmp_path, kind, share_indices_child):
    results, codes, logs = _ranks(tmp_path, "indices", 2, kind)
    assert codes == [0, 0], logs
    leader, follower = results
    assert (leader["role"], follower["role"]) == ("leader", "follower"), results
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: batches differ from its DataLoader's\n{logs}"
        assert r["batches"] == 12
    # shared: the same memfd pages behind every batch of both ranks
    assert None not in leader["inodes"] and leader["inodes"] == follower["inodes"], results


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_a_follower_whose_tensor_or_array_indices_differ_gets_the_clear_error(
        tmp_path, kind, share_indices_child):
    results, codes, logs = _ranks(tmp_path, "indices_mismatch", 2, kind)
    assert codes == [0, 0], logs
    assert results[0]["error"] is None, logs
    error = results[1]["error"]
    assert error is not None and error.startswith("ValueError"), logs
    assert "batch 0 of rank 0 holds the samples" in error and "rank 1's sampler gives" in error
