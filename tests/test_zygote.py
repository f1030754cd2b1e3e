"""Workers forked by a zygote under spawn and forkserver (poolloader.worker.zygote):
DataLoader's batches and each start method's promises, reuse across epochs, an
environment and sys.path as of iter(), a zygote that dies, nothing left behind."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import proc
import pytest
import torch
from compare import assert_same, both_loaders
from loader_datasets import ParentProcessDataset, SlowDataset
from torch.utils.data import Dataset

from poolloader import PoolLoader
from poolloader.errors import WorkerDied
from poolloader.worker import zygote
from poolloader.worker.loop import FREEZE_WRITES_HEADERS

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE_ENV = "POOLLOADER_TEST_ZYGOTE_PROBE"


def drawing_init(worker_id):
    """Draws from every RNG, as an augmentation set-up would."""
    torch.rand(3)
    np.random.rand(2)


class Probe(Dataset):
    """Item i: what the worker sees of its start: the probe variable, whether the
    module `zygote_probe_mod` imports (from a sys.path entry), its working directory,
    its parent process and its own process's class."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        try:
            import zygote_probe_mod  # noqa: F401
            found = True
        except ImportError:
            found = False
        parent = multiprocessing.parent_process()
        print(f"probe {i} on stderr", file=sys.stderr, flush=True)
        return {"env": os.environ.get(PROBE_ENV, ""), "module": found, "cwd": os.getcwd(),
                "ppid": os.getppid(), "parent": parent.pid,
                "process": type(multiprocessing.current_process()).__name__}


def _zygote_of(method):
    return zygote.get(method).pid


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_batches_match_dataloader_and_workers_are_forks_of_the_zygote(method):
    ctx = multiprocessing.get_context(method)
    parents = []

    def run(loader):
        it = iter(loader)
        if isinstance(loader, PoolLoader):
            parents.extend(proc.process_table()[pid][0] for pid in it.worker_pids)
        return list(it)

    dl, pool = both_loaders(lambda cls: cls(
        ParentProcessDataset(n=12), batch_size=3, num_workers=2, multiprocessing_context=ctx,
        worker_init_fn=drawing_init), run=run)
    assert_same(dl, pool)
    assert parents == [_zygote_of(method)] * 2
    # it forks from one thread: no OpenMP/BLAS pool, no helper thread
    assert len(os.listdir(f"/proc/{_zygote_of(method)}/task")) == 1


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_environ_sys_path_cwd_and_stderr_are_main_s_as_of_iter(method, tmp_path, monkeypatch,
                                                               capfd):
    ctx = multiprocessing.get_context(method)
    loader = PoolLoader(Probe(), batch_size=4, num_workers=2, multiprocessing_context=ctx)
    first = next(iter(loader))
    assert set(first["env"]) == {""} and not any(first["module"])
    (tmp_path / "zygote_probe_mod.py").write_text("X = 1\n")
    monkeypatch.setenv(PROBE_ENV, "set after the first epoch")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    batch = next(iter(loader))
    assert set(batch["env"]) == {"set after the first epoch"}
    assert all(batch["module"]) and set(batch["cwd"]) == {str(tmp_path)}
    assert set(batch["ppid"].tolist()) == {_zygote_of(method)}
    assert set(batch["parent"].tolist()) == {os.getpid()}
    expected = type(ctx.Process()).__name__  # SpawnProcess / ForkServerProcess
    assert set(batch["process"]) == {expected}
    # stderr: this test's (capfd's), not the one the zygote inherited when it started
    assert "probe 3 on stderr" in capfd.readouterr().err


def test_a_zygote_killed_between_epochs_is_started_again():
    ctx = multiprocessing.get_context("forkserver")
    loader = PoolLoader(Probe(), batch_size=4, num_workers=2, multiprocessing_context=ctx)
    next(iter(loader))
    old = _zygote_of("forkserver")
    os.kill(old, signal.SIGKILL)
    assert proc.wait_gone([old], 10)  # killed as a request reached it: a RuntimeError saying so
    batch = next(iter(loader))
    new = _zygote_of("forkserver")
    assert new != old and set(batch["ppid"].tolist()) == {new}


def test_a_zygote_killed_mid_epoch_is_a_clear_error_then_a_new_one_serves():
    ctx = multiprocessing.get_context("forkserver")
    loader = PoolLoader(SlowDataset(n=40, delay=0.3), batch_size=2, num_workers=2,
                        multiprocessing_context=ctx, timeout=60)
    it = iter(loader)
    next(it)
    workers, old = it.worker_pids, _zygote_of("forkserver")
    os.kill(old, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match=rf"zygote, pid {old}\) exited"):
        for _ in it:
            pass
    assert time.monotonic() - t0 < 30
    assert proc.wait_gone(workers, 10)  # killed, not left running
    del it
    assert next(iter(loader)).tolist() == [0, 1]  # the next iter() starts a new zygote


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_off_switch_and_fork_start_each_worker_as_before(method, monkeypatch):
    ctx = multiprocessing.get_context(method)
    for kwargs, env in (({"zygote": False}, None), ({}, "0")):
        if env is not None:
            monkeypatch.setenv(zygote.ENV, env)
        loader = PoolLoader(Probe(), batch_size=4, num_workers=1, multiprocessing_context=ctx,
                            **kwargs)
        batch = next(iter(loader))
        assert batch["ppid"].tolist() != [zygote.get(method).pid] * 4
    monkeypatch.delenv(zygote.ENV)
    fork = PoolLoader(Probe(), batch_size=4, num_workers=1,
                      multiprocessing_context=multiprocessing.get_context("fork"))
    assert next(iter(fork))["ppid"].tolist() == [os.getpid()] * 4


def test_bad_values_name_the_option():
    with pytest.raises(ValueError, match="zygote must be True, False or None"):
        PoolLoader(Probe(), num_workers=1, zygote="yes")
    os.environ[zygote.ENV] = "maybe"
    try:
        with pytest.raises(ValueError, match="POOLLOADER_ZYGOTE='maybe'"):
            PoolLoader(Probe(), num_workers=1,
                       multiprocessing_context=multiprocessing.get_context("spawn"))
    finally:
        del os.environ[zygote.ENV]


def test_a_class_of_main_under_spawn_and_sigkill_of_main_leaves_nothing():
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "_zygote_children.py"),
                              "spawn"], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline() if _readable(child.stdout, 90) else ""
        assert line, f"the child printed nothing (exit code {child.poll()})"
        seen = json.loads(line)
        assert seen["values"] == [[0, 2], [4, 6], [8, 10], [12, 14]]
        assert seen["modules"] == ["__mp_main__"]  # as spawn gives __main__
        assert seen["ppids"] == seen["zygotes"] and len(seen["zygotes"]) == 1
        assert all(proc.pid_running(p) for p in seen["zygotes"] + seen["workers"])
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
    assert proc.wait_gone(seen["zygotes"] + seen["workers"], 10)


def _readable(stream, timeout: float) -> bool:
    import select
    return bool(select.select([stream], [], [], timeout)[0])


def test_the_node_pool_s_processes_are_forks_of_the_host_rank_s_zygote(tmp_path):
    from test_node_pool import _pairs, _ranks

    results, codes, logs = _ranks(tmp_path, "parity", 2, "0",
                                  env={"POOLLOADER_TEST_START_METHOD": "forkserver"})
    assert codes == [0, 0], logs
    host = results[0]
    assert all(r["equal"] for r in results), logs
    assert sorted(pid for kind, pid in _pairs(host["children"]) if kind == "zygote") \
        == sorted(host["node_pids"]), logs
    assert not _pairs(results[1]["children"]), logs


def test_an_import_that_starts_a_thread_in_the_zygote_is_announced(capfd):
    from _threaded_module import Threaded

    zygote.stop_all()  # a zygote that preloads this test's dataset's module
    try:
        loader = PoolLoader(Threaded(), batch_size=2, num_workers=1,
                            multiprocessing_context=multiprocessing.get_context("forkserver"))
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
        assert "importing '_threaded_module' in the start-up process (zygote) started 1 " \
               "thread" in capfd.readouterr().err
    finally:
        zygote.stop_all()  # the next test's zygote preloads no thread


class _CopiedByACollection(Dataset):
    """Item 0: the worker's private dirty memory in KiB; item 1: the same after a full
    collection (gc.collect), which writes into every object the collector may scan."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        if i == 1:
            import gc
            gc.collect()
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Private_Dirty:"):
                    return int(line.split()[1])
        raise AssertionError("no Private_Dirty in /proc/self/smaps_rollup")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_worker_s_collection_leaves_the_zygote_s_imports_shared(method):
    """A worker freezes what it inherited from the zygote (torch's objects) first
    thing, so a full collection in it copies none of their pages: it copied about 39
    MiB a worker before."""
    if not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("needs /proc/self/smaps_rollup")
    if FREEZE_WRITES_HEADERS:
        pytest.skip("workers do not freeze on this Python (FREEZE_WRITES_HEADERS)")
    before, after = (int(b) for b in PoolLoader(_CopiedByACollection(), batch_size=1,
                                                 num_workers=1, multiprocessing_context=method,
                                                 timeout=60))
    print({"private_dirty_kib": (before, after)})
    assert after - before < 10 << 10, (before, after)
