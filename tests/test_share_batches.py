"""PoolLoader(share_batches=[ranks]): ranks that consume identical batches get each batch
made once, and map the same slot.

Ranks start as torchrun starts them (tests/_node_children.py through test_node_pool's
launcher): ranks 0 and 1 form the group (one data-parallel rank: the same sampler),
rank 2 is another data-parallel rank, outside it.
"""
from __future__ import annotations

import glob
import os
import signal

import pytest
import torch
from test_node_pool import _ranks

from poolloader import PoolLoader


def _calls(tmp_path, phase: str) -> dict[int, int]:
    """pid -> __getitem__ calls in `phase` (the children's calls.<phase>.<pid> files)."""
    return {int(p.rsplit(".", 1)[1]): os.path.getsize(p)
            for p in glob.glob(str(tmp_path / f"calls.{phase}.*"))}


@pytest.mark.parametrize("arg", ["1dist", "0node"])
def test_a_group_gets_its_dataloaders_batches_made_once_from_the_same_pages(tmp_path, arg):
    """Persistent workers, the ranks started as mp.spawn starts them (no torchrun
    variable; each rank's parent its own shell; the group a ProcessGroup, what
    torch.distributed.new_group gives, NON_GROUP_MEMBER on rank 2; the node found
    through the store); and non-persistent with node_pool=True, under torchrun's
    variables (the node's 2 processes, local rank 0's children, make the leader's and
    rank 2's batches)."""
    results, codes, logs = _ranks(tmp_path, "share", 3, arg, dist=arg.endswith("dist"))
    persistent, node_pool = arg.startswith("1"), "node" in arg
    assert codes == [0, 0, 0], logs
    leader, follower, other = results
    assert (leader["role"], follower["role"], other["role"]) == ("leader", "follower", None)
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: batches differ from its DataLoader's\n{logs}"
        assert r["again_equal"], f"rank {rank}: a loader collected while iterated\n{logs}"
        assert r["batches"] == 48 // 2 // 4
    # the same memfd inode behind every batch of the leader and the follower, and none
    # of the other rank's
    assert None not in leader["inodes"] and leader["inodes"] == follower["inodes"], results
    assert not set(leader["inodes"]) & set(other["inodes"])
    # the follower starts no process; the leader and rank 2 their 2 workers each (with
    # node_pool, the leader, local rank 0, hosts the node's 2 processes, for both)
    assert follower["children"] == []
    assert len(leader["children"]) == 2
    assert len(other["children"]) == (0 if node_pool else 2)
    # made once: DataLoader fetched each rank's 24 samples an epoch; the pool fetched the
    # group's once (the leader's workers) and rank 2's
    torch_calls, pool_calls = _calls(tmp_path, "torch"), _calls(tmp_path, "pool")
    assert sum(torch_calls.values()) == 3 * 24 * 2, torch_calls
    assert sum(pool_calls.values()) == 2 * 24 * 2, pool_calls
    if persistent:  # the same workers both epochs: the calls were theirs
        assert set(pool_calls) == set(leader["children"]) | set(other["children"]), pool_calls


def test_a_group_that_spans_nodes_is_made_once_per_node(tmp_path):
    """4 ranks, 2 a node (GROUP_RANK 0 and 1, as torchrun --nnodes=2 sets it), one group:
    each node's first rank leads; every rank gets its DataLoader's batches."""
    results, codes, logs = _ranks(tmp_path, "share_nodes", 4, nodes=2)
    assert codes == [0] * 4, logs
    assert [r["role"] for r in results] == ["leader", "follower"] * 2, results
    assert all(r["equal"] for r in results), logs
    # DataLoader: 4 ranks × 48 samples; the pool: 48 per node
    assert sum(_calls(tmp_path, "torch").values()) == 4 * 48
    assert sum(_calls(tmp_path, "pool").values()) == 2 * 48


def test_two_groups_with_one_leader_each_meet_their_own_followers(tmp_path):
    results, codes, logs = _ranks(tmp_path, "share_two_groups", 3)
    assert codes == [0, 0, 0], logs
    assert [r["roles"] for r in results] == [["leader", "leader"], ["follower"], ["follower"]]
    assert [r["equal"] for r in results] == [[True, True], [True], [True]], logs


def test_a_follower_whose_sampler_differs_is_told_at_the_first_batch(tmp_path):
    results, codes, logs = _ranks(tmp_path, "share_mismatch", 2)
    assert codes == [0, 0], logs
    assert results[0]["error"] is None, logs
    error = results[1]["error"]
    assert error is not None and error.startswith("ValueError"), logs
    assert "batch 0 of rank 0 holds the samples" in error and "rank 1's sampler gives" in error


@pytest.mark.parametrize("arg,follower_says,leader_says", [
    ("loader", "batch_size: 5 here, 4 on rank 0", "batch_size: 4 here, 5 on rank 1"),
    # the same indices, but a follower's own DataLoader would augment epoch 1 otherwise
    ("persistent", "persistent_workers: True here, False on rank 0",
     "persistent_workers: False here, True on rank 1")])
def test_a_follower_whose_loader_differs_is_refused_at_construction(
        tmp_path, arg, follower_says, leader_says):
    results, codes, logs = _ranks(tmp_path, "share_mismatch", 2, arg)
    assert codes == [0, 0], logs
    follower, leader = results[1]["error"], results[0]["error"]
    assert follower is not None and follower.startswith("constructor: "), logs
    assert follower_says in follower, follower
    # the leader's first batch says so at once, not after the rendezvous timeout, in
    # its own words ("here": its value)
    assert leader is not None and "refused a rank of its group" in leader, logs
    assert leader_says in leader, leader


def test_a_loader_only_some_ranks_build_loads_alone_after_a_bounded_wait(tmp_path):
    """An evaluation loader on rank 0 alone (the leader) waits POOLLOADER_SHARE_WAIT for
    rank 1 once, then leads nobody; a loader on rank 1 alone (a follower) waits as long
    for its leader once, warns and loads on its own; built again at the same place,
    neither waits (nor warns). A rank whose leader took its first batch before it built
    the loader is told so and loads on its own. Every rank's batches are its
    DataLoader's; none waits the rendezvous timeout (120 s), none fails."""
    wait = 2.0
    results, codes, logs = _ranks(tmp_path, "share_partial", 2,
                                  env={"POOLLOADER_SHARE_WAIT": str(wait)})
    assert codes == [0, 0], logs
    lead, follow = results[0]["alone0"], results[1]["alone1"]
    assert [r["role"] for r in lead] == ["leader", "leader"], lead
    assert all(r["equal"] for r in lead + follow), logs
    # the leader's first batch waited for rank 1 from its iter(); the next loader built
    # there did not wait for it
    assert lead[0]["awaited"] == [1] and lead[0]["took"] >= wait, lead
    assert lead[1]["awaited"] == [], lead
    assert lead[0]["warnings"] == lead[1]["warnings"] == [], lead
    assert [r["role"] for r in follow] == [None, None], follow
    assert follow[0]["built"] >= wait and follow[1]["built"] < wait, follow
    assert len(follow[0]["warnings"]) == 1 and follow[1]["warnings"] == [], follow
    assert "found no loader of its leader, rank 0" in follow[0]["warnings"][0], follow
    late_leader, late_follower = results[0]["late"], results[1]["late"]
    assert late_leader["role"] == "leader" and late_follower["role"] is None, results
    assert late_leader["equal"] and late_follower["equal"], logs
    assert late_leader["warnings"] == [], late_leader
    assert len(late_follower["warnings"]) == 1, late_follower
    assert "after its leader, rank 0" in late_follower["warnings"][0], late_follower


def test_an_iterator_dropped_after_the_next_one_began_ends_nothing(tmp_path):
    results, codes, logs = _ranks(tmp_path, "share_restart", 2)
    assert codes == [0, 0], logs
    assert all(r["equal"] and r["batches"] == 6 for r in results), (results, logs)


def test_a_follower_interrupted_while_it_waits_gets_the_same_batch_on_the_next_call(tmp_path):
    results, codes, logs = _ranks(tmp_path, "share_interrupt", 2)
    assert codes == [0, 0], logs
    assert results[1]["interrupted"], logs
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: its batches differ from its DataLoader's\n{logs}"


@pytest.mark.parametrize("arg", ["0", "2"])
def test_each_rank_resumes_from_its_own_state_dict(tmp_path, arg):
    """Two batches into epoch 0, every rank saves state_dict() and a new loader loads
    it: the rest of epoch 0 and epoch 1 equal DataLoader's uninterrupted run; the
    follower's state (tracked from the records in the leader's slots) is the leader's.
    "0": persistent off; "2": persistent, epoch 0 left after two batches (the workers'
    undelivered batches move their state: the leader tells the follower), epoch 1 begun
    once and left before its first batch, then begun again and the states saved two
    batches in; with device= (a batch staged ahead) and a dataset state_dict() (replay
    lists between snapshots). Each of the three fixes that keep the states equal fails
    this without it."""
    results, codes, logs = _ranks(tmp_path, "share_resume", 2, arg)
    assert codes == [0, 0], logs
    assert [r["role"] for r in results] == ["leader", "follower"]
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: the resumed batches differ from DataLoader's\n{logs}"
        assert r["same_state"], f"rank {rank}: its state differs from the other's"
        assert r["batches"] == ([2, 6] if arg == "2" else [6, 6])


def test_a_killed_follower_is_dropped_and_the_leader_goes_on(tmp_path):
    results, codes, logs = _ranks(tmp_path, "share_follower_killed", 3)
    assert codes[1] == -signal.SIGKILL and codes[0] == 0 and codes[2] == 0, logs
    r = results[0]
    assert r["rank1_gone"] and r["equal"], (r, logs)
    assert any("rank 1" in w and "left" in w for w in r["warnings"]), r["warnings"]
    # (a detach or two may come first: until its death shows, the follower's unread
    # batches count as held, and the leader gives them fresh segments rather than wait)


def test_the_leaders_death_is_an_error_on_its_followers(tmp_path):
    results, codes, logs = _ranks(tmp_path, "share_leader_killed", 2)
    assert codes[0] == -signal.SIGKILL and codes[1] == 0, logs
    r = results[1]
    assert r["error"] is not None and r["error"].startswith("WorkerDied"), logs
    assert "rank 0" in r["error"] and "exited" in r["error"]
    assert r["took"] < 5.0, r


def test_share_batches_is_checked(monkeypatch):
    data = [torch.full((2,), i) for i in range(8)]
    with pytest.raises(ValueError, match="share_batches must be a list of distinct"):
        PoolLoader(data, num_workers=1, share_batches=[0, 0])
    with pytest.raises(ValueError, match="share_batches must be a list of distinct"):
        PoolLoader(data, num_workers=1, share_batches="01")
    # without torchrun, or a rank not in the group: an ordinary loader
    assert PoolLoader(data, num_workers=1, share_batches=[0, 1])._share is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "pltest-share-check")
    monkeypatch.setenv("POOLLOADER_NODE_RANK_PID", str(os.getpid()))
    assert PoolLoader(data, num_workers=1, share_batches=[1, 2])._share is None
    assert PoolLoader(data, num_workers=1, share_batches=[0, 2])._share is None  # 2: another node
    with pytest.raises(ValueError, match="in_order=False"):
        PoolLoader(data, num_workers=1, in_order=False, share_batches=[0, 1])
    with pytest.raises(ValueError, match="num_workers=0"):
        PoolLoader(data, share_batches=[0, 1])


@pytest.mark.parametrize("arg", ["pin", "device"])
def test_on_cuda_a_slot_waits_for_every_ranks_copies(tmp_path, arg):
    """The CUDA stand-in on both ranks (pin_memory=True, or device="cuda"): copies read
    the slot when they run, so a slot the leader rewrote before a follower's queued copy
    ran would show up as wrong data."""
    results, codes, logs = _ranks(tmp_path, "share_cuda", 2, arg)
    assert codes == [0, 0], logs
    leader, follower = results
    assert (leader["role"], follower["role"]) == ("leader", "follower")
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: its copies differ from its DataLoader's batches\n{logs}"
        assert r["batches"] == 240 // 2 // 4
        if arg == "pin":
            assert r["slot_views"], f"rank {rank}: a batch did not view a registered slot"
        # every registration undone at teardown, no copy read unregistered memory, no
        # CUDA error, no process left
        assert r["registered"][-1] > 0 and r["unregistered"] == r["registered"][-1], r
        assert r["still_registered"] == 0 and r["violations"] == [] and r["errors"] == [], r
        assert r["children_gone"], r
    # the follower registers each mapping it gets once (a descriptor each), not per batch:
    # epoch 0, its copies done at once, reuses the leader's slots for its 30 batches (how
    # many depends on how far the leader ran ahead: it never waits for the follower)
    assert follower["registrations"] == follower["mapped"] == follower["registered"][-1]
    assert 0 < follower["registered"][0] < 30, follower
    # in epoch 1 its releases waited behind its queued copies (nothing ran until the
    # end), so the leader made its batches in other slots (grown, or new segments)
    assert follower["most_held_back"] >= 20, follower
    assert leader["detaches"] + leader["growths"] > 0, leader
