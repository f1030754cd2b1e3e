"""HF Accelerate: keep a PoolLoader's pool through `accelerator.prepare()`.

`Accelerator.prepare(loader)` does not wrap your loader: it reads its DataLoader
arguments and builds a new plain `DataLoader(dataset, batch_sampler=..., **kwargs)`
inside a `DataLoaderShard` (accelerate/data_loader.py, `DataLoaderAdapter`), so the
batches of a prepared PoolLoader no longer go through the pool. Two ways keep it:

* `poolloader.accelerate.prepare(accelerator, *objects)` in place of
  `accelerator.prepare(*objects)`: accelerate prepares everything as usual (sharding,
  device placement, the end-of-epoch state); then the plain DataLoader built for each
  PoolLoader is rebuilt as a PoolLoader from the exact arguments accelerate passed, plus
  the original's pool options. The prepared object is accelerate's own, unchanged but
  for its `base_dataloader`: `isinstance(prepared, PoolLoader)` and `prepared.stats` work.
  `skip_first_batches(accelerator, loader, n)` does the same for resuming mid-epoch.
* Run the script under `python -m poolloader`: the loader accelerate builds is then a
  PoolLoader itself (with the runner's pool options).

A direct `accelerator.prepare(pool_loader)` outside both warns once that the pool is
dropped. `use_stateful_dataloader=True` (accelerate then builds torchdata's
StatefulDataLoader, a class of its own) is not rebuilt: that case warns and keeps
accelerate's loader (PoolLoader's own `state_dict()` has StatefulDataLoader's layout).
"""
from __future__ import annotations

from torch.utils.data import DataLoader

from poolloader.adopt import hook, rebuilds
from poolloader.errors import warn
from poolloader.loader import PoolLoader


def prepare(accelerator, *objects, **kwargs):
    """`accelerator.prepare(*objects, **kwargs)`, keeping every PoolLoader's pool.

    Returns what accelerate returns (the object itself for one argument, else a tuple,
    in the same order)."""
    prepared = _prepare_keeping_pools(objects, lambda: accelerator.prepare(*objects, **kwargs))
    return prepared


def skip_first_batches(accelerator, loader, num_batches: int = 0):
    """`accelerator.skip_first_batches(loader, num_batches)`, keeping the pool of a
    PoolLoader (or of a loader prepared by `prepare` above)."""
    return _prepare_keeping_pools(
        (loader,), lambda: accelerator.skip_first_batches(loader, num_batches=num_batches))


def _prepare_keeping_pools(objects, call):
    """Run `call` (an accelerate call that rebuilds loaders), then give each PoolLoader's
    replacement its pool back; the result is shaped as accelerate shaped it."""
    # A loader prepared by us before carries its PoolLoader as base_dataloader.
    originals = [getattr(o, "base_dataloader", o) for o in objects]
    pools = {i: o for i, o in enumerate(originals) if isinstance(o, PoolLoader)}
    with rebuilds.preparing(pools.values()), hook.recording() as calls:
        result = call()
    if not pools:
        return result
    results = list(result) if len(objects) > 1 else [result]
    for i, original in pools.items():
        results[i] = _with_pool(results[i], original, calls)
    return tuple(results) if len(objects) > 1 else results[0]


def _with_pool(prepared, original: PoolLoader, calls: dict):
    """`prepared` whose loader is a PoolLoader built with accelerate's arguments and
    `original`'s pool options."""
    options = hook.pool_options_of(original)
    base = prepared.__dict__.get("base_dataloader", prepared)
    if isinstance(base, PoolLoader) and hook.pool_options_of(base) == options:
        return prepared  # built as a PoolLoader already (under the runner)
    call = calls.get(id(base))
    if call is None or not isinstance(base, DataLoader):
        warn(
            f"poolloader.accelerate: cannot keep the pool of this PoolLoader: accelerate "
            f"returned {type(prepared).__name__} over {type(base).__name__}, not built by a "
            f"DataLoader(...) call (use_stateful_dataloader=True? XLA?); its loader is "
            f"accelerate's.", UserWarning)
        return prepared
    args, kwargs = call
    pooled: PoolLoader = PoolLoader(*args, **{**kwargs, **options})
    hook.forget(base)
    if base is prepared:
        return pooled
    prepared.base_dataloader = pooled
    return prepared
