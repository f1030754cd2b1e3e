"""A share_batches follower's CUDA side: its own registration of the leader's pages,
and releases that reach the leader only once this rank's copies finished.

The leader's pool registers its own mappings and gates its own reuse (its SlotGate, as
any PoolLoader's). A follower maps the same segments at its own addresses, so with
`pin_memory=True` (or `device="cuda"`) it registers each mapping itself, once, for as
long as it keeps the mapping (across epochs and iterators: the mappings are its
ShareFollower's, and so is this object). Those are the rank's private views
(poolloader.main.share), whose pages ShareFollower makes its own before they are
registered and never drops (each batch is copied in), so what is pinned stays what
the batch views. When the last view of a batch dies here, the gate takes its marker
(SlotGate.release); the key goes back to the leader only when `ready()` returns it, so
the leader's ledger (`shared`, `parked`) frees the slot only after every copy this rank
queued from it has run. A mapping the follower drops (the leader gave the slot a new
segment, or began a new pool) is unregistered once its own marker completed.

Used from the follower's iterating thread only, except `close()`, which a finaliser
may call: it makes no CUDA call (SlotGate.defer) and leaves the unregistrations to
this process's next gate activity (poolloader.cuda.gate.finish_deferred).
"""
from __future__ import annotations

from poolloader.shm._shm import Mapping


class FollowerCuda:
    """`gate`, `stager`: what poolloader.cuda.gate.setup gave the follower's first
    iterator (the gate may be None: then there is nothing to register or wait for)."""

    def __init__(self, gate, stager) -> None:
        self.gate = gate
        self.stager = stager
        self._registered: dict[int, Mapping] = {}  # address -> a mapping the gate registered
        self._cooling: dict[tuple, bool] = {}  # key -> forked, released to the gate, not ready
        self.registrations = 0  # mappings registered so far (each once)

    def register(self, mapping: Mapping, slot: int) -> None:
        """Before a batch in `mapping` is decoded: registered the first time only.
        Raises CudaRegistrationError (the gate's)."""
        if self.gate is None or self._registered.get(mapping.address) is mapping:
            return
        self.gate.register(mapping, slot)
        self._registered[mapping.address] = mapping
        self.registrations += 1

    def drop(self, mapping: Mapping) -> None:
        """No batch will be decoded from `mapping` any more (the caller forgets it): it is
        unregistered once every copy that may read it has finished (`ready`)."""
        if self.gate is not None and self._registered.get(mapping.address) is mapping:
            del self._registered[mapping.address]
            self.gate.release(mapping)  # the gate's cooling entry keeps it mapped meanwhile

    def release(self, key: tuple, forked: bool) -> list:
        """The batch in `key` died here: [(key, forked)] to tell the leader now, or []
        when it waits behind this rank's copies (a later `ready()` returns it)."""
        if self.gate is None:
            return [(key, forked)]
        self.gate.release(key)
        self._cooling[key] = forked
        return []

    def ready(self) -> list:
        """[(key, forked)] whose copies finished, in release order (never waits); the
        dropped mappings whose copies finished are unregistered meanwhile."""
        if self.gate is None or not self.gate.pending:
            return []
        out = []
        for key in self.gate.ready():
            if isinstance(key, tuple):
                out.append((key, self._cooling.pop(key)))
            else:  # a dropped mapping
                self.gate.unregister(key)
        return out

    @property
    def pending(self) -> int:
        """Batches released here whose copies have not finished (the leader waits for them)."""
        return len(self._cooling)

    def close(self) -> None:
        """Teardown with the follower's link (its loader and iterators are gone; possibly
        from a finaliser): no CUDA call. The gate keeps every mapping registered and
        mapped until a marker taken later completed; then the next gate activity of
        this process unregisters them (a held batch's once its last view died). The
        leader, seeing this rank's socket close, never rewrites what it held."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        gate, self.gate = self.gate, None
        if gate is None:
            return
        gate.defer()
        for key in gate.close():
            if not isinstance(key, tuple):
                gate.unregister(key)
        for mapping in self._registered.values():
            gate.unregister(mapping)
        self._registered = {}
        self._cooling = {}
