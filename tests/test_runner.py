"""`python -m poolloader SCRIPT` (poolloader.adopt.runner, poolloader.adopt.hook) and poolloader.accelerate.

Everything runs in real processes: the runner as a subprocess, with a stand-in library
written into tmp_path that binds `DataLoader` at import the way RF-DETR's
rfdetr/training/module_data.py does. The same script runs under `--loader torch` (python
unchanged) and under the runner; the batches must be identical and, under the runner,
have gone through a pool (the loaders' own stats say so). Every run has a bounded
timeout; afterwards no /dev/shm name of its processes and no process of it remains.

The accelerate tests are skipped without accelerate: one in this process (CPU, one
process), one `accelerate launch` of two gloo ranks.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import communicate_within, leftovers, pid_running
from proc import on_a_free_port

RUN_TIMEOUT_S = 120
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STANDIN_DATA = '''
"""Stands in for a library that builds its own loaders (rfdetr/training/module_data.py)."""
import torch
from torch.utils.data import DataLoader, Dataset  # bound at import, before any runner patch


class Augmented(Dataset):
    """Random values per sample: equal batches need DataLoader's seeding and order."""

    def __len__(self):
        return 22

    def __getitem__(self, i):
        return {"image": torch.rand(3, 5, 4) + i, "index": i}


def build_loader(num_workers, context=None):
    return DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=num_workers,
                      multiprocessing_context=context,
                      generator=torch.Generator().manual_seed(7))
'''

STANDIN_CLI = '''
import json, sys
if sys.argv[1:] == ["raise"]:
    raise LookupError("no such thing")
print(json.dumps({"argv": sys.argv, "name": __name__, "spec": __spec__.name,
                  "path0": sys.path[0]}))
sys.exit(5)
'''

TRAIN = '''
import hashlib, json, multiprocessing, os, signal, sys
import torch
from torch.utils.data import DataLoader
import fakedetr.data   # imported by the script, after the runner started


def describe(loader):
    torch.manual_seed(0)  # num_workers=0 draws from this process's generator
    batches = [[b["index"].tolist(), hashlib.sha256(b["image"].numpy().tobytes()).hexdigest()]
               for b in loader]
    stats = getattr(loader, "stats", None)
    return {"type": type(loader).__name__, "is_dataloader": isinstance(loader, DataLoader),
            "batches": batches, "pool_batches": None if stats is None else stats.batches,
            "pid": os.getpid()}


def child(path):  # a spawn child that builds a loader of its own
    with open(path, "w") as f:
        json.dump(describe(fakedetr.data.build_loader(2, "fork")), f)


if __name__ == "__main__":
    out = sys.argv[1]
    result = {"argv": sys.argv, "name": __name__, "file": __file__,
              "sys_main": sys.modules["__main__"].__dict__ is globals(), "path0": sys.path[0],
              "fork": describe(fakedetr.data.build_loader(2, "fork")),
              "spawn": describe(fakedetr.data.build_loader(2, "spawn")),
              "no_workers": describe(fakedetr.data.build_loader(0))}
    from poolloader.worker import zygote  # the spawn loader's workers: forks of one, pooled
    result["zygotes"] = len(zygote.pids())
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=child, args=(out + ".child",))
    p.start()
    p.join(90)
    result["child_exit"] = p.exitcode
    with open(out + ".child") as f:
        result["child"] = json.load(f)
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        os.kill(os.getpid(), signal.SIGUSR1)  # the runner's summary, on request
    with open(out, "w") as f:
        json.dump(result, f)
    sys.exit(int(sys.argv[2]))
'''


def _run(cmd, cwd, timeout=RUN_TIMEOUT_S):
    """(returncode, stdout, stderr, pid) of `cmd`, killed and failed after `timeout`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = communicate_within(proc, timeout, str(cmd))
    return proc.returncode, out, err, proc.pid


def _run_together(*cmds, cwd):
    """`_run` of every command at once (independent runs: their start-ups overlap instead
    of adding up), each under its own bounded timeout; the results in order."""
    with ThreadPoolExecutor(len(cmds)) as pool:
        return [f.result() for f in [pool.submit(_run, cmd, cwd) for cmd in cmds]]


def _runner(*args):
    return [sys.executable, "-m", "poolloader", *args]


def _assert_nothing_left(pids, marker):
    names, procs = leftovers(pids, marker)
    assert not names, f"shared-memory names left behind: {names}"
    assert not procs, f"processes still alive: {procs}"
    alive = [pid for pid in pids if pid_running(pid)]
    assert not alive, f"processes still alive: {alive}"  # spawn children lack the marker


def _without_summary(stderr):
    """stderr up to the runner's exit summary."""
    at = stderr.find("poolloader: ")
    return stderr if at < 0 else stderr[:at]


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    root = tmp_path_factory.mktemp("runner")
    (root / "fakedetr").mkdir()
    (root / "fakedetr" / "__init__.py").write_text("")
    (root / "fakedetr" / "data.py").write_text(STANDIN_DATA)
    (root / "fakedetr" / "cli.py").write_text(STANDIN_CLI)
    (root / "train.py").write_text(TRAIN)
    return root


@pytest.fixture(scope="module")
def both_arms(standin):
    """The training script under `--loader torch` and under the runner (slot_bytes from
    the flag), script arguments that look like runner flags included."""
    arms = {}
    flags = {"torch": ["--loader", "torch"], "pool": ["--slot-bytes", "65536"]}
    script = str(standin / "train.py")
    ran = _run_together(*[_runner(*flags[arm], script, str(standin / f"{arm}.json"), "7",
                                  "--loader", "x") for arm in flags], cwd=standin)
    for arm, (rc, _stdout, stderr, pid) in zip(flags, ran):
        out = standin / f"{arm}.json"
        assert out.exists(), f"{arm} run wrote nothing (rc {rc}):\n{stderr[-4000:]}"
        result = json.loads(out.read_text())
        arms[arm] = {"rc": rc, "stderr": stderr, "pid": pid, "result": result, "script": script,
                     "out": str(out)}
    return arms


def test_same_batches_as_torch_and_through_the_pool(both_arms):
    torch_arm, pool_arm = both_arms["torch"]["result"], both_arms["pool"]["result"]
    for case in ("fork", "spawn", "no_workers", "child"):
        assert pool_arm[case]["batches"] == torch_arm[case]["batches"], case
        assert len(pool_arm[case]["batches"]) == 6
        assert pool_arm[case]["is_dataloader"] and torch_arm[case]["is_dataloader"]
        assert torch_arm[case]["type"] == "DataLoader" and torch_arm[case]["pool_batches"] is None
    for case in ("fork", "spawn", "child"):  # workers: a PoolLoader; its stats count the batches
        assert pool_arm[case]["type"] == "PooledDataLoader", case
        assert pool_arm[case]["pool_batches"] == 6, case
    assert pool_arm["no_workers"]["type"] == "DataLoader"
    assert pool_arm["child_exit"] == torch_arm["child_exit"] == 0


def test_the_runner_s_spawn_workers_are_forked_by_a_zygote(both_arms):
    assert both_arms["pool"]["result"]["zygotes"] == 1  # poolloader.worker.zygote
    assert both_arms["torch"]["result"]["zygotes"] == 0


def test_script_sees_what_python_gives_it(both_arms):
    for arm in both_arms.values():
        result = arm["result"]
        assert arm["rc"] == 7
        assert result["argv"] == [arm["script"], arm["out"], "7", "--loader", "x"]
        assert result["name"] == "__main__" and result["sys_main"]
        assert result["file"] == arm["script"]
        assert result["path0"] == os.path.dirname(arm["script"])


def test_summary_at_exit_and_on_request(both_arms):
    stderr = both_arms["pool"]["stderr"]
    line = STANDIN_DATA.splitlines().index("    return DataLoader(Augmented(), batch_size=4, "
                                           "shuffle=True, num_workers=num_workers,") + 1
    assert "poolloader:" not in both_arms["torch"]["stderr"]
    main = [block for block in stderr.split("poolloader: ") if "MainProcess" in block]
    assert len(main) == 2, stderr  # SIGUSR1, then at exit
    for block in main:
        assert block.startswith("2 loaders with a slot pool")
        assert block.count(f"built at fakedetr/data.py:{line} via train.py:") == 3  # +1 not pooled
        assert block.count("6 batches; next() waited") == 2
        assert "slots of 0.1 MiB" in block  # --slot-bytes 65536 reached the loaders
        assert "DataLoader (num_workers=0)" in block
        assert block.count("     advice: ") == 2  # stats.advice() of each pooled loader
        # both pooled loaders ended their epoch before SIGUSR1: the memory line is what
        # each iterator read just before it stopped its two workers
        memory = [m for m in block.splitlines() if m.startswith("     memory (")]
        assert len(memory) == 2, block
        for m in memory:
            figures = re.fullmatch(r"     memory \(as its workers stopped\): 2 workers USS "
                                   r"([\d.]+) MiB, PSS ([\d.]+) MiB \(sums\); main USS "
                                   r"([\d.]+) MiB, PSS ([\d.]+) MiB; pool ([\d.]+) MiB "
                                   r"resident of ([\d.]+) MiB reserved", m)
            assert figures, m
            uss, pss, main_uss, main_pss, resident, reserved = map(float, figures.groups())
            assert 0 < uss <= pss and 0 < main_uss <= main_pss, m
            assert 0 <= resident <= reserved and reserved > 0, m
    child = [block for block in stderr.split("poolloader: ") if "SpawnProcess" in block]
    assert len(child) == 1 and "6 batches" in child[0], stderr


def test_nothing_left_behind(both_arms, standin):
    pids = []
    for arm in both_arms.values():
        pids += [arm["pid"], arm["result"]["child"]["pid"]]
    _assert_nothing_left(pids, str(standin))


INTROSPECT = '''
import inspect, json, sys
from torch.utils.data import DataLoader
from poolloader import PoolLoader


class Mixin:
    made = []

    def __new__(cls, *args, **kwargs):  # cooperative: DataLoader's __new__ must reach it
        Mixin.made.append(cls.__name__)
        return super().__new__(cls)


class WithMixin(DataLoader, Mixin):
    pass


class OwnInit(DataLoader):
    def __init__(self, n, flavour="plain"):
        super().__init__(list(range(n)))


built = [type(WithMixin(list(range(4)), num_workers=1)).__name__, type(OwnInit(3)).__name__]
print(json.dumps({"signatures": [str(inspect.signature(c))
                                 for c in (DataLoader, PoolLoader, WithMixin, OwnInit)],
                  "built": built, "mixin_new": Mixin.made}))
'''


def test_introspection_and_construction_under_the_runner_are_pythons(tmp_path):
    """Under the runner, inspect.signature(DataLoader) (and of PoolLoader, of subclasses)
    is what python gives (tools configure loaders from it: LightningCLI, jsonargparse),
    and DataLoader's __new__ hands on to the next __new__ in a subclass's MRO."""
    script = tmp_path / "introspect.py"
    script.write_text(INTROSPECT)
    plain, ran = _run_together([sys.executable, str(script)], _runner(str(script)), cwd=tmp_path)
    assert plain[0] == ran[0] == 0, (plain[2][-2000:], ran[2][-2000:])
    assert json.loads(ran[1]) == json.loads(plain[1])
    assert json.loads(ran[1])["mixin_new"] == ["WithMixin"]
    assert "(a DataLoader subclass, built as written)" in ran[2]  # the hook was in place


@pytest.mark.parametrize("error", ["ValueError", "KeyboardInterrupt"])
def test_uncaught_exception_keeps_its_traceback_and_exit(tmp_path, error):
    script = tmp_path / "boom.py"
    script.write_text(textwrap.dedent(f"""
        def inner():
            raise {error}("boom 42")

        def outer():
            inner()

        outer()
    """))
    plain = _run([sys.executable, str(script)], cwd=tmp_path)
    ran = _run(_runner(str(script)), cwd=tmp_path)
    assert ran[0] == plain[0] == (1 if error == "ValueError" else -signal.SIGINT)
    assert _without_summary(ran[2]) == plain[2]  # the same traceback, line for line
    assert f'{script}", line 3, in inner' in plain[2] and "runner.py" not in ran[2]
    assert "poolloader: 0 loaders" in ran[2]  # the summary still comes, after it


def test_dash_m_module_runs_as_python_dash_m(standin):
    plain, ran, failed, plain_failed = _run_together(
        [sys.executable, "-m", "fakedetr.cli", "a", "--loader"],
        _runner("--loader", "torch", "-m", "fakedetr.cli", "a", "--loader"),
        _runner("-m", "fakedetr.cli", "raise"), [sys.executable, "-m", "fakedetr.cli", "raise"],
        cwd=standin)
    assert ran[0] == plain[0] == 5
    assert json.loads(ran[1]) == json.loads(plain[1])
    assert json.loads(ran[1])["argv"] == [str(standin / "fakedetr" / "cli.py"), "a", "--loader"]
    assert failed[0] == plain_failed[0] == 1
    assert _without_summary(failed[2]) == plain_failed[2]


def test_pool_options_from_flags_and_environment(capsys):
    from poolloader.adopt import runner

    parse = runner._parser().parse_args
    assert runner.pool_options(parse(["--slots", "5", "--device", "none"]),
                               environ={"POOLLOADER_SLOTS": "9", "POOLLOADER_SLOT_BYTES": "4096"}
                               ) == {"slots": 5, "device": None, "slot_bytes": 4096}  # flag wins
    with pytest.raises(SystemExit) as exit_:
        runner.pool_options(parse(["--slot-bytes", "0"]), environ={})
    assert exit_.value.code == 2
    assert "--slot-bytes 0: slot_bytes must be a positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        runner.pool_options(parse([]), environ={"POOLLOADER_SLOT_BYTES": "lots"})
    assert "POOLLOADER_SLOT_BYTES=lots: slot_bytes must be of type int" in capsys.readouterr().err
    # seconds: a whole or fractional number, or none (no stall warning)
    assert runner.pool_options(parse(["--stall-warning", "60"]), environ={}) == {"stall_warning": 60}
    assert runner.pool_options(parse([]), environ={"POOLLOADER_STALL_WARNING": "0.5"}) == {
        "stall_warning": 0.5}
    assert runner.pool_options(parse(["--stall-warning", "none"]), environ={}) == {
        "stall_warning": None}
    with pytest.raises(SystemExit):
        runner.pool_options(parse(["--stall-warning", "-1"]), environ={})
    assert "--stall-warning -1: stall_warning must be a positive" in capsys.readouterr().err


def test_stateful_flag_and_environment_take_true_false_one_zero(capsys):
    # issue 33 item 9: `--stateful false` was refused ("must be of type bool"), as 1/0
    from poolloader.adopt import runner

    parse = runner._parser().parse_args
    for text, value in (("true", True), ("False", False), ("TRUE", True), ("1", True),
                        ("0", False), (" false ", False)):
        assert runner.pool_options(parse(["--stateful", text]), environ={}) == {"stateful": value}
        assert runner.pool_options(parse([]), environ={"POOLLOADER_STATEFUL": text}) == {
            "stateful": value}
    assert runner.pool_options(parse(["--stateful", "0"]),
                               environ={"POOLLOADER_STATEFUL": "true"}) == {"stateful": False}
    for source, text in (("flag", "yes"), ("env", "2"), ("flag", "none")):
        args, env = (["--stateful", text], {}) if source == "flag" else ([], {
            "POOLLOADER_STATEFUL": text})
        with pytest.raises(SystemExit) as exit_:
            runner.pool_options(parse(args), environ=env)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        where = f"--stateful {text}" if source == "flag" else f"POOLLOADER_STATEFUL={text}"
        assert f"{where}: stateful must be one of true, false, 1, 0 (any case), got {text!r}" in err


MANY_LOADERS = """
import gc, json, sys
import torch
from torch.utils.data import DataLoader
from poolloader.adopt import hook
from poolloader.stats import LoaderStats

n = int(sys.argv[2])
for i in range(n):
    pooled = DataLoader(range(8), batch_size=2, num_workers=1)  # a loader per evaluation
    if i in (0, 20, 21):  # one listed, two folded once later ones were built
        assert [b.tolist() for b in pooled] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    DataLoader(range(8), batch_size=2)  # num_workers=0: left as DataLoader
    del pooled
gc.collect()
kept = {"built": sum(type(o) is hook._Built for o in gc.get_objects()),
        "stats": sum(type(o) is LoaderStats for o in gc.get_objects())}
with open(sys.argv[1], "w") as f:
    json.dump(kept, f)
"""


def test_summary_stays_bounded_for_thousands_of_loaders(tmp_path):
    # issue 33 item 9: the runner kept a record (and a LoaderStats) per loader ever
    # built, and the summary listed each one
    from poolloader.adopt import hook

    script = tmp_path / "many.py"
    script.write_text(MANY_LOADERS)
    out = tmp_path / "kept.json"
    rc, _stdout, stderr, pid = _run(_runner(str(script), str(out), "3000"), cwd=tmp_path,
                                    timeout=600)
    assert rc == 0, stderr[-4000:]
    kept = json.loads(out.read_text())
    assert kept["built"] <= 4 * hook.LISTED and kept["stats"] <= 2 * hook.LISTED + 1, kept
    summary = stderr[stderr.find("poolloader: "):]
    lines = summary.splitlines()
    assert lines[0].startswith("poolloader: 3000 loaders with a slot pool"), summary[:2000]
    assert len(lines) < 20 * hook.LISTED, len(lines)
    assert f"#{hook.LISTED + 1}-#{3000 - hook.LISTED}: {3000 - 2 * hook.LISTED} more loaders " \
           "not listed" in summary, summary
    assert "together 8 batches" in summary  # the two folded loaders that were iterated
    assert f"{3000 - 2 * hook.LISTED} x PooledDataLoader (1 worker) at many.py:" in summary
    assert "#3000 PooledDataLoader, 1 worker, built at many.py:" in summary
    assert "left as DataLoader (3000):" in summary
    assert f"{3000 - 2 * hook.LISTED} x DataLoader (num_workers=0) at many.py:" in summary
    _assert_nothing_left([pid], str(tmp_path))


def test_split_argv_leaves_the_script_its_arguments():
    from poolloader.adopt.runner import split_argv

    assert split_argv(["--slots", "4", "train.py", "--slots", "2", "-m", "x"]) == (
        ["--slots", "4"], "train.py", None, ["--slots", "2", "-m", "x"])
    assert split_argv(["--loader=torch", "-m", "pkg.mod", "a"]) == (
        ["--loader=torch"], None, "pkg.mod", ["a"])
    assert split_argv(["--no-summary", "--", "-odd-name.py", "b"]) == (
        ["--no-summary"], "-odd-name.py", None, ["b"])


# -- HF Accelerate ----------------------------------------------------------------------

class Regression(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        x = torch.randn(4, generator=torch.Generator().manual_seed(100 + i))
        return torch.tensor(i), x, x[:2].sum(0, keepdim=True)


@pytest.fixture
def accelerate_state():
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    import poolloader.accelerate
    warned = poolloader.adopt.rebuilds.warned
    yield
    poolloader.adopt.rebuilds.warned = warned
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _train(loader_cls, prepare, epochs=2, **pool):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = loader_cls(Regression(), batch_size=4, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(3), **pool)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
    losses, seen = [], []
    for _ in range(epochs):
        for index, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            seen += index.tolist()
    return losses, seen, loader


def test_accelerate_prepare_keeps_the_pool(accelerate_state):
    import warnings

    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderShard
    from torch.utils.data import DataLoader

    import poolloader.accelerate
    from poolloader import PoolLoader

    expected, expected_seen, reference = _train(DataLoader, lambda acc, *o: acc.prepare(*o))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the helper keeps the pool: nothing to warn about
        losses, seen, prepared = _train(PoolLoader, poolloader.accelerate.prepare,
                                        slot_bytes=1 << 16, slots=5)
    assert losses == expected and seen == expected_seen
    assert type(prepared) is DataLoaderShard and isinstance(prepared, PoolLoader)
    base = prepared.base_dataloader
    assert type(base) is PoolLoader and base.slot_bytes == 1 << 16 and base.slots == 5
    assert base.stats.batches == len(losses) == 20  # every batch came through the pool
    assert base.stats.worker_batches == 20

    # resuming mid-epoch: the next epoch, first 3 batches skipped, still through the pool
    accelerator = Accelerator(cpu=True)
    resumed = poolloader.accelerate.skip_first_batches(accelerator, prepared, 3)
    assert type(resumed.base_dataloader) is PoolLoader
    assert resumed.base_dataloader.slot_bytes == 1 << 16
    expected_resumed = accelerator.skip_first_batches(reference, 3)
    assert type(expected_resumed.base_dataloader) is DataLoader
    assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in expected_resumed]
    assert resumed.base_dataloader.stats.batches == 7
    # without the runner nothing of DataLoader stays changed (the runner's hook is not
    # installed; the call recording is undone)
    assert "__new__" not in DataLoader.__dict__
    assert not hasattr(DataLoader.__init__, "__wrapped__")


def test_plain_accelerate_prepare_warns_once_that_the_pool_is_dropped(accelerate_state):
    from torch.utils.data import DataLoader

    import poolloader.accelerate
    from poolloader import PoolLoader

    poolloader.adopt.rebuilds.warned = False
    with pytest.warns(UserWarning, match=r"poolloader\.accelerate\.prepare\(accelerator") as caught:
        losses, _, prepared = _train(PoolLoader, lambda acc, *o: acc.prepare(*o), epochs=1)
    assert [w.filename for w in caught if "slot pool" in str(w.message)] == [__file__]
    assert type(prepared.base_dataloader) is DataLoader  # what accelerate does
    assert len(losses) == 10
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(PoolLoader, lambda acc, *o: acc.prepare(*o), epochs=1)  # once only


ACCELERATE_SCRIPT = '''
import hashlib, json, os, sys, torch
from torch.utils.data import DataLoader, TensorDataset
from accelerate import Accelerator
import poolloader.accelerate
from poolloader import PoolLoader

accelerator = Accelerator(cpu=True)
x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
dataset = TensorDataset(torch.arange(48), x, x[:, :2].sum(1, keepdim=True))


def train(loader, prepare):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = prepare(model, optimizer, loader)
    losses, seen = [], []
    for index, xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        seen += index.tolist()
    base = loader.base_dataloader
    return {"losses": losses, "seen": seen, "base": type(base).__name__,
            "pool_batches": getattr(getattr(base, "stats", None), "batches", None),
            "slot_bytes": getattr(base, "slot_bytes", None)}


def loader(cls, workers, **pool):
    return cls(dataset, batch_size=4, shuffle=True, num_workers=workers,
               generator=torch.Generator().manual_seed(1), **pool)


result = {
    "rank": accelerator.process_index, "world": accelerator.num_processes, "pid": os.getpid(),
    "backend": str(accelerator.state.backend),
    # built by the script as a plain DataLoader: the runner makes accelerate's a PoolLoader
    "runner": train(loader(DataLoader, 2), accelerator.prepare),
    # an explicit PoolLoader through the helper keeps its own options
    "helper": train(loader(PoolLoader, 2, slot_bytes=1 << 17),
                    lambda *o: poolloader.accelerate.prepare(accelerator, *o)),
    "reference": train(loader(DataLoader, 0), accelerator.prepare),  # stays a DataLoader
}
with open(f"{sys.argv[1]}.{accelerator.process_index}", "w") as f:
    json.dump(result, f)
# As every distributed script should: a Gloo group left to interpreter exit can abort the
# process ("terminate called without an active exception", pytorch/pytorch#190489).
torch.distributed.destroy_process_group()
'''


def test_accelerate_launch_two_gloo_ranks_under_the_runner(tmp_path):
    pytest.importorskip("accelerate")
    script = tmp_path / "train_accelerate.py"
    script.write_text(ACCELERATE_SCRIPT)
    out = tmp_path / "rank"
    # `--cpu` makes accelerate 1.15 start one process; --multi_gpu starts torchrun, and on a
    # machine without CUDA the two ranks train on the CPU over gloo.
    rc, _stdout, stderr, pid = on_a_free_port(lambda port: _run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
         "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", "--main_process_port", str(port),
         "-m", "poolloader", str(script), str(out)], cwd=tmp_path, timeout=180),
        lambda run: run[2] if run[0] else "")
    assert rc == 0, stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank.{r}").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert all(r["backend"] == "gloo" for r in ranks)
    for r in ranks:
        assert r["runner"]["base"] == "PooledDataLoader"
        assert r["helper"]["base"] == "PoolLoader" and r["helper"]["slot_bytes"] == 1 << 17
        assert r["reference"]["base"] == "DataLoader"
        for arm in ("runner", "helper"):  # same shard, same order, same training as DataLoader
            assert r[arm]["seen"] == r["reference"]["seen"], arm
            assert r[arm]["losses"] == r["reference"]["losses"], arm
            assert r[arm]["pool_batches"] == len(r[arm]["losses"]) == 6, arm
    assert sorted(ranks[0]["runner"]["seen"] + ranks[1]["runner"]["seen"]) == list(range(48))
    assert stderr.count("built at accelerate/data_loader.py:") >= 2  # each rank's summary
    _assert_nothing_left([pid] + [r["pid"] for r in ranks], str(tmp_path))
