"""node_workers="auto": the process count is chosen again before each epoch from what
the last one measured (poolloader.main.autotune), and every batch stays
DataLoader(num_workers)'s: the logical workers fix them, whichever process hosts them.

Real worker processes over real shared memory; DataLoader runs the same body as the
reference (tests/compare.py). The dataset draws from torch, numpy and random in
worker_init_fn and per sample, so a logical worker run in another's state shows. The
load is made plain: a consumer that sleeps per batch (main-bound: fewer processes
suffice) or samples that sleep (worker-bound: main waits, one process more)."""
from __future__ import annotations

import time

import logical_datasets as lds
import pytest
import torch
from compare import assert_same, both_loaders
from torch.utils.data import DataLoader

from poolloader import PoolLoader
from poolloader.main import autotune

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]  # more workers than cores

MAIN_BOUND, WORKER_BOUND = "main", "worker"


@pytest.fixture(autouse=True)
def four_cpus(monkeypatch):
    # the budget would be this machine's 2 CPUs; 4 lets the count move both ways
    monkeypatch.setenv(autotune.CPUS_ENV, "4")


def _make(persistent=False, **extra):
    def make(cls):
        return cls(lds.PacedAugmentDataset(), batch_size=3, shuffle=True, num_workers=4,
                   worker_init_fn=lds.augment_init, persistent_workers=persistent,
                   multiprocessing_context="fork",
                   **({"node_workers": "auto", **extra} if cls is PoolLoader else {}))
    return make


def _epochs(phases):
    """Run one epoch per phase: MAIN_BOUND (the consumer sleeps 30 ms a batch, samples
    are instant) or WORKER_BOUND (samples take 10 ms, the consumer none). Returns the
    batches of each epoch and, for a PoolLoader, its process count in each."""
    def run(loader):
        epochs, counts = [], []
        for phase in phases:
            loader.dataset.sample_s = 0.01 if phase == WORKER_BOUND else 0.0
            batches = []
            for batch in loader:
                if phase == MAIN_BOUND:
                    time.sleep(0.03)
                batches.append(batch)
            epochs.append(batches)
            counts.append(getattr(loader.stats, "processes", None) if
                          isinstance(loader, PoolLoader) else None)
        return epochs, counts
    return run


def _same_epochs(ref, got):
    assert len(ref) == len(got)
    for e, (a, b) in enumerate(zip(ref, got)):
        assert len(a) == len(b) == 8, f"epoch {e}: {len(a)} batches != {len(b)}"
        assert_same(a, b, f"epoch{e}")


def test_the_count_follows_the_load_both_ways_with_every_batch_dataloaders():
    phases = [MAIN_BOUND] * 3 + [WORKER_BOUND] * 3
    (ref, _), (got, counts) = both_loaders(_make(), _epochs(phases))
    _same_epochs(ref, got)
    # main-bound epochs take processes away, worker-bound ones give them back
    assert counts[0] == 4 and min(counts[1:4]) < 4, counts
    assert counts[5] > counts[3], counts
    # every logical worker ran its own worker_init_fn on its own copy, in every epoch
    for e, batches in enumerate(got):
        seen = {(int(w), int(i)) for b in batches for w, i in zip(b["worker"], b["init_worker"])}
        assert seen == {(w, w) for w in range(4)}, (e, counts[e], seen)


def test_moves_are_recorded_with_what_they_read():
    loader = _make()(PoolLoader)
    _epochs([MAIN_BOUND, MAIN_BOUND, WORKER_BOUND, WORKER_BOUND])(loader)
    moves = loader.stats.auto_moves
    assert str(moves[0]) == ("auto: 4 processes from the first epoch "
                             "(min(num_workers, the budget: num_workers=4))")
    down = [m for m in moves[1:] if m.to < m.frm]
    up = [m for m in moves[1:] if m.to > m.frm]
    assert down and down[0].waited <= autotune.LOWER_AT, moves
    assert up and up[0].waited >= autotune.RAISE_AT, moves
    assert all(abs(m.to - m.frm) == 1 for m in moves[1:]), moves
    text = str(up[0])
    assert text.startswith(f"auto: {up[0].frm} → {up[0].to} process") and "main waited" in text
    assert loader.stats.as_dict()["auto_moves"] == [str(m) for m in moves]


def test_persistent_workers_keep_the_count_chosen_at_the_first_epoch():
    phases = [MAIN_BOUND] * 3
    (ref, _), (got, counts) = both_loaders(_make(persistent=True), _epochs(phases))
    _same_epochs(ref, got)
    assert counts == [4, 4, 4]


def test_a_state_saved_after_a_move_resumes_exactly():
    make = _make()
    torch.manual_seed(5)
    ref, _ = _epochs([MAIN_BOUND] * 3)(make(DataLoader))
    torch.manual_seed(5)
    loader = make(PoolLoader)
    _epochs([MAIN_BOUND] * 2)(loader)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    assert loader.stats.processes < 4, loader.stats.auto_moves  # it had moved
    state = loader.state_dict()
    del it
    torch.manual_seed(99)  # another global state: the loaded one must not matter
    second = PoolLoader(lds.PacedAugmentDataset(), batch_size=3, shuffle=True, num_workers=4,
                        worker_init_fn=lds.augment_init, multiprocessing_context="fork")
    second.load_state_dict(state)
    assert_same(ref[2][:3], head)
    assert_same(ref[2][3:], list(second))


def test_bad_values_name_the_value_and_the_knob(monkeypatch):
    with pytest.raises(ValueError, match=r"node_workers='fast'.*'auto' \(chosen before each epoch"):
        PoolLoader(lds.PacedAugmentDataset(), num_workers=4, node_workers="fast")
    with pytest.raises(ValueError, match="num_workers=0"):
        PoolLoader(lds.PacedAugmentDataset(), node_workers="auto")
    monkeypatch.setenv(autotune.CPUS_ENV, "two")
    with pytest.raises(ValueError, match=f"{autotune.CPUS_ENV}='two'.*positive int"):
        iter(PoolLoader(lds.PacedAugmentDataset(), num_workers=2, node_workers="auto"))


def test_the_budget_reads_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.delenv(autotune.CPUS_ENV)
    import os
    assert 1 <= autotune.cpu_budget() <= len(os.sched_getaffinity(0))
    assert autotune.memory_budget() > 0
    monkeypatch.setenv(autotune.CPUS_ENV, "1")
    loader = PoolLoader(lds.PacedAugmentDataset(), batch_size=3, num_workers=3,
                        node_workers="auto", multiprocessing_context="fork")
    assert len(list(loader)) == 8 and loader.stats.processes == 1
    assert "budget: 1 CPUs" in str(loader.stats.auto_moves[0])


def test_the_runner_takes_auto_for_every_loader_and_refuses_a_count(capsys):
    from poolloader.adopt import runner

    parse = runner._parser().parse_args
    assert runner.pool_options(parse(["--node-workers", "auto"]), environ={}) == {
        "node_workers": "auto"}
    assert runner.pool_options(parse([]), environ={"POOLLOADER_NODE_WORKERS": "AUTO"}) == {
        "node_workers": "auto"}
    for args, env, where in ((["--node-workers", "2"], {}, "--node-workers 2"),
                             ([], {"POOLLOADER_NODE_WORKERS": "2"}, "POOLLOADER_NODE_WORKERS=2")):
        with pytest.raises(SystemExit):
            runner.pool_options(parse(args), environ=env)
        err = capsys.readouterr().err
        assert f"{where}: the runner takes node_workers=auto" in err and "node_workers=P" in err
    with pytest.raises(SystemExit):
        runner.pool_options(parse(["--node-workers", "auto", "--node-pool"]), environ={})
    assert "not offered with the node pool" in capsys.readouterr().err
