"""stats.advice(): each branch on a real loader whose bottleneck is built in (a slow
dataset, a slow consumer, both matched), asserting the recommendation and that the
shares it quotes are the measured ones. Sleeps, not CPU work, set the costs, with
contrasts of about 2x or more, so a loaded 2-core machine reads the same."""
import re
import time

import diagnose_datasets as dd
import pytest

from poolloader import LoaderStats, PoolLoader
from poolloader.main.advice import BUSY_BOUND, IDLE_BELOW, MIN_BATCHES, WAIT_BOUND, advise


def run(delay, consumer_delay, n=40, num_workers=2):
    loader = PoolLoader(dd.SleepDataset(n, delay), batch_size=1, num_workers=num_workers)
    for _ in loader:
        if consumer_delay:
            time.sleep(consumer_delay)
    return loader.stats


def measured(stats):
    """(wait share, busy share, hand-off share) from the raw counters."""
    wait = stats.steady_wait_s / stats.iter_s
    busy = stats.worker_busy_s / (stats.worker_busy_s + stats.worker_idle_s)
    handoff = (stats.next_s - stats.steady_wait_s) / stats.iter_s
    return wait, busy, handoff


def pct(x):
    return f"{100 * x:.0f}%"


def check_common(stats, advice):
    wait, busy, handoff = measured(stats)
    assert stats.steady_batches == 39  # 40 batches, the first is start-up
    assert advice.shares["main_wait"] == pytest.approx(wait)
    assert advice.shares["worker_busy"] == pytest.approx(busy)
    assert advice.shares["handoff"] == pytest.approx(handoff)
    assert f"the hand-off is {pct(handoff)} of step time" in advice.text
    assert stats.advice() == advice.text
    return wait, busy


def test_slow_dataset_says_add_workers_or_cheapen_getitem():
    stats = run(delay=0.05, consumer_delay=0.0)
    advice = stats.diagnose()
    wait, busy = check_common(stats, advice)
    assert advice.verdict == "workers", advice.text
    assert wait >= WAIT_BOUND and busy >= BUSY_BOUND
    assert f"main waited {pct(wait)} of the epoch for workers, workers were busy {pct(busy)}" \
        in advice.text
    # what to change depends on the cores: the same numbers read on 2 and on 16 cores
    assert "num_workers=2 already matches the 2 cores" in advise(stats, cores=2).text
    assert "add workers: num_workers=2, you have 16 cores" in advise(stats, cores=16).text
    assert "__getitem__" in advice.text


def test_slow_consumer_says_the_training_step_is_the_bottleneck():
    stats = run(delay=0.0, consumer_delay=0.05)
    advice = stats.diagnose()
    wait, busy = check_common(stats, advice)
    assert advice.verdict == "consumer", advice.text
    assert wait < WAIT_BOUND and busy < IDLE_BELOW
    assert (f"workers were idle {pct(1 - busy)} and main waited only {pct(wait)} in the steady state: "
            "the training step is the bottleneck") in advice.text
    assert "fewer workers would do: with num_workers=1 instead of 2 they would be busy about " \
        f"{pct(2 * busy)}" in advice.text
    # the step it names is the consumer's 50 ms sleep, as measured
    step_ms = float(re.search(r"\(([\d.]+) ms per batch, a worker", advice.text).group(1))
    assert 50.0 <= step_ms < 200.0


def test_balanced_says_keep_it():
    # a batch costs a worker 45 ms, 2 workers: one every 22.5 ms; the step takes 30 ms
    stats = run(delay=0.045, consumer_delay=0.03)
    advice = stats.diagnose()
    wait, busy = check_common(stats, advice)
    assert advice.verdict == "balanced", advice.text
    assert wait < WAIT_BOUND and busy >= IDLE_BELOW
    assert (f"main waited only {pct(wait)} in the steady state and workers were busy {pct(busy)}: the loader "
            "keeps up with the training step") in advice.text
    assert "keep num_workers=2" in advice.text


def counters(**values):
    """A LoaderStats holding the given counters (the reading logic alone)."""
    stats = LoaderStats()
    stats.__dict__.update({"steady_batches": 100, "iter_s": 10.0, "num_workers": 4,
                           "_closed_workers": [100, 0, 0]})
    busy, idle = values.pop("busy", 0.0), values.pop("idle", 0.0)
    stats._closed_workers[1:] = [int(busy * 1e9), int(idle * 1e9)]
    stats.__dict__.update(values)
    return stats


def test_reading_covers_uneven_handoff_startup_and_too_few():
    # main waits while workers have time to spare: particular batches are slow
    uneven = advise(counters(steady_wait_s=3.0, next_s=3.1, busy=20.0, idle=20.0), cores=8)
    assert uneven.verdict == "uneven"
    assert "main waited 30% of the epoch, yet workers were busy only 50%" in uneven.text
    # a hand-off of 20% of step time is worth cutting; start-up of 5 s out of 15 is named
    costly = advise(counters(steady_wait_s=0.0, next_s=2.0, busy=30.0, idle=10.0,
                             startup_s=5.0), cores=8)
    assert costly.verdict == "balanced"
    assert "the hand-off is 20% of step time (20.00 ms per batch)" in costly.text
    assert "pack_targets" in costly.text
    assert "start-up (each epoch's start to its first batch) took 5.0 s, 33%" in costly.text
    # workers short of the cores: how many keep up, from the per-batch costs
    need = advise(counters(steady_wait_s=5.0, next_s=5.0, busy=40.0, idle=0.0), cores=16)
    assert need.verdict == "workers"
    # a batch costs a worker 400 ms, the step (10 s - 5 s) / 100 = 50 ms: 8 workers
    assert "add workers: num_workers=4, you have 16 cores (about 8 keep up)" in need.text
    few = advise(counters(steady_batches=MIN_BATCHES - 1), cores=8)
    assert few.verdict == "unmeasured" and "too few batches" in few.text
    assert advise(LoaderStats()).verdict == "unmeasured"
