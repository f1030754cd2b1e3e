"""The tests' one comparator and one two-loader driver.

`assert_same`: same Python structure, types, dtypes, shapes, (strides) and bits,
recursively; DataLoader's batch against PoolLoader's. `both_loaders`: the same run
through DataLoader, then PoolLoader, from the same seeds; `lockstep` walks two
live loaders batch by batch. No pytest import: spawned children may import it."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import random

import numpy as np
import torch
from torch.utils.data import DataLoader

from poolloader import PoolLoader

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same(a, b, path: str = "batch", strides: bool = True) -> None:
    """Raise AssertionError naming the first place `a` and `b` differ. Floats compare by
    bits (NaN and -0.0 included); `strides=False` ignores memory layout."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided or a.is_nested:
            a, b = (a.to_dense(), b.to_dense()) if not a.is_nested else (
                torch.cat([t.flatten() for t in a.unbind()]), torch.cat([t.flatten() for t in b.unbind()]))
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), \
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        if strides:
            assert a.stride() == b.stride(), f"{path}: strides {a.stride()} != {b.stride()}"
        if (a.is_floating_point() or a.is_complex()) and a.element_size() in _BITS:
            assert torch.equal(a.view(_BITS[a.element_size()]), b.view(_BITS[b.element_size()])), \
                f"{path}: bits differ"
        else:
            assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        if strides:
            assert a.flags.c_contiguous == b.flags.c_contiguous, f"{path}: memory order differs"
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif hasattr(a, "fields") and hasattr(a, "counts") and hasattr(a, "as_list"):  # PackedTargets
        assert a.stacked == b.stacked, path
        assert_same(a.counts, b.counts, f"{path}.counts", strides)
        assert_same(a.fields, b.fields, f"{path}.fields", strides)
        assert_same(a.as_list(), b.as_list(), f"{path}.as_list()", strides)
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]", strides)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", strides)
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert_same(dataclasses.asdict(a), dataclasses.asdict(b), path, strides)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def pool_only(cls, **options):
    """`options` (slot_bytes=..., slots=...) for PoolLoader, nothing for DataLoader."""
    return options if cls is PoolLoader else {}


def both_loaders(make, run=list, seed: int = 1234):
    """(DataLoader's result, PoolLoader's): for each class in turn, torch, numpy and
    random are seeded with `seed`, `loader = make(cls)` and `run(loader)` is kept; then
    the loader's workers are stopped (persistent ones included) and the loader
    dropped, so the second run starts as the first did and neither leaves anything
    behind. `run` sees one loader: e.g. `list` (one epoch, batches kept) or
    `lambda l: [canon(b) for b in l]`."""
    results = []
    for cls in (DataLoader, PoolLoader):
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        loader = make(cls)
        try:
            results.append(run(loader))
        finally:
            it = getattr(loader, "_iterator", None)  # a persistent loader keeps its workers
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
            del it, loader
            gc.collect()
    return results[0], results[1]


_END = object()


def lockstep(*loaders):
    """The batches of live loaders side by side, one of each alive at a time (so a
    PoolLoader reuses its slots as in training); the counts must match."""
    for group in itertools.zip_longest(*loaders, fillvalue=_END):
        assert _END not in group, "loaders delivered different numbers of batches"
        yield group
