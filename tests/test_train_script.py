"""examples/train_detector.py end to end: both loaders, same loss curve, loss goes down.

Each arm runs the script as a subprocess (real JPEG decoding in real workers,
a real model and optimizer), with a bounded timeout. The data set is generated
once in this test's tmp_path and shared by both runs. After the runs nothing of
theirs may remain: no /dev/shm name carrying a run's pid, no process whose
command line names this test's data folder (forked workers inherit it).

Under torchrun (`python -m torch.distributed.run --standalone`, 2 ranks on gloo) the
same holds per rank for `--loader torch`, the runner (`-m poolloader SCRIPT --loader
torch`: the script's DataLoader made a PoolLoader with the same arguments, what
`--loader pool` builds) and the runner's node pool, and the ranks split every epoch
between them.
"""
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import communicate_within, leftovers

from fixtures.synthetic import make_coco_like

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_detector.py")
RUN_TIMEOUT_S = 90
STEPS = 24  # four epochs of 6 batches: long enough for the loss to fall
ARGS = ["--steps", str(STEPS), "--images", "24", "--resolution", "128", "--workers", "2",
        "--batch-size", "4", "--seed", "3", "--no-progress"]


def _run(loader, data, out, extra=()):
    cmd = [sys.executable, SCRIPT, "--loader", loader, "--data", str(data),
           "--json", str(out), *ARGS, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    output, _ = communicate_within(proc, RUN_TIMEOUT_S, f"the {loader} run")
    assert proc.returncode == 0, f"{loader} run failed ({proc.returncode}):\n{output[-3000:]}"
    with open(out) as f:
        return proc.pid, output, json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = tmp_path_factory.mktemp("train-data") / "coco-like"
    make_coco_like(str(data), 24, seed=3)
    out = tmp_path_factory.mktemp("train-out")
    loaders = ("torch", "pool")
    # both at once: each is one training process (1 torch thread) and 2 workers, so on
    # 2 cores their start-ups and epochs overlap instead of adding up; no timing is checked
    with ThreadPoolExecutor(len(loaders)) as pool:
        done = [pool.submit(_run, loader, data, out / f"{loader}.json") for loader in loaders]
        results = {loader: future.result() for loader, future in zip(loaders, done)}
    return data, results


def test_same_loss_curve_under_both_loaders(runs):
    _data, results = runs
    torch_losses = results["torch"][2]["losses"]
    pool_losses = results["pool"][2]["losses"]
    assert len(torch_losses) == len(pool_losses) == STEPS
    assert pool_losses == torch_losses  # bit-identical batches, deterministic training


def test_loss_goes_down(runs):
    _data, results = runs
    losses = results["pool"][2]["losses"]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.8 * first, losses


def test_report_has_the_numbers(runs):
    _data, results = runs
    _pid, output, result = results["pool"]
    for text in ("img/s", "waiting for data", "final loss", "loss curve", "loader.stats"):
        assert text in output
    stats = result["loader_stats"]
    assert stats["batches"] == STEPS and stats["slot_count"] > 0
    assert 0.0 <= result["data_wait_share"] <= 1.0 and result["img_per_s"] > 0
    assert results["torch"][2]["loader_stats"] is None


def test_nothing_left_behind(runs):
    data, results = runs
    names, procs = leftovers([pid for pid, _, _ in results.values()], str(data))
    assert not names, f"shared-memory names left by the training runs: {names}"
    assert not procs, f"processes of the training runs still alive: {procs}"


# -- under torchrun: 2 ranks, gloo, DistributedDataParallel, DistributedSampler --------------

DDP_RANKS = 2
DDP_TIMEOUT_S = 180  # one 2-rank job: ~10 s on an idle 2-core machine, ~25 s loaded
DDP_TERM_GRACE_S = 15
DDP_IMAGES = 16  # 16 images / 2 ranks / batch 4: epochs of 2 steps
EPOCH_STEPS = 2
DDP_STEPS = 4 * EPOCH_STEPS  # per rank: bit-identical losses and 4 reshuffled epochs
DDP_ARMS = {  # name: (what runs under torchrun, the script's --loader)
    # no arm for `--loader pool`: it builds the PoolLoader that the runner arm's
    # DataLoader becomes (same arguments), so it would repeat the runner arm's checks
    "torch": ([SCRIPT], "torch"),
    "runner": (["-m", "poolloader", SCRIPT], "torch"),  # its DataLoader made a PoolLoader
    # and that PoolLoader a node pool: both ranks' workers are local rank 0's processes
    "node": (["-m", "poolloader", "--node-pool", SCRIPT], "torch"),
}


def _stop_torchrun(proc, marker):
    """Stop a torchrun that ran too long: SIGTERM its group (the agent then stops its
    ranks, each in a session of its own), SIGKILL it after a grace, then SIGKILL by pid
    whatever still carries this run's `marker` (ranks and their workers)."""
    for signum, grace in ((signal.SIGTERM, DDP_TERM_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            break
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            pass
    for pid in leftovers([], marker, settle_s=0)[1]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _torchrun(arm, data, out, extra=()):
    """Run one arm under `python -m torch.distributed.run --standalone` for DDP_STEPS
    steps per rank, with the script's `extra` arguments; (torchrun's pid, its output,
    each rank's --json result by rank)."""
    target, loader = DDP_ARMS[arm]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={DDP_RANKS}", *target, "--loader", loader, "--data", str(data),
           "--json", str(out / f"{arm}.json"), *ARGS, "--steps", str(DDP_STEPS), "--images", str(DDP_IMAGES),
           "--persistent-workers", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=DDP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_torchrun(proc, str(data))
        output, _ = proc.communicate(timeout=10)
        raise AssertionError(f"torchrun {arm} ran longer than {DDP_TIMEOUT_S} s:\n"
                             f"{output[-3000:]}") from None
    assert proc.returncode == 0, f"torchrun {arm} failed ({proc.returncode}):\n{output[-3000:]}"
    results = []
    for rank in range(DDP_RANKS):
        with open(out / f"{arm}.rank{rank}.json") as f:
            results.append(json.load(f))
    return proc.pid, output, results


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    data = tmp_path_factory.mktemp("ddp-data") / "coco-like"
    make_coco_like(str(data), DDP_IMAGES, seed=3)
    out = tmp_path_factory.mktemp("ddp-out")
    return data, {arm: _torchrun(arm, data, out) for arm in DDP_ARMS}


def test_torchrun_ranks_have_the_same_losses_under_every_loader(ddp_runs):
    _data, runs = ddp_runs
    for rank in range(DDP_RANKS):
        losses = {arm: results[rank]["losses"] for arm, (_, _, results) in runs.items()}
        assert len(losses["torch"]) == DDP_STEPS
        # gloo's CPU allreduce sums in a fixed order: bit-identical, as in one process
        assert losses["runner"] == losses["torch"], f"rank {rank}"
        assert losses["node"] == losses["torch"], f"rank {rank}"
    first = runs["runner"][2]
    assert [r["rank"] for r in first] == list(range(DDP_RANKS))
    assert {r["world_size"] for r in first} == {DDP_RANKS}
    assert first[0]["losses"] != first[1]["losses"]  # each rank its own batches
    for results in (first, runs["node"][2]):
        assert all(r["loader_stats"]["batches"] == DDP_STEPS for r in results)
    assert all(r["loader_stats"] is None for r in runs["torch"][2])
    node = [r["worker_pids"] for r in runs["node"][2]]
    assert len(node[0]) == 2 and node[0] == node[1], node  # the node's num_workers processes
    own = [set(r["worker_pids"]) for r in runs["runner"][2]]
    assert own[0] and not own[0] & own[1], own  # without --node-pool, each rank its own


def test_torchrun_ranks_share_each_epoch_and_reshuffle(ddp_runs):
    """DistributedSampler: in each epoch the ranks read disjoint halves of the data set,
    and set_epoch gives every epoch another order."""
    _data, runs = ddp_runs
    for arm, (_, _, results) in runs.items():
        per_rank = [r["image_ids"] for r in results]
        assert [len(ids) for ids in per_rank] == [DDP_STEPS] * DDP_RANKS
        epochs = []
        for e in range(0, DDP_STEPS, EPOCH_STEPS):
            shares = [sum(ids[e:e + EPOCH_STEPS], []) for ids in per_rank]
            assert sorted(shares[0] + shares[1]) == list(range(1, DDP_IMAGES + 1)), (arm, e, shares)
            epochs.append(shares)
        assert len({str(e) for e in epochs}) == len(epochs), (arm, epochs)  # reshuffled


def test_torchrun_reports_per_rank(ddp_runs):
    _data, runs = ddp_runs
    for arm, (_, output, _) in runs.items():
        for rank in range(DDP_RANKS):
            assert f"rank {rank}/{DDP_RANKS}: loader {DDP_ARMS[arm][1]}" in output, arm
    summary = runs["runner"][1]  # the runner's summary at exit, one per rank
    for rank in range(DDP_RANKS):
        assert f"MainProcess, rank {rank})" in summary


def test_torchrun_leaves_nothing_behind(ddp_runs):
    data, runs = ddp_runs
    pids = [pid for pid, _, _ in runs.values()]
    pids += [r["pid"] for _, _, results in runs.values() for r in results]
    names, procs = leftovers(pids, str(data))
    assert not names, f"shared-memory names left by the torchrun jobs: {names}"
    assert not procs, f"processes of the torchrun jobs still alive: {procs}"


# -- examples/ddp_eval.py: evaluation on rank 0 only, under the runner's --node-pool -------

EVAL_SCRIPT = os.path.join(ROOT, "examples", "ddp_eval.py")


def test_evaluation_on_rank_0_only_under_the_node_pool_runner(tmp_path):
    """The common DDP script: rank 0 alone builds an evaluation loader before the train
    loader and after each epoch. Under `torchrun -m poolloader --node-pool` the train
    loaders share local rank 0's processes, each evaluation loader is rank 0's own and
    drops within a second, and every rank's losses are those of the same command
    without --node-pool (plain DataLoaders)."""
    results = {}
    for arm, target in (("plain", [EVAL_SCRIPT]),
                        ("node", ["-m", "poolloader", "--node-pool", EVAL_SCRIPT])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={DDP_RANKS}", *target, "--eval-first",
               "--out", str(tmp_path / f"{arm}.json")]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=DDP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop_torchrun(proc, EVAL_SCRIPT)
            output, _ = proc.communicate(timeout=10)
            raise AssertionError(f"torchrun {arm} ran longer than {DDP_TIMEOUT_S} s:\n"
                                 f"{output[-3000:]}") from None
        assert proc.returncode == 0, f"torchrun {arm} failed:\n{output[-3000:]}"
        results[arm] = [json.loads((tmp_path / f"{arm}.rank{r}.json").read_text())
                        for r in range(DDP_RANKS)]
    plain, node = results["plain"], results["node"]
    # the first rank to reach the train loader hosts it (rank 0 may still evaluate)
    assert sorted(r["node"] for r in node) == ["NodeClient", "NodeHost"], node
    assert [r["loader"] for r in plain] == ["DataLoader"] * DDP_RANKS
    for rank in range(DDP_RANKS):
        assert node[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
    assert node[0]["evaluations"] == plain[0]["evaluations"] and len(node[0]["evaluations"]) == 3
    assert all(0 <= s < 1.0 for s in node[0]["drop_s"]), node[0]["drop_s"]
