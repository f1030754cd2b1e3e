"""PoolLoaderIter's teardown (poolloader.main.iterator), written down once: the steps
in order, each in its own try, each recorded as done only once it returned. A mixin:
the iterator's state is its own."""
from __future__ import annotations

import os
from typing import Any

from poolloader.main import supervise


class IteratorTeardown:
    """Stop requests → wake every waiter → stop the workers → unmap → unlink."""

    _teardown_left: tuple
    _owner_pid: int
    _node: Any
    _share: Any
    _ledger: Any
    _pool: Any
    _replies: Any
    _share_epoch: Any
    _stager: Any
    _stats: Any
    _workers: Any
    _shared_start: Any
    _request_bells: Any
    _request_rings: Any

    # The teardown steps, in order (methods below).
    _TEARDOWN = ("_note_memory", "_close_requests", "_stop_workers", "_close_shared_start",
                 "_close_replies", "_close_stager", "_end_share", "_close_ledger",
                 "_detach_stats", "_close_pool", "_untrack", "_leave_node")

    def _shutdown_workers(self) -> None:
        """The one place that stops everything, in order: close the request rings
        (wakes and ends every worker) → the ladder → unlink every name and drop the
        mappings. Idempotent; does nothing in a forked child.

        Each step runs in its own try: one that raises (a second Ctrl-C during the
        join) does not keep the later ones from running, and the first error is raised
        at the end. A step is recorded as done only once it returned, so a later call
        (atexit, __del__) runs only what is left."""
        if os.getpid() != self._owner_pid:
            return
        self._shutdown = True
        error: BaseException | None = None
        for step in self._teardown_left:
            try:
                getattr(self, step)()
            except BaseException as e:
                error = error or e
                continue
            self._teardown_left = tuple(s for s in self._teardown_left if s != step)
        if error is not None:
            raise error

    def _note_memory(self) -> None:
        if self._pool is not None:  # the workers' last moment alive (stats.last_memory)
            self._stats.workers_stopping(self._pool)

    def _close_requests(self) -> None:
        try:
            for ring in getattr(self, "_request_rings", ()):
                ring.close()
            for bell in getattr(self, "_request_bells", None) or ():
                bell.ring()  # a host waiting on its doorbell wakes and finds its rings closed
        finally:
            self._request_rings = []  # a ring keeps the control block mapped
            self._request_bells = None

    def _stop_workers(self) -> None:
        if self._node is None:  # a node pool's processes go on serving the other ranks
            supervise.stop(self._workers)

    def _close_shared_start(self) -> None:
        if self._shared_start is not None:
            self._shared_start.close()
            self._shared_start = None

    def _close_replies(self) -> None:
        if self._replies is not None:
            self._replies.close()

    def _close_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()

    def _close_ledger(self) -> None:
        if self._ledger is not None:
            # bounded wait for every copy that may still read a cooling, leased or
            # staged slot, on every stream and device; then the pool unregisters
            self._ledger.close()

    def _detach_stats(self) -> None:
        if self._pool is not None:
            self._stats.detach_pool(self._pool)

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def _untrack(self) -> None:
        supervise.untrack(self)

    def _leave_node(self) -> None:
        node, self._node = self._node, None
        if node is not None:
            node.release()

    def _end_share(self) -> None:
        share, self._share = self._share, None
        if share is not None:
            try:
                share.end_epoch(self._share_epoch)  # a follower in it is told, not left waiting
            finally:
                share.release()

    def shutdown_at_exit(self) -> None:
        """What supervise.track's exit handler (and the finaliser) calls: no CUDA call
        (the process or the object is going away); the next gate of this process
        finishes what is left."""
        gate = getattr(self, "_gate", None)
        if gate is not None:
            gate.defer()
        self._shutdown_workers()

    def __del__(self) -> None:
        try:
            self.shutdown_at_exit()
        except Exception:
            pass
