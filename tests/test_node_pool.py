"""PoolLoader(node_pool=True): the local ranks of a job share the node's worker processes,
and each rank's batches stay its own DataLoader's.

Each test starts 2 or 3 ranks as torchrun starts them (tests/_node_children.py, with
LOCAL_RANK, LOCAL_WORLD_SIZE and a TORCHELASTIC_RUN_ID of its own), each in its own
session, killed with whatever it started if the test overruns; tests/test_train_script.py
runs it under torchrun itself. The ranks are forks of one process of the session that has
imported torch (tests/_rank_zygote.py: a rank's start was mostly that import), except
`dist=True` ones, each the child of its own shell.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import _rank_zygote as rank_zygote
import pytest
import torch
from torch.utils.data import DataLoader

from poolloader import PoolLoader

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_node_children.py")
DEADLINE_S = 90.0
PIDS_CGROUP = "/sys/fs/cgroup/pids"  # cgroup v1's pids controller (the child caps forks there)


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE",
                      "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR",
                      "MASTER_PORT")


def _ranks(tmp_path, case: str, world: int, arg: str = "", env=None, nodes: int = 1,
           dist: bool = False) -> list:
    """Run `case` on `world` ranks (on `nodes` simulated nodes: GROUP_RANK, each with
    world / nodes local ranks); with `dist`, as a launcher of one's own starts them:
    no torchrun variable, each rank the child of its own shell (so the ranks' peer
    check must use the pids the store gave, not a common parent), and each rank
    initialises torch.distributed (gloo, a FileStore in tmp_path). [rank's JSON, or None if it wrote none].
    A host counts every local rank in its share for 60 s (POOLLOADER_NODE_ALONE_S, unless
    `env` sets it): a rank that a loaded machine delays past the default 5 s must not
    change the in-flight counts these tests check."""
    env = {"POOLLOADER_NODE_ALONE_S": "60", **(env or {})}
    run_id = f"pltest-{uuid.uuid4().hex[:12]}"
    procs, logs = [], []
    per_node = world // nodes
    try:
        for rank in range(world):
            child_env = dict(os.environ, LOCAL_RANK=str(rank % per_node),
                             LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node),
                             RANK=str(rank), WORLD_SIZE=str(world),
                             TORCHELASTIC_RUN_ID=run_id, **(env or {}),
                             PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE),
                                                         os.environ.get("PYTHONPATH", "")]))
            if dist:
                for name in TORCHRUN_VARIABLES:
                    child_env.pop(name, None)
                child_env.update(POOLLOADER_TEST_DIST=str(tmp_path / "store"),
                                 POOLLOADER_TEST_RANK=str(rank), POOLLOADER_TEST_WORLD=str(world))
            log = open(tmp_path / f"rank{rank}.log", "w+")
            logs.append(log)
            command = [sys.executable, CHILD, case, str(tmp_path), arg]
            if dist:  # each rank a child of its own shell: no common parent to vouch for it
                command = ["/bin/sh", "-c", '"$@"; exit $?', "sh", *command]
                procs.append(subprocess.Popen(command,
                                              env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            else:  # `python CHILD ...` forked from a process that imported torch (its docstring)
                procs.append(rank_zygote.start(command[1:], child_env, log.name))
        deadline = time.monotonic() + DEADLINE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank's session: it and what it started
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
    texts = []
    for rank, log in enumerate(logs):
        log.seek(0)
        texts.append(f"--- rank {rank} (exit {procs[rank].returncode}) ---\n{log.read()[-3000:]}")
        log.close()
    out = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        out.append(json.loads(path.read_text()) if path.exists() else None)
    return out, [p.returncode for p in procs], "\n".join(texts)


@pytest.mark.parametrize("world, arg, dist", [(3, "0", False), (2, "1", True), (3, "1:1", False)])
def test_each_rank_gets_its_own_dataloaders_batches_from_the_nodes_processes(tmp_path, world,
                                                                              arg, dist):
    """dist: ranks started as mp.spawn starts them, with no torchrun variable: the node
    is found through the initialised torch.distributed's store. "1:1": persistent, one
    process for 3 ranks × 2 workers: the node makes 1 × prefetch_factor (2) batches
    ahead, so each rank keeps 1 request in flight (the others owed, drawn later) in a
    pool of 3 slots, not 2 × 2 in 6."""
    results, codes, logs = _ranks(tmp_path, "parity", world, arg, dist=dist)
    assert codes == [0] * world, logs
    host = results[0]
    processes = 1 if arg == "1:1" else 2
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: batches differ from its DataLoader's\n{logs}"
        assert r["batches"] == 48 // world // 4
        assert r["node_pids"] == host["node_pids"] and r["host"] == host["host"]
        # the node's processes are local rank 0's children, num_workers of them (or
        # node_workers); the other ranks start none. Not under forkserver as the default
        # start method (POOLLOADER_TEST_START_METHOD): the workers are then the children
        # of rank 0's zygote, and each rank's forkserver (its DataLoader's) is its child
        if os.environ.get("POOLLOADER_TEST_START_METHOD") != "forkserver":
            assert r["children"] == (sorted(host["node_pids"]) if rank == 0 else []), logs
        else:
            forked = sorted(pid for kind, pid in _pairs(r["children"]) if kind == "zygote")
            assert forked == (sorted(host["node_pids"]) if rank == 0 else []), logs
        if arg != "0":  # persistent: the iterator is still there to look at
            in_flight = -(-processes * 2 // world)  # ceil(P × prefetch_factor / ranks)
            assert (r["in_flight"], r["slots"]) == (in_flight, in_flight + 2), r
        assert r["detaches"] == 0, r  # a `for` loop's batches fit the pool
    assert len(host["node_pids"]) == processes


@pytest.mark.parametrize("arg", ["", "client_first", "stale", "persistent",
                                 "persistent_break", "start_fails"])
def test_auto_moves_the_node_s_processes_between_the_host_s_epochs(tmp_path, arg):
    """node_workers="auto" under node_pool, 2 ranks × 2 workers, a budget of 2 CPUs:
    main-bound epochs take the node down to 1 process, worker-bound ones back to 2; the
    host decides, the other rank's next iterator takes the new processes, the replaced
    ones exit once no rank uses them, and every epoch stays each rank's DataLoader's.
    "client_first": in the last epoch rank 1 attaches before the host moves, and the
    replaced process serves it to the end of that epoch. "stale": rank 1 attaches after
    the move naming the generation it knew, is told of the new one and places its
    workers there. "persistent": persistent workers; each rank's iterator restarts onto
    the new processes as its next epoch begins, from its own state ("persistent_break":
    the epoch before the move up left halfway, its requests still out). "start_fails":
    the host can fork nothing as it moves up (a pids cgroup): the move is kept, with a
    warning, and both ranks go on with the process they had."""
    if arg == "start_fails" and not (os.geteuid() == 0 and os.path.isdir(PIDS_CGROUP)):
        pytest.skip(f"needs root and cgroup v1's pids controller at {PIDS_CGROUP}")
    results, codes, logs = _ranks(tmp_path, "auto", 2, arg,
                                  env={"POOLLOADER_AUTO_CPUS": "2"})
    assert codes == [0, 0], logs
    host, client = results
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: batches differ from its DataLoader's\n{logs}"
    # 2 from the start; 1 by the first worker-bound epoch (the first or the second
    # main-bound epoch moves it down); 2 again after one worker-bound epoch
    up = 1 if arg == "start_fails" else 2  # the last epoch's processes
    assert host["counts"][0] == 2 and host["counts"][2] == 1 and host["counts"][3] == up, host
    assert [len(p) for p in host["pids"]] == host["counts"]
    if arg == "start_fails":  # the move up decided, then kept: the process of before goes on
        assert "main waited 10% or more" in host["moves"][-2], host["moves"]
        # fork: the fork's own error; forkserver/spawn: the zygote, whose fork failed, exited
        assert host["moves"][-1].startswith("auto: kept 1 process") \
            and "the new processes did not start: " in host["moves"][-1], host
        assert any("did not start" in w for w in host["warnings"]), host
        assert host["pids"][3] == host["pids"][2], host
        assert client["counts"] == host["counts"] and client["pids"] == host["pids"], \
            (host, client)
    else:
        assert "main waited 10% or more" in host["moves"][-1], host["moves"]
    if arg == "client_first":  # the last epoch on the replaced process
        assert client["counts"] == host["counts"][:3] + [1], (host, client)
        assert client["pids"][:3] == host["pids"][:3] and client["pids"][3] == host["pids"][2]
    elif arg != "start_fails":
        assert client["counts"] == host["counts"] and client["pids"] == host["pids"], \
            (host, client)
        assert "chosen by local rank 0" in client["moves"][-1], client["moves"]
        assert client["moves"][-1].startswith("auto: 1 → 2 processes"), client["moves"]
    # the replaced processes exited: the host's children are the last epoch's (unless a
    # zygote forked them: the one whose fork failed exited, leaving them no one's children)
    if arg != "start_fails" or os.environ.get("POOLLOADER_TEST_START_METHOD", "fork") == "fork":
        assert sorted(host["children"]) == sorted(host["pids"][-1]), host


def _pairs(children):
    """("zygote", pid) entries of a rank's children list (_node_children.children)."""
    return [tuple(c) for c in children if isinstance(c, list)]


@pytest.mark.parametrize("arg, in_flight", [("", 2), ("1", 1), ("4:4", 4)])
def test_an_epoch_left_early_leaves_each_rank_where_its_dataloader_would(tmp_path, arg,
                                                                          in_flight):
    """Persistent workers, epochs left after 1 batch and after all but the last, then a
    whole one: DataLoader's workers fetch every request drawn before the next epoch,
    which moves their RNG states, so a rank holding requests past its share sends them
    first. "1": one process for 2 ranks × 2 workers, so each rank keeps 1 request of
    its 4 in flight. "4:4": 4 processes for 2 ranks × 4 slow workers, 4 of 8 in flight
    and 6 slots, with requests still out as an epoch is left: the held ones that go
    then must wait for those, not add to them."""
    results, codes, logs = _ranks(tmp_path, "parity_break", 2, arg)
    assert codes == [0, 0], logs
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: batches differ from its DataLoader's\n{logs}"
        assert r["lengths"] == [1, 11, 12]
        assert (r["in_flight"], r["slots"], r["detaches"]) == (in_flight, in_flight + 2, 0), r


def test_an_interrupted_next_loses_its_batch_only(tmp_path):
    """A KeyboardInterrupt as next() hands its batch from the reorder buffer to
    _process_data, with one request out a rank: at most that batch is gone, as with
    DataLoader, and the rest of the epoch still comes (the requests held past the share
    still go out)."""
    results, codes, logs = _ranks(tmp_path, "interrupt", 2)
    assert codes == [0, 0], logs
    for r in results:
        assert r["interrupted"] and r["cap"] == 1, r
        assert r["equal"], f"{r}\n{logs}"


@pytest.mark.parametrize("processes", ["", "1"])
def test_an_iterable_dataset_shards_by_worker_and_rank(tmp_path, processes):
    """"1": one node process, so each rank keeps 1 request in flight of its 4."""
    results, codes, logs = _ranks(tmp_path, "iterable", 2, processes)
    assert codes == [0, 0], logs
    assert all(r["equal"] for r in results), logs
    assert all(r["batches"] == 10 for r in results)  # 15 items a worker, 3 a batch


@pytest.mark.parametrize("processes", ["", "1"])
def test_each_rank_resumes_mid_epoch_exactly(tmp_path, processes):
    """"1": one node process, so each rank keeps 1 request in flight of its 4."""
    results, codes, logs = _ranks(tmp_path, "resume", 2, processes)
    assert codes == [0, 0], logs
    assert all(r["equal"] and r["batches"] == 6 for r in results), (results, logs)


def test_a_rank_whose_loader_differs_is_told_what_differs_and_runs_its_own(tmp_path):
    """Built at the same place, rank 1's loader differs from the host's: rank 1 is warned
    with the difference named and loads its own DataLoader batches with its own workers."""
    results, codes, logs = _ranks(tmp_path, "mismatch", 2)
    assert codes == [0, 0], logs
    host, other = results
    assert host["joined"] and host["warnings"] == [] and host["equal"], logs
    assert not other["joined"] and other["equal"] and other["children"] == 2, results
    assert len(other["warnings"]) == 1, other
    assert "batch_size: 5 here, 4 on local rank 0" in other["warnings"][0]
    assert "runs its own workers" in other["warnings"][0]


@pytest.mark.parametrize("arg", ["before", "after"])
def test_loaders_meet_by_where_they_are_built(tmp_path, arg):
    """Rank 0 builds an evaluation loader that no other rank builds, before (or after)
    the train loader every rank builds; rank 1 reaches the train loader 2 s after rank 0
    and then builds an evaluation loader of its own at another place. The train loaders
    meet (rank 1 joins rank 0's processes); each evaluation loader is an ordinary one of
    its rank, whose drop waits for nobody; every batch is its DataLoader's."""
    results, codes, logs = _ranks(tmp_path, "places", 2, arg)
    assert codes == [0, 0], logs
    zero, one = results
    assert zero["equal"] and one["equal"], logs
    assert (zero["role"], one["role"]) == ("NodeHost", "NodeClient"), results
    assert zero["host"] == one["host"]
    for r in results:
        assert r["roles"] == ["NodeHost"] and r["eval_equal"] == [True], results
        assert r["drops"][0] < 1.0, results  # nobody else came: nobody is waited for
        assert r["warnings"] == [], results


@pytest.mark.parametrize("arg", ["", "late"])
def test_a_loader_no_other_rank_joins_takes_the_node_s_whole_depth(tmp_path, arg):
    """A node-pool loader only rank 0 builds (2 ranks, 2 processes, 2 workers) keeps a
    rank's share of the node's requests, ceil(2 × 2 / 2) = 2, while another rank may
    still come (POOLLOADER_NODE_ALONE_S, 0.5 s here), then the node's whole depth, 4, as
    a loader of its own would. "late": rank 1 builds the same loader after that and
    joins; from then on rank 0's share is 2 again. Every batch is its DataLoader's."""
    alone_s = 0.5
    results, codes, logs = _ranks(tmp_path, "alone", 2, arg,
                                  env={"POOLLOADER_NODE_ALONE_S": str(alone_s)})
    assert codes == [0, 0], logs
    host = results[0]
    assert host["equal"] and host["role"] == "NodeHost", logs
    seen = host["seen"]
    built_s, built_cap = host["built"]
    if built_s < alone_s:  # the iterator was built (and its cap set) before the grace ended
        assert built_cap == 2, host
    # seconds counted from before the build: one under alone_s is within the grace
    assert all(cap == 2 and out <= 2 for t, out, cap in seen if t < alone_s), seen
    assert max(cap for _, _, cap in seen) == 4 and max(out for _, out, _ in seen) == 4, seen
    if arg == "late":
        client = results[1]
        assert client["equal"] and client["role"] == "NodeClient", logs
        assert client["built"][1] == 2 and all(cap == 2 for _, _, cap in client["seen"]), client
        joined = host["joined"]
        assert joined is not None and joined < len(seen), host
        # the join seen after observation `joined`: every next() after it sent within 2
        assert all(cap == 2 for _, _, cap in seen[joined:]), seen


def test_auto_on_a_loader_no_other_rank_joins_counts_one_rank(tmp_path):
    """node_workers="auto" on a node-pool loader only rank 0 builds (2 ranks × 2 workers,
    4 CPUs): its first epoch has min(2 × 2, 4) = 4 processes, as the node was started for
    every local rank (whenever that epoch begins); the epoch after the wait
    (POOLLOADER_NODE_ALONE_S, 0.5 s here) counts one rank, so its ceiling is num_workers,
    2, and it moves there."""
    results, codes, logs = _ranks(tmp_path, "alone", 2, "auto",
                                  env={"POOLLOADER_NODE_ALONE_S": "0.5",
                                       "POOLLOADER_AUTO_CPUS": "4"})
    assert codes == [0, 0], logs
    host = results[0]
    assert host["equal"], logs
    assert host["counts"] == [4, 2], host
    assert "over the budget (num_workers=2)" in host["moves"][-1], host["moves"]


def test_through_torch_distributed_a_rank_that_builds_no_loader_is_named(tmp_path):
    """Started as mp.spawn starts them, every rank of the world must build its node-pool
    loader (its node is found through the store): a rank that does not is named, after
    the rendezvous timeout, not a hang."""
    results, codes, logs = _ranks(tmp_path, "dist_alone", 2, dist=True,
                                  env={"POOLLOADER_NODE_TIMEOUT": "2"})
    assert codes == [0, 0], logs
    error = results[0]["error"]
    assert error is not None and "ranks [1] did not" in error, logs
    assert "POOLLOADER_NODE_TIMEOUT" in error and 2 <= results[0]["took"] < 20, results


def test_node_processes_keep_one_copy_of_an_array_every_rank_built_alike(tmp_path):
    """Each rank's start payload carries the same 1 MiB array: a node process that
    hosts a logical worker of each rank maps one rank's payload, not both, and every
    item's write into its worker's copy stays there (the batches are DataLoader's)."""
    results, codes, logs = _ranks(tmp_path, "one_copy", 2)
    assert codes == [0, 0], logs
    assert all(r["equal"] for r in results), logs
    starts = {r["start"] for r in results}
    assert len(starts) == 2 and None not in starts, results
    mapped = results[0]["mapped"]
    assert len(mapped) == 2, mapped  # each process hosts a logical worker of each rank
    for pid, inodes in mapped.items():
        assert len(inodes) == 1 and set(inodes) <= starts, (pid, inodes, starts)


def test_a_killed_rank_is_dropped_and_the_others_go_on(tmp_path):
    results, codes, logs = _ranks(tmp_path, "rank_killed", 2)
    assert codes[1] == -signal.SIGKILL and codes[0] == 0, logs
    r = results[0]
    assert r["rank1_gone"] and r["victim_inodes"] >= 2
    assert r["equal"], logs
    assert r["still_mapped"] == [], "the node's processes still map the dead rank's pool"


def test_the_hosts_death_is_an_error_on_every_other_rank(tmp_path):
    results, codes, logs = _ranks(tmp_path, "host_killed", 2)
    assert codes[0] == -signal.SIGKILL and codes[1] == 0, logs
    r = results[1]
    assert r["error"] is not None and r["error"].startswith("WorkerDied"), logs
    assert "host, local rank 0" in r["error"] and "exited" in r["error"]
    assert r["took"] < 5.0, r  # one tick (0.1 s) when the machine is quiet
    assert r["node_gone"], f"node processes {r['node_pids']} outlived their host"


def test_a_dead_node_process_is_an_error_on_every_rank_naming_it(tmp_path):
    results, codes, logs = _ranks(tmp_path, "worker_killed", 2)
    assert codes == [0, 0], logs
    for r in results:
        assert r["error"] is not None and r["error"].startswith("WorkerDied"), logs
        assert f"pid {r['victim']}" in r["error"] and "node pool process 0" in r["error"]
        assert r["took"] < 5.0, r


def test_without_torchrun_node_pool_is_an_ordinary_loader(monkeypatch):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    data = [torch.full((2,), i) for i in range(12)]
    loader = PoolLoader(data, batch_size=3, num_workers=2, node_pool=True)
    assert loader._node is None
    assert all(torch.equal(a, b) for a, b in zip(loader, DataLoader(data, batch_size=3)))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one local rank: nothing to share
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert PoolLoader(data, num_workers=2, node_pool=True)._node is None


def test_a_process_that_inherits_a_ranks_environment_is_not_that_rank(monkeypatch):
    """A worker or subprocess of a rank has torchrun's variables too: its loaders are
    ordinary ones, not another member of the node pool."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"pltest-{uuid.uuid4().hex}")
    monkeypatch.setenv("POOLLOADER_NODE_RANK_PID", str(os.getppid()))  # the rank: our parent
    monkeypatch.setenv("POOLLOADER_NODE_TIMEOUT", "1")  # were it a rank: no host, an error
    data = [torch.full((2,), i) for i in range(6)]
    loader = PoolLoader(data, batch_size=2, num_workers=1, node_pool=True)
    assert loader._node is None
    assert [b.tolist() for b in loader] == [b.tolist() for b in DataLoader(data, batch_size=2)]


def test_bad_values_are_refused(monkeypatch):
    data = list(range(4))
    with pytest.raises(ValueError, match="node_pool must be True, False or None"):
        PoolLoader(data, num_workers=1, node_pool="yes")
    monkeypatch.setenv("POOLLOADER_NODE_POOL", "maybe")
    with pytest.raises(ValueError, match="POOLLOADER_NODE_POOL='maybe'"):
        PoolLoader(data, num_workers=1)
    monkeypatch.setenv("POOLLOADER_NODE_POOL", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"pltest-{uuid.uuid4().hex}")
    # node_workers may exceed num_workers up to one process per logical worker of the node
    with pytest.raises(ValueError, match="from 1 to 4"):
        PoolLoader(data, num_workers=2, node_workers=5)
    monkeypatch.setenv("POOLLOADER_NODE_RANK_PID", str(os.getpid()))  # undone after the test
    # local rank 1, and no other rank builds a loader here: it hosts its own, and
    # dropping it waits for nobody (the leak check sees that nothing is left)
    alone = PoolLoader(data, batch_size=2, num_workers=2)
    assert type(alone._node).__name__ == "NodeHost" and alone._node.host_rank == 1
    assert [b.tolist() for b in alone] == [[0, 1], [2, 3]]
    began = time.monotonic()
    del alone
    gc.collect()
    # waiting for the other rank would take RENDEZVOUS_TIMEOUT (120 s); joining the
    # workers takes well under a second, but a loaded machine may stretch it
    assert time.monotonic() - began < 10.0


def test_the_node_segment_holds_every_process_s_error_record_and_drops_locks_at_close():
    """The segment's size covers the error record of its last process (a P=2 segment
    once ended at the first record, so process 1's death raised TypeError instead of
    WorkerDied), and close() drops the lock its side holds at once, though the mapping
    lives on (a rank whose host let go must see it within a tick, not at collection)."""
    from poolloader.shm.node import ERROR_BYTES, NodeSegment

    host = NodeSegment.create(3)
    rank = process = None
    try:
        rank = NodeSegment.attach(host.locator)
        process = NodeSegment.attach(host.locator)
        for p in range(3):
            text = f"process {p} failed\n" + "x" * (2 * ERROR_BYTES)
            process.record_error(p, text)
            assert rank.error(p) == text[-(ERROR_BYTES - 4):], p
        process.hold_process_lock(2)
        assert rank.host_alive() and rank.process_alive(2) and not rank.process_alive(1)
        process.close()
        assert not rank.process_alive(2)
        host.close()
        assert not rank.host_alive()
    finally:
        for segment in (process, rank, host):
            if segment is not None:
                segment.close()
