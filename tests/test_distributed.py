"""Two gloo ranks on this CPU machine, each with its own 2-worker PoolLoader.

The ranks run tests/_dist_rank.py as subprocesses (MASTER_ADDR=127.0.0.1 and a free
port, started once more on another if that port was taken meanwhile); every wait is
bounded and a rank that has not finished in time is killed by pid. Checked:
DistributedSampler's shares are disjoint and cover the data set in each epoch (and
set_epoch reshuffles), each rank's pool has its own names, a DDP model trains with a
finite loss and identical parameters on both ranks, and a WebDataset pipeline split
with split_by_node gives the ranks disjoint shards that together hold every sample.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from proc import on_a_free_port

from fixtures.shards import read_samples, shard_urls, write_shards
from fixtures.synthetic import make_coco_like

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_SCRIPT = os.path.join(HERE, "_dist_rank.py")
WORLD = 2
DEADLINE_S = 100.0

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _run_ranks(tmp_path, urls=()):
    """Each rank's result; started once more, on a new port, if another process took
    the first one before rank 0's store bound it."""
    procs, outs, logs, timed_out = on_a_free_port(
        lambda port: _start_ranks(tmp_path, urls, port),
        lambda run: "" if all(p.returncode == 0 for p in run[0]) else "".join(run[2]))
    assert all(p.returncode == 0 for p in procs), (
        f"killed unfinished ranks (pids {timed_out}) after {DEADLINE_S} s or a peer's failure\n"
        + "\n".join(logs))
    return [json.loads(out.read_text()) for out in outs]


def _start_ranks(tmp_path, urls, port):
    """(processes, result paths, logs, pids killed unfinished) of one run of the ranks."""
    procs, outs, errs = [], [], []
    try:
        for rank in range(WORLD):
            # POSIX pools, whose names must not collide between ranks (memfd names nothing)
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                       POOLLOADER_SHM_BACKEND="posix",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE),
                                                   os.environ.get("PYTHONPATH", "")]))
            out = tmp_path / f"rank{rank}.json"
            err = open(tmp_path / f"rank{rank}.stderr", "w+")
            outs.append(out)
            errs.append(err)
            procs.append(subprocess.Popen([sys.executable, RANK_SCRIPT, str(out), *urls],
                                          env=env, stdout=err, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break  # all done, or one failed: its peer would only wait for it
            time.sleep(0.1)
    finally:
        timed_out = [p.pid for p in procs if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()  # by pid; its PoolLoader workers see the parent go and exit
                p.wait(timeout=10)
    logs = []
    for rank, err in enumerate(errs):
        err.seek(0)
        logs.append(f"--- rank {rank} (exit {procs[rank].returncode}) ---\n{err.read()[-4000:]}")
        err.close()
    return procs, outs, logs, timed_out


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    ann = make_coco_like(root, 16, seed=8, size=(96, 72))
    out = tmp_path_factory.mktemp("shards")
    index = write_shards(root, ann, out, shard_bytes=20_480)
    assert len(index["shards"]) >= 5
    return shard_urls(out)[:5]  # 3 shards for rank 0, 2 for rank 1: uneven, as in practice


def test_two_gloo_ranks_sampler_pools_ddp_and_split_by_node(tmp_path, urls):
    try:
        import webdataset  # noqa: F401
    except ImportError:
        urls = []  # the sampler / pools / DDP half still runs
    results = _run_ranks(tmp_path, urls)
    r0, r1 = results
    assert (r0["rank"], r1["rank"]) == (0, 1)

    # DistributedSampler: per epoch disjoint shares that cover the data set
    n = 40
    for epoch in range(2):
        a, b = r0["epochs"][epoch], r1["epochs"][epoch]
        assert len(a) == len(b) == n // WORLD
        assert not set(a) & set(b)
        assert sorted(a + b) == list(range(n))
    assert r0["epochs"][0] != r0["epochs"][1]  # set_epoch reshuffled through the loader

    # pools: each rank its own names (persistent workers: one pool for both epochs)
    for r in results:
        assert len(set(r["prefixes"])) == 1
    assert r0["prefixes"][0] != r1["prefixes"][0]

    # DDP: finite losses, parameters identical on both ranks, and it learned something
    for r in results:
        assert len(r["losses"]) == 2 * (n // WORLD) // 4
        assert all(v == v and abs(v) < float("inf") for v in r["losses"])
        assert r["in_sync"]
    assert r0["params"] == r1["params"]
    steps = len(r0["losses"]) // 2
    assert sum(r0["losses"][steps:]) < sum(r0["losses"][:steps])  # epoch 2 below epoch 1

    # WebDataset split_by_node: disjoint shards per rank, every sample once
    if not urls:
        pytest.skip("webdataset is not installed: split_by_node half not run")
    s0, s1 = r0["stream_ids"], r1["stream_ids"]
    assert s0 and s1 and not set(s0) & set(s1)
    expected = sorted(int(json.loads(s["json"])["image_id"])
                      for url in urls for s in read_samples(url))
    assert sorted(s0 + s1) == expected
