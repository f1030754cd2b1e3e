"""Every exception (and warning) poolloader raises on purpose, in one place.

Each subclasses the builtin a caller would already catch for it.
"""


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


class WorkerDied(RuntimeError):
    """A worker process exited while the loader still needed it."""


class CudaRegistrationError(RuntimeError):
    """cudaHostRegister refused a slot; the CUDA error was cleared."""


class StallWarning(RuntimeWarning):
    """next() has waited `stall_warning` seconds for a batch (timeout=0 waits on); the
    message says which worker owes which batch and where it is (poolloader.worker.stall)."""
