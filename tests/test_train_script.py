"""examples/train_detector.py end to end: both loaders, same loss curve, loss goes down.

Each arm runs the script as a subprocess (real JPEG decoding in real workers,
a real model and optimizer), with a bounded timeout. The data set is generated
once in this test's tmp_path and shared by both runs. After the runs nothing of
theirs may remain: no /dev/shm name carrying a run's pid, no process whose
command line names this test's data folder (forked workers inherit it).
"""
import json
import os
import subprocess
import sys

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
    results = {loader: _run(loader, data, out / f"{loader}.json") for loader in ("torch", "pool")}
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
