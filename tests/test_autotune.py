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
from types import SimpleNamespace

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
    """Run one epoch per phase: MAIN_BOUND (the consumer sleeps 50 ms a batch, samples
    are instant) or WORKER_BOUND (samples take 10 ms, the consumer none). Returns the
    batches of each epoch and, for a PoolLoader, its process count in each."""
    def run(loader):
        epochs, counts = [], []
        paced = isinstance(loader, PoolLoader)  # DataLoader's reference: the same batches, sooner
        for phase in phases:
            loader.dataset.sample_s = 0.01 if paced and phase == WORKER_BOUND else 0.0
            batches = []
            for batch in loader:
                if paced and phase == MAIN_BOUND:
                    time.sleep(0.05)
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


def test_persistent_workers_keep_their_count_until_a_window_of_steady_time_has_passed():
    # three epochs of 0.35 s steady time each: under one review window (2 s); the
    # within-epoch moves of persistent workers are tested below
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
    with pytest.raises(ValueError, match=r"node_workers='fast'.*'auto' \(chosen as it runs"):
        PoolLoader(lds.PacedAugmentDataset(), num_workers=4, node_workers="fast")
    # no worker process to count: "auto" is None there, as a runner's option may reach a
    # loader a framework rebuilds with num_workers=0
    assert len(list(PoolLoader(list(range(24)), batch_size=3, node_workers="auto"))) == 8
    # set after the loader was built, as DataLoader lets attributes be set
    loader = PoolLoader(list(range(24)), batch_size=3, num_workers=2,
                        multiprocessing_context="fork")
    loader.node_workers = "auto"
    assert len(list(loader)) == 8 and loader.stats.auto_moves, loader.stats
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
    assert runner.pool_options(parse(["--node-workers", "auto", "--node-pool"]), environ={}) \
        == {"node_workers": "auto", "node_pool": True}


def _counters(**gained):
    """LoaderStats' counters as autotune reads them (plain numbers), after an epoch that
    gained `gained` over the zero mark."""
    stats = SimpleNamespace(iter_s=0.0, steady_wait_s=0.0, worker_busy_s=0.0,
                            steady_batches=0, batches=0, startup_s=0.0, auto_moves=[])
    return stats, lambda: [setattr(stats, k, getattr(stats, k) + v) for k, v in gained.items()]


def test_the_rule_moves_one_step_records_each_choice_and_reads_nothing_into_short_epochs():
    auto = autotune.AutoWorkers(4)
    stats, main_bound = _counters(iter_s=1.0, steady_wait_s=0.01, worker_busy_s=0.2,
                                  steady_batches=20, batches=21)
    assert auto.processes(stats) == 4
    counts = []
    for _ in range(5):
        main_bound()
        counts.append(auto.processes(stats))
    assert counts == [3, 2, 1, 1, 1]  # 0.2 s of work: one process is at most 20% busy
    # workers busy 1.9 processes' worth: 2 processes would be over 75% busy, so 3 stay
    auto = autotune.AutoWorkers(4)
    stats, busy = _counters(iter_s=1.0, steady_wait_s=0.0, worker_busy_s=1.9,
                            steady_batches=20)
    auto.processes(stats)
    for _ in range(3):
        busy()
        auto.processes(stats)
    assert auto.current == 3, stats.auto_moves
    # waits of 3%: between the thresholds, nothing moves (no oscillation)
    stats, between = _counters(iter_s=1.0, steady_wait_s=0.03, worker_busy_s=0.1,
                               steady_batches=20)
    auto = autotune.AutoWorkers(4)
    auto.processes(stats)
    for _ in range(3):
        between()
        auto.processes(stats)
    assert auto.current == 4 and len(stats.auto_moves) == 1
    # an epoch of 3 steady batches, or counters that went back (an iterator closed
    # late), say nothing
    stats, short = _counters(iter_s=1.0, steady_wait_s=0.9, steady_batches=3)
    auto = autotune.AutoWorkers(4)
    auto.processes(stats)
    auto.current = 2
    short()
    assert auto.processes(stats) == 2
    stats.worker_busy_s -= 5.0
    stats.iter_s += 1.0
    stats.steady_batches += 10
    assert auto.processes(stats) == 2 and len(stats.auto_moves) == 1


def test_a_review_reads_its_window_and_the_next_epoch_reads_since_the_last_move():
    auto = autotune.AutoWorkers(4)
    stats, _ = _counters()
    assert auto.processes(stats) == 4
    assert auto.review_at(stats) == autotune.WINDOW_S
    # a window of 3 steady batches says nothing yet: no move, and the window goes on
    stats.iter_s, stats.steady_batches = 2.5, 3
    assert auto.review(stats) is None and auto.review_at(stats) == autotune.WINDOW_S
    # main-bound (waited 0.4%, workers 0.1 processes busy): one process fewer, and the
    # next window starts here
    stats.iter_s, stats.steady_wait_s, stats.worker_busy_s, stats.steady_batches = 2.5, 0.01, 0.25, 30
    assert auto.review(stats) == 3 and auto.review_at(stats) == 2.5 + autotune.WINDOW_S
    assert str(stats.auto_moves[-1]).startswith("auto: 4 → 3 processes")
    # that move's restart took 1 s (stats.startup_s): the next window is 4 times that
    stats.startup_s = 1.0
    assert auto.review_at(stats) == 2.5 + autotune.RESTART_TIMES * 1.0
    stats.iter_s, stats.steady_wait_s, stats.steady_batches = 5.0, 0.135, 60
    assert auto.review(stats) is None and auto.review_at(stats) == 6.5  # not yet: 2.5 s of 4
    # a window between the thresholds (waited 5%): no move, and the next window is
    # WINDOW_S again (no restart in it)
    stats.iter_s, stats.steady_wait_s, stats.steady_batches = 6.5, 0.21, 70
    assert auto.review(stats) is None and auto.review_at(stats) == 6.5 + autotune.WINDOW_S
    # the epoch ends 0.2 s and 5 batches later, main waiting half of that tail: the
    # choice between epochs reads everything since the move (waited 7.6%: no move), not
    # the tail alone (50%: one process more)
    stats.iter_s, stats.steady_wait_s, stats.steady_batches = 6.7, 0.31, 75
    assert auto.processes(stats) == 3 and len(stats.auto_moves) == 2, stats.auto_moves


def test_a_process_more_is_refused_for_memory_and_memory_never_takes_one_away(monkeypatch):
    monkeypatch.setenv(autotune.CPUS_ENV, "4")
    auto = autotune.AutoWorkers(4)
    stats, worker_bound = _counters(iter_s=1.0, steady_wait_s=0.5, worker_busy_s=2.0,
                                    steady_batches=20, batches=21)
    auto.processes(stats)
    auto.current = 2
    # a USS per process above half of any machine's available memory
    auto.workers_stopped(SimpleNamespace(workers=[1, 2], workers_uss=1 << 62))
    for _ in range(3):
        worker_bound()
        assert auto.processes(stats) == 2
    kept = [m for m in stats.auto_moves if m.frm == m.to]
    assert len(kept) == 1 and "over half the memory available" in str(kept[0]), stats.auto_moves
    assert str(kept[0]).startswith("auto: kept 2 processes at batch")
    # the CPUs going down takes processes away, and says so
    monkeypatch.setenv(autotune.CPUS_ENV, "1")
    assert auto.processes(stats) == 1 and "over the budget (1 CPUs)" in str(stats.auto_moves[-1])


@pytest.mark.parametrize("version,files,quota", [
    ("v2", {"cpu.max": "150000 100000\n"}, 1.5),
    ("v2", {"cpu.max": "max 100000\n"}, None),
    ("v1", {"cpu.cfs_quota_us": "50000\n", "cpu.cfs_period_us": "100000\n"}, 0.5),
    ("v1", {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}, None),
    ("v2", {}, None),
])
def test_a_cgroup_s_cpu_quota_is_read_in_cpus(tmp_path, version, files, quota):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert autotune._quota(str(tmp_path), version) == quota


# -- moves within an epoch ------------------------------------------------------------
EPOCH_BATCHES = 120


@pytest.fixture
def short_windows(monkeypatch):
    # a review every 0.3 s of steady delivery (2 s by default, and 4 times a restart's
    # cost after a move) keeps these epochs short
    monkeypatch.setattr(autotune, "WINDOW_S", 0.3)
    monkeypatch.setattr(autotune, "RESTART_TIMES", 0)


def _paced(pace_file, persistent=False, context="fork", **extra):
    def make(cls):
        return cls(lds.FilePacedAugmentDataset(pace_file, n=3 * EPOCH_BATCHES), batch_size=3,
                   shuffle=True, num_workers=4, worker_init_fn=lds.augment_init,
                   persistent_workers=persistent, multiprocessing_context=context,
                   **({"node_workers": "auto", **extra} if cls is PoolLoader else {}))
    return make


def _paced_epochs(pace_file, phases):
    """One epoch per phase, the load set by the file the samples read: MAIN_BOUND (the
    consumer sleeps 10 ms a batch, samples are instant), WORKER_BOUND (samples sleep 10
    ms). Keeps every batch, and a draw of main's RNG after each epoch (a move must not
    touch it)."""
    def run(loader):
        out = []
        paced = isinstance(loader, PoolLoader)  # DataLoader's reference: the same batches, sooner
        for phase in phases:
            pace_file.write_text("0.01" if paced and phase == WORKER_BOUND else "0")
            for batch in loader:
                if paced and phase == MAIN_BOUND:
                    time.sleep(0.01)
                out.append(batch)
            out.append({"main_rng": torch.rand(2)})
        return out
    return run


def _within_moves(moves):
    """The moves made inside an epoch that changed the count."""
    return [m for m in moves if m.within and m.frm != m.to]


def _within(moves):
    """The moves made inside an epoch, as (epoch, frm, to)."""
    return [(m.epoch, m.frm, m.to) for m in _within_moves(moves)]


@pytest.mark.parametrize("persistent,context", [(False, "fork"), (True, "forkserver")])
def test_the_count_moves_within_an_epoch_and_every_batch_stays_dataloaders(
        short_windows, tmp_path, monkeypatch, persistent, context):
    from poolloader.main.iterator import PoolLoaderIter
    owed = []  # at each move: (replies waiting for main, requests in flight)
    move = PoolLoaderIter._move_processes

    def counting_move(self, loader, processes):
        owed.append(self.prefetched)
        move(self, loader, processes)
    monkeypatch.setattr(PoolLoaderIter, "_move_processes", counting_move)
    pace = tmp_path / "pace"
    loaders = []

    def make(cls):
        loader = _paced(pace, persistent, context)(cls)
        loaders.append(loader)
        return loader
    ref, got = both_loaders(make, _paced_epochs(pace, [MAIN_BOUND, WORKER_BOUND]))
    assert len(ref) == len(got) == 2 * (EPOCH_BATCHES + 1)
    assert_same(ref, got, "epochs")  # every batch, and main's RNG after each epoch
    record = loaders[1].stats.auto_moves
    # main-bound: processes go inside the first epoch; worker-bound: they come back
    # inside the second
    within = _within_moves(record)
    lowered = [k for k, m in enumerate(within) if m.epoch == 1 and m.to < m.frm]
    assert lowered, record
    raised = [m for m in within[lowered[0] + 1:] if m.to > m.frm]
    if [m.to for m in record if m.epoch == 1][-1] < 4:
        assert any(m.epoch == 2 for m in raised), record
    else:
        # a busy machine can make main wait inside the main-bound epoch too (the
        # consumer's 10 ms a batch against 4 processes on 2 loaded cores): the count
        # came back there, by the same rule, and had no room left to grow in the second
        assert any(m.epoch == 1 and m.waited >= autotune.RAISE_AT for m in raised), record
    # each move stopped processes that owed batches: none was lost or repeated (above)
    assert len(owed) == len(within) and all(sum(o) > 0 for o in owed), owed


def test_a_state_saved_after_a_move_within_the_epoch_resumes_exactly(short_windows, tmp_path):
    pace = tmp_path / "pace"
    pace.write_text("0")
    make = _paced(pace)
    torch.manual_seed(5)
    ref = list(make(DataLoader))
    torch.manual_seed(5)
    loader = make(PoolLoader)
    it = iter(loader)
    head = []
    while not _within(loader.stats.auto_moves) and len(head) < EPOCH_BATCHES - 10:
        head.append(next(it))
        time.sleep(0.01)
    assert _within(loader.stats.auto_moves), loader.stats.auto_moves
    head += [next(it) for _ in range(3)]  # batches from the processes after the move
    state = loader.state_dict()
    rest = list(it)
    del it
    torch.manual_seed(99)  # another global state: the loaded one must not matter
    second = _paced(pace)(PoolLoader)
    second.load_state_dict(state)
    assert_same(ref[:len(head)], head, "head")
    assert_same(ref[len(head):], rest, "rest")
    assert_same(ref[len(head):], list(second), "resumed")


def test_a_loader_that_cannot_restart_exactly_moves_only_between_epochs(short_windows, tmp_path):
    pace = tmp_path / "pace"
    pace.write_text("0")
    loader = _paced(pace, stateful=False)(PoolLoader)
    for _ in range(2):
        for _batch in loader:
            time.sleep(0.01)
    moves = loader.stats.auto_moves
    assert not _within(moves), moves
    assert [m.batch for m in moves[1:]] == [EPOCH_BATCHES], moves  # the one between epochs


@pytest.mark.parametrize("left_early", [False, True])
def test_a_restart_as_a_persistent_epoch_begins_continues_as_dataloader(monkeypatch,
                                                                       left_early):
    """The restart node_pool's "auto" makes as a persistent iterator's next epoch begins
    (PoolLoaderIter._follow_node → _move_processes(between_epochs=True)), here forced
    at every epoch's start in one process: an epoch that ran to its end is begun by the
    restart itself, one left early (requests still out) is resumed and then left as
    DataLoader's is; every batch and main's RNG after each epoch stay DataLoader's,
    with shuffle=True drawing its order from main's RNG (no generator=)."""
    from poolloader.main.iterator import PoolLoaderIter

    reset = PoolLoaderIter._reset
    counts = iter([1, 3, 2] * 2)

    def restarting(self, loader, first_iter=False):
        if not first_iter and not getattr(self, "_restarting", False):
            self._restarting = True
            try:
                if self._move_processes(loader, next(counts), between_epochs=True):
                    return  # it began the epoch
            finally:
                self._restarting = False
        reset(self, loader, first_iter)
    monkeypatch.setattr(PoolLoaderIter, "_reset", restarting)

    def run(loader):
        epochs = []
        for e in range(4):
            batches = []
            for k, batch in enumerate(loader):
                batches.append(batch)
                if left_early and e == 1 and k == 2:
                    break
            epochs.append((batches, torch.get_rng_state()))
        return epochs

    ref, got = both_loaders(_make(persistent=True), run)
    assert [len(b) for b, _ in got] == [8, 3 if left_early else 8, 8, 8]
    assert_same(ref, got, "epochs")
