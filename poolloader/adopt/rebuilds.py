"""When a library rebuilds a PoolLoader as a plain DataLoader, say once that the pool
is lost, unless it is kept anyway.

HF Accelerate reads `_is_accelerate_prepared` of every loader given to
`Accelerator.prepare()` and then rebuilds it as a plain DataLoader; PoolLoader's
property calls the hooks of its extension point, `poolloader.loader.on_plain_rebuild`,
and this module adds `note_plain_prepare` there when it is imported (the package's
__init__ imports it). Two things keep the pool, and each says so
here: `poolloader.accelerate.prepare()` marks the loaders it is preparing
(`preparing`), and the runner's hook marks the process as pooling every DataLoader
(`set_pooling_every_loader`).

This module imports only the loader (to register there) and errors; the hook and
poolloader.accelerate point down to it.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from poolloader import loader as _loader
from poolloader.errors import warn

_local = threading.local()  # .preparing: ids of PoolLoaders being prepared by poolloader.accelerate
_pooling_every_loader = False
warned = False  # the warning is given once per process (tests set it back)


def set_pooling_every_loader(on: bool) -> None:
    """The runner's hook is on (every DataLoader with workers is built as a PoolLoader,
    the one Accelerate rebuilds included) or off again."""
    global _pooling_every_loader
    _pooling_every_loader = on


@contextlib.contextmanager
def preparing(loaders) -> Iterator[None]:
    """Within the block, this thread is rebuilding `loaders` keeping their pools."""
    before: frozenset[int] = getattr(_local, "preparing", frozenset())
    _local.preparing = before | {id(loader) for loader in loaders}
    try:
        yield
    finally:
        _local.preparing = before


def note_plain_prepare(loader) -> None:
    """Called when Accelerate is about to rebuild `loader`: warn once, unless the pool
    will be kept anyway."""
    global warned
    if (warned or loader.num_workers == 0 or _pooling_every_loader
            or id(loader) in getattr(_local, "preparing", ())):
        return
    warned = True
    import accelerate  # the warning is given at the first caller outside it (and poolloader)
    warn(
        "accelerator.prepare() rebuilds this PoolLoader as a plain DataLoader: its batches "
        "will not go through the slot pool. Keep the pool with "
        "poolloader.accelerate.prepare(accelerator, ...) in place of accelerator.prepare(...), "
        "or run the script under `python -m poolloader`.", UserWarning,
        skip=(os.path.dirname(str(accelerate.__file__)) + os.sep,))


_loader.on_plain_rebuild.append(note_plain_prepare)
