"""The shared-memory backends, one module each, found by their module names.

Each module implements poolloader.shm.backend.Backend (KIND is its module name):
memfd.py (anonymous segments, the default) and posix.py (named segments in
/dev/shm). A new backend is one new module here: `kinds()` lists it and `load()`
imports it, with no edit elsewhere; PREFERENCE says which kind a pool gets when none
is asked for, and what it falls back to where that kind refuses (pool.choose_backend).
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:  # PoolLoader() checks a kind without loading any backend
    from poolloader.shm.backend import Backend

# The default first, then the fallback order; a kind not listed comes after these,
# in name order.
PREFERENCE = ("memfd", "posix")


def kinds() -> tuple[str, ...]:
    """Every backend there is, in PREFERENCE order."""
    found = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    return tuple(k for k in PREFERENCE if k in found) + tuple(sorted(found - set(PREFERENCE)))


def load(kind: str) -> Backend:
    """The backend module of that kind; ValueError naming the kinds there are otherwise."""
    loaded = sys.modules.get(f"{__name__}.{kind}")
    if loaded is not None and not kind.startswith("_"):
        # no listing of this folder (kinds()), which needs a descriptor: a process out of
        # them (EMFILE) must fail where it opens a segment, saying so, not here
        return cast("Backend", loaded)
    if kind not in kinds():
        raise ValueError(f"shm_backend must be one of {kinds()}, got {kind!r}")
    return cast("Backend", importlib.import_module(f"{__name__}.{kind}"))
