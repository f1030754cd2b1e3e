"""The node segment: what the processes of a node pool (PoolLoader(node_pool=True)) share
besides each rank's own pool.

One small memfd segment, created by the host (local rank 0, which starts the node's
physical worker processes) and mapped by every physical process and every rank:

    0    header, 8 u64: [0] NODE_MAGIC  [1] physical processes P  [2] host pid  [3..7] 0
    64   P request doorbells (DOORBELL_BYTES each): physical process p waits on its own;
         a rank rings it after each push to a request ring of a logical worker that p
         hosts (placement: poolloader.main.node)
    then P error records (ERROR_BYTES each): u32 length, then that many bytes of UTF-8,
         the traceback physical process p failed with, written by p just before it
         exits (length 0: none), so every rank's WorkerDied can say why it ended

Liveness is read from open file description locks on the segment's bytes (they are
advisory and cover bytes of the file, not its contents): the host holds a lock on
byte 0 through its own descriptor, physical process p one on byte 1 + p through its
own. A lock goes with the process that holds it, however it ends (SIGKILL too), and
is never someone else's after that (no pid reuse), so a rank tells within one check
whether the host and each physical process live. Nothing is named: the segment goes
with the last process that maps it.
"""
from __future__ import annotations

import os

import numpy as np

from poolloader.errors import ControlCorrupt
from poolloader.shm import fork
from poolloader.shm._ring import DOORBELL_BYTES, Doorbell
from poolloader.shm.backend import owner_lock_held, take_owner_lock, unlock_byte
from poolloader.shm.backends import memfd

NODE_MAGIC = 0x65646F4E6C6F6F50  # "PoolNode"
_HEADER_FIELDS = 8
HOST_BYTE = 0  # the host's lock; physical process p locks byte 1 + p


def _header(mapping) -> np.ndarray:
    return np.ndarray((_HEADER_FIELDS,), np.uint64, buffer=mapping, offset=0)


ERROR_BYTES = 4096  # a process's error record: its length word and the text's last bytes


def _nbytes(processes: int) -> int:
    """The segment's size: the header, the doorbells and every process's error record."""
    return (_error_offset(processes, processes) + 4095) // 4096 * 4096


def _bell_offset(p: int) -> int:
    return 64 + p * ((DOORBELL_BYTES + 63) // 64 * 64)


def _error_offset(processes: int, p: int) -> int:
    return _bell_offset(processes) + p * ERROR_BYTES


class NodeSegment:
    """The node segment, created (`create`, the host) or attached (`attach`: a rank or a
    physical process). `locator` is what the others need to attach (picklable)."""

    def __init__(self, mapping, fd: int, processes: int, locator: tuple, create: bool):
        self.mapping = mapping
        self._fd = fd
        self._held = create  # registered with fork.hold: a forked child closes its copy
        # the byte of the lock this side holds (the host's on create, a process's once
        # it holds it), released by close(); None: none
        self._lock_byte: int | None = HOST_BYTE if create else None
        self.processes = processes
        self.locator = locator
        self.bells = [Doorbell(mapping, _bell_offset(p), create=create) for p in range(processes)]

    @classmethod
    def create(cls, processes: int) -> NodeSegment:
        """The host's: a new segment with `processes` doorbells and the host's lock taken."""
        nbytes = _nbytes(processes)
        mapping, fd, inode = memfd.create(nbytes, "the node pool's control segment", "node",
                                          reserve=True)
        try:
            if not take_owner_lock(fd, HOST_BYTE):
                raise RuntimeError("internal error: a new memfd's host lock is already held")
            header = _header(mapping)
            header[:] = 0
            header[1] = processes
            header[2] = os.getpid()
            segment = cls(mapping, fd, processes, (os.getpid(), fd, inode, nbytes), create=True)
            header[0] = NODE_MAGIC
            del header
        except BaseException:
            fork.release(fd)
            raise
        return segment

    @classmethod
    def attach(cls, locator: tuple) -> NodeSegment:
        """A rank's or a physical process's: opened through the host's /proc/<pid>/fd
        (its own open file description, so its own locks), checked to be a node segment."""
        host_pid, fd, inode, nbytes = locator
        try:
            mapping, own = memfd.open_segment(host_pid, fd, inode, nbytes, keep_fd=True)
        except memfd.StaleHandle:
            raise RuntimeError(
                f"PoolLoader(node_pool=True): the node pool's host (local rank 0, pid "
                f"{host_pid}) is gone or closed its node pool") from None
        try:
            header = np.array(_header(mapping))
            processes = int(header[1])
            if int(header[0]) != NODE_MAGIC or not 1 <= processes or _nbytes(processes) > nbytes:
                raise ControlCorrupt(f"the node segment of pid {host_pid} is not a node pool's "
                                     f"(magic {int(header[0]):#x}, {processes} processes)")
            return cls(mapping, own, processes, locator, create=False)
        except BaseException:
            os.close(own)
            raise

    def hold_process_lock(self, p: int) -> None:
        """In physical process p: its lock, held until the process ends."""
        with fork.creating():
            fork.hold(self._fd)  # a child this process forks must not keep the lock alive
            self._held = True
        if not take_owner_lock(self._fd, 1 + p):
            raise RuntimeError(f"internal error: node pool process {p}'s lock is already held")
        self._lock_byte = 1 + p

    def host_alive(self) -> bool:
        # closed here: what it says of the host no longer matters to this side
        return self._fd >= 0 and owner_lock_held(self._fd, HOST_BYTE)

    def process_alive(self, p: int) -> bool:
        return self._fd >= 0 and owner_lock_held(self._fd, 1 + p)

    def record_error(self, p: int, text: str) -> None:
        """In physical process p, as it fails: `text` (its traceback; the last bytes if
        it is long) for the ranks to read once its lock is gone (`error`)."""
        data = text.encode("utf-8", "replace")[-(ERROR_BYTES - 4):]
        offset = _error_offset(self.processes, p)
        np.frombuffer(self.mapping, np.uint8, len(data), offset + 4)[:] = np.frombuffer(data, np.uint8)
        np.ndarray((1,), np.uint32, buffer=self.mapping, offset=offset)[0] = len(data)

    def error(self, p: int) -> str | None:
        """What physical process p recorded as it failed (record_error); None if nothing."""
        offset = _error_offset(self.processes, p)
        n = min(int(np.ndarray((1,), np.uint32, buffer=self.mapping, offset=offset)[0]),
                ERROR_BYTES - 4)
        if not n:
            return None
        return bytes(np.frombuffer(self.mapping, np.uint8, n, offset + 4)).decode("utf-8", "replace")

    def close(self) -> None:
        """Drop the views and the descriptor; the lock this side holds (the host's, a
        process's) goes now, not when the mapping (which keeps a dup of the
        descriptor) is collected."""
        self.bells = []
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            if self._lock_byte is not None:
                try:
                    unlock_byte(fd, self._lock_byte)
                except OSError:
                    pass  # the close below drops it with the mapping
            if self._held:
                fork.release(fd)
            else:
                os.close(fd)
