"""poolloader: a drop-in torch DataLoader whose workers write batches into
preallocated, reused shared-memory slots; only slot indices cross processes."""
from poolloader.adopt import rebuilds as _rebuilds  # noqa: F401  (registers its warning: poolloader.loader.on_plain_rebuild)
from poolloader.collate import slot_collate, slot_empty
from poolloader.cuda.runtime import watch_stream
from poolloader.detection import DetectionCollate, PackedTargets, pack_targets
from poolloader.errors import (
                               ControlCorrupt,
                               PoolExhausted,
                               RingClosed,
                               RingTimeout,
                               ShmSpaceError,
                               SlotCorrupt,
                               StallWarning,
                               WorkerDied,
)
from poolloader.loader import PoolLoader
from poolloader.records import FrozenDict, FrozenList, frozen
from poolloader.stats import LoaderStats

__all__ = [
    "PoolLoader", "LoaderStats", "slot_collate", "slot_empty",
    "DetectionCollate", "PackedTargets", "pack_targets", "watch_stream",
    "ControlCorrupt", "PoolExhausted", "RingClosed", "RingTimeout", "ShmSpaceError",
    "SlotCorrupt", "StallWarning", "WorkerDied", "frozen", "FrozenList", "FrozenDict",
]
__version__ = "0.1.0"
