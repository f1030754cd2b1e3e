"""Every exception (and warning) poolloader raises on purpose, in one place, and `warn`,
which gives each warning at the user's line.

Each subclasses the builtin a caller would already catch for it.
"""
import os
import types


class RingClosed(RuntimeError):
    """A ring was closed while (or before) waiting on it."""


class RingTimeout(TimeoutError):
    """A blocking ring operation waited its whole timeout."""


class ShmSpaceError(MemoryError):
    """/dev/shm (or the configured cap) cannot hold what the pool needs."""


class PoolExhausted(RuntimeError):
    """The consumer holds every slot and the pool reached its bound."""


class SlotCorrupt(RuntimeError):
    """A slot's header or skeleton is invalid; nothing was read outside the slot."""


class ControlCorrupt(SlotCorrupt):
    """Shared bytes besides a slot (a ring's counters or capacity, the control block's
    header, slot table or acks) hold values no correct process writes; nothing was
    read or written outside them."""


class PoolGone(RuntimeError):
    """A worker attaching a pool found its control segment gone: the pool's owner closed
    it or exited (its owner lock went with it)."""


class WorkerDied(RuntimeError):
    """A worker process exited while the loader still needed it."""


class CudaRegistrationError(RuntimeError):
    """cudaHostRegister refused a slot; the CUDA error was cleared."""


class StallWarning(RuntimeWarning):
    """next() has waited `stall_warning` seconds for a batch (timeout=0 waits on); the
    message says which worker owes which batch and where it is (poolloader.main.stall)."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_frame(skip: tuple[str, ...] = (), depth: int = 1) -> tuple[types.FrameType, int]:
    """The frame a warning or a report names as the user's line: the innermost frame
    outside poolloader, torch.utils.data and the paths in `skip` (directories ending in
    os.sep, or files), starting `depth` frames out from the caller (1: the caller's
    caller), however deep in poolloader that is; the outermost frame where none is
    outside (a thread of poolloader's own). With it, its depth from the caller: the
    stacklevel that `warnings.warn` called by the caller needs to name it.

    The one walk of the stack for warning locations: `warn` and the runner's record of
    where a loader was built (poolloader.adopt.hook) use it."""
    import sys

    inside = [_PACKAGE_DIR, *skip]
    data = sys.modules.get("torch.utils.data")
    if data is not None and data.__file__:
        inside.append(os.path.dirname(data.__file__) + os.sep)
    prefixes = tuple(inside)
    level, frame = depth + 1, sys._getframe(depth + 1)
    while frame.f_code.co_filename.startswith(prefixes) and frame.f_back is not None:
        level, frame = level + 1, frame.f_back
    return frame, level


def warn(message, category: type[Warning] = UserWarning, skip: tuple[str, ...] = ()) -> None:
    """`warnings.warn(message, category)` at the user's line (`user_frame`: the innermost
    frame outside poolloader, torch.utils.data and the directories in `skip`: `for batch
    in loader`, `loader.state_dict()`, the script's line under the runner), however deep
    in poolloader it was raised. `message` may be a Warning instance (its class is the
    category then, as with warnings.warn)."""
    import warnings

    _frame, level = user_frame(skip)
    warnings.warn(message, category, stacklevel=level)
