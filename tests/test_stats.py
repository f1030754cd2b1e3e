"""LoaderStats: plausible counters that answer "which side is the bottleneck?"."""
import time

import loader_datasets as ds

from poolloader import PoolLoader


def run(delay, consumer_delay):
    loader = PoolLoader(ds.SlowDataset(n=24, delay=delay), batch_size=2, num_workers=2,
                        persistent_workers=True)
    for _ in loader:
        time.sleep(consumer_delay)
    stats = loader.stats.as_dict()
    del loader
    return stats


def test_slow_workers_show_as_main_waiting_and_slow_consumer_as_worker_idle():
    slow_workers = run(delay=0.05, consumer_delay=0.0)
    slow_consumer = run(delay=0.0, consumer_delay=0.05)
    for stats in (slow_workers, slow_consumer):
        assert stats["batches"] == 12 and stats["worker_batches"] == 12
        assert stats["slot_count"] >= 6 and stats["slot_bytes"] >= 1 << 20
    # 24 samples × 50 ms = 1.2 s of work over 2 workers; main waits for most of it.
    # Ordering with margins, not ratios: a busy machine adds waits to both runs.
    assert slow_workers["worker_busy_s"] > 0.9
    assert slow_workers["main_wait_s"] > 0.3
    assert slow_workers["main_wait_s"] > slow_consumer["main_wait_s"] + 0.2
    # a slow consumer (12 × 50 ms) leaves the workers idle
    assert slow_consumer["worker_idle_s"] > 0.5
    assert slow_consumer["worker_idle_s"] > slow_workers["worker_idle_s"] + 0.2


def test_growth_counters():
    loader = PoolLoader(ds.BigDataset(n=12), batch_size=3, collate_fn=ds.pad_collate,
                        num_workers=1, slot_bytes=70_000)
    for _ in loader:
        pass
    assert loader.stats.slot_growths >= 1
    assert loader.stats.pool_growths == 0
    assert loader.stats.slot_count == 0  # the pool is gone after a non-persistent epoch
    grown, learned = loader.stats.slot_growths, loader.stats.learned_slot_bytes
    assert learned > 70_000
    for _ in loader:  # the next epoch's pool starts at the learned size: no regrowth
        pass
    assert loader.stats.slot_growths == grown
    assert loader.stats.worker_batches == 8  # both epochs' pools counted
