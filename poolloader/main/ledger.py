"""Main's ledger of slots: who owns each one, and the rules for sizing and reuse.

Slot states, all owned by main except IN_WORKER (invariant 1):

    FREE       in `free` (or cooling behind a CUDA event in the gate)
    IN_WORKER  in `inflight`: pushed on the worker's request ring; still in `inflight`
               once popped from the worker's done ring, in `returned` (popped, not
               yet handled) until the iterator records where it goes next
    READY      back from its worker, not yet delivered (the iterator's reorder buffer)
    LEASED     delivered: a Lease (poolloader.shm._shm) views its data region and is
               registered in `leases`; when the lease dies its weakref lands on
               `released` (a C-level deque.append, any thread) and `drain()` makes
               the slot FREE again

Ownership (docs/how-it-works.md, "Ownership mechanisms"): a request never waits for
the consumer. When a request
needs a slot and none is FREE, the oldest LEASED slot is *detached*: its segment
leaves the pool and stays with the batch that still views it (like a DataLoader
batch, freed when its last tensor dies), and the slot gets a fresh segment. A slot
whose mapping was inherited by a forked child (`Mapping.forked`, set by the fork
hook in poolloader.shm.fork) is detached when its batch is released, never reused.
A detached segment is unmapped the moment its batch's last view dies (the Lease holds
the only reference to it), not at the next take(); only with a CUDA gate does it wait
for the next take() (its unregistration is a CUDA call, which no finaliser may make).

Interrupts (KeyboardInterrupt, or any exception a signal handler raises) run only
between bytecodes: a step that must not be split is one C-level call. A reply is
popped from its done ring and appended to `returned` in one call
(poolloader.main.supervise.Replies), and a request is pushed on its ring and marked
pushed in one call (`push`), so an interrupt never leaves a slot in `inflight` that
no worker has and no reply stands for.
"""
from __future__ import annotations

import collections
import itertools
import weakref
from typing import NamedTuple

from poolloader.cuda.gate import COOL_TIMEOUT_S
from poolloader.errors import ShmSpaceError, SlotCorrupt, warn
from poolloader.shm.backend import page_round, retire
from poolloader.shm.pool import SlotPool
from poolloader.wire import slot_format as fmt

# Headroom when a slot grows.
GROWTH_FACTOR = 1.25
# Slots beyond num_workers * prefetch_factor for batches the consumer holds.
SPARE_SLOTS = 2

# A FREE slot that no request took for this many takes while others were taken is
# more than the pool needs: its pages are given back (SlotLedger._return_idle).
IDLE_TAKES = 16

# SlotLedger.clean_top gives a slot's pages back at most once per this many takes (a
# move lost to its worker, or a pool that kept no clean slot: PoolLoaderIter._clean_top)
RETURN_EVERY = 16

# A share_batches hold that is never given back (SlotLedger.share_abandon).
_NEVER = 1 << 62

# Every request pushed by this process gets a ticket of its own (slot_format.ring_value):
# one counter for all ledgers, so a ring's stale entry never matches a later request.
_TICKETS = itertools.count(1)


def new_ticket() -> int:
    """A ticket no request of this process had (never 0; slot_format.ring_value)."""
    ticket = next(_TICKETS)
    if ticket >= fmt.TICKET_LIMIT:  # 2**39 requests: 1.7 years at 10000 a second
        raise RuntimeError(f"this process has sent {fmt.TICKET_LIMIT - 1} requests, the most "
                           "a request ring's value can number: start a new process")
    return ticket


def default_slots(in_flight: int) -> int:
    return in_flight + SPARE_SLOTS


def slot_capacity(slots: int, in_flight: int, max_slots: int | None = None) -> int:
    """Slots the pool grows to before a held batch is detached: the iterator's requests
    in flight (DataLoader's num_workers × prefetch_factor; a node pool rank's share)
    plus the batch being delivered and the one a `for` loop still holds, so the common
    loop never detaches (a smaller slots= grows to this once: pool_growths); never past
    `max_slots`."""
    capacity = max(slots, default_slots(in_flight))
    return capacity if max_slots is None else min(capacity, max_slots)


class Sizing(NamedTuple):
    slots: int  # segments made at start
    capacity: int  # slots before a held batch is detached
    max_slots: int  # the control block's ring size: never more slots than this
    slot_bytes: int  # each new segment's size


def plan_sizes(loader, gated: bool, in_flight: int, most_in_flight: int | None = None) -> Sizing:
    """A new pool's sizes from the loader's knobs and the requests its iterator keeps
    in flight (`most_in_flight`: the most it may keep later, a node pool rank's share
    as ranks leave; the capacity allows for it, the slots made at start do not). With a
    CUDA gate, as many slots again may cool behind copies; a previous pool of this
    loader already learned how big batches are (stats.learned_slot_bytes)."""
    slots = loader.slots if loader.slots is not None else default_slots(in_flight)
    capacity = slot_capacity(slots, max(in_flight, most_in_flight or 0), loader.max_slots)
    max_slots = loader.max_slots if loader.max_slots is not None else capacity * (2 if gated else 1)
    slot_bytes = max(loader.slot_bytes, loader.stats.learned_slot_bytes, fmt.MIN_SLOT_BYTES)
    return Sizing(min(slots, max_slots), capacity, max_slots, slot_bytes)


def check_addressable(size: Sizing, loader, in_flight: int) -> None:
    """A request ring's value has SLOT_BITS for the slot (slot_format.ring_value)."""
    if size.max_slots > fmt.MAX_SLOTS:
        raise ValueError(
            f"a pool of {size.max_slots} slots is more than the {fmt.MAX_SLOTS} a PoolLoader "
            f"can address (slots={loader.slots}, max_slots={loader.max_slots}, num_workers × "
            f"prefetch_factor = {in_flight}): pass a smaller max_slots= or prefetch_factor=")


class SlotLedger:
    """`capacity`: slots the pool grows to before a held batch is detached; with a CUDA
    `gate`, slots cooling behind copies count as in flight, and the pool may grow past
    `capacity` up to the pool's max_slots rather than wait for them."""

    def __init__(self, pool: SlotPool, stats, gate=None, capacity: int | None = None):
        self.pool = pool
        self.gate = gate
        self.stats = stats
        self.capacity = pool.max_slots if capacity is None else capacity
        self.free: list[int] = list(range(pool.num_slots - 1, -1, -1))
        self.inflight: dict[int, tuple[int, int]] = {}  # slot -> (seq, worker)
        # (slot, worker) of replies popped from the done rings, oldest first: each
        # stays here (and in `inflight`) until the iterator has recorded it elsewhere
        self.returned: collections.deque = collections.deque()
        self.leases: dict = {}     # weakref to a Lease -> slot; oldest first
        # weakref to a Lease -> weakref to its mapping, out of the pool: the lease holds
        # the mapping, so it is unmapped when the batch's last view dies
        self.detached: dict = {}
        # with a CUDA gate, the same mappings held until drain() unregisters them
        self._registered_detached: dict = {}
        # the slot take() last handed out, until its caller recorded it (put_back)
        self.taking: int | None = None
        self.released: collections.deque = collections.deque()
        self.on_release = self.released.append  # C-level: no bytecode in the callback
        self._headers: dict[int, tuple[object, object]] = {}
        self._warned_detach = False
        # share_batches (poolloader.main.share): slot -> [generation, batches of it the
        # followers still hold]; `parked`: such slots whose views here are gone too
        self.shared: dict[int, list[int]] = {}
        self.parked: set[int] = set()
        # idle slots' pages (_return_idle): takes so far, the take count at which
        # each FREE slot was freed, and how many slots at the bottom of `free` gave
        # their pages back already (LIFO: the bottom is what no take wanted longest)
        self._takes = 0
        self._freed_at: dict[int, int] = {}
        self._emptied = 0
        # slots whose data pages no batch wrote (a new segment, or pages given back): a
        # request sent in one of them may move to a written FREE slot before its worker
        # starts on it (PoolLoaderIter._move_newest); `newest`: (slot, ticket, worker)
        # of the last request sent, if it went into such a slot and nothing was pushed
        # to its worker since; `moving`: (from, to, [result]) of a move until recorded
        self.clean: set[int] = set(range(pool.num_slots))
        self.took_clean = False
        self.newest: tuple[int, int, int] | None = None
        self.moving: tuple[int, int, list] | None = None
        self._cleaned_at = -RETURN_EVERY  # the take count at the last clean_top()

    # -- views of a slot --------------------------------------------------------
    def mapping(self, slot: int):
        return self.pool.mappings[slot]

    def fresh_view(self, slot: int, header):
        """The mapping to decode `slot`'s new batch (its `header`) from: a share_batches
        leader's private view, renewed for it (poolloader.shm.pool, renew_view: the
        slot was FREE, so no view of its last batch is alive), else the slot's mapping."""
        pool = self.pool
        if pool.views is None:  # no private views (the usual case): nothing to renew
            return pool.mappings[slot]
        pool.renew_view(slot, fmt.DATA_OFF, fmt.reply_end(header, pool.size(slot)))
        return pool.view(slot)

    def header(self, slot: int):
        mapping = self.pool.mappings[slot]
        cached = self._headers.get(slot)
        if cached is None or cached[0] is not mapping:
            cached = self._headers[slot] = (mapping, fmt.header_view(mapping))
        return cached[1]

    # -- FREE -----------------------------------------------------------------------
    def take(self, min_bytes: int = 0) -> int:
        """A slot for a new request (at least `min_bytes`, and the current target
        size), now: FREE; else a new one up to `capacity` (on CUDA, further while slots
        cool); else a cooling one (bounded wait); else the oldest LEASED one, detached.
        A refill or replacement that fails (no space) puts the slot back FREE, empty,
        before the error is raised. A share_batches leader's iterator collects its
        followers' releases first (ShareLeader.collect): the ledger holds slot states
        only. The slot is also left in `taking` until the caller
        clears it (an interrupt as take() returns: see put_back)."""
        if self.released:
            self.drain()
        gate = self.gate
        if gate is not None and gate.pending:
            self._take_ready(gate.ready())
        if self.free:
            slot = self.free.pop()
        elif self.pool.num_slots < self.capacity:
            slot = self._add()
        elif gate is not None and (gate.pending or self.parked) \
                and self.pool.num_slots < self.pool.max_slots:
            # cooling slots come back by themselves, and so do the ones only followers
            # still hold (share_batches: theirs cool behind their own copies): grow,
            # do not wait, and do not detach
            slot = self._add()
            self.stats.cooling_growths += 1
        else:
            slot = self._reclaim()
        pool = self.pool
        try:
            mapping = pool.mappings[slot]
            if mapping is None:
                self._refill(slot)
                mapping = pool.mappings[slot]
            wanted = pool.target_bytes if min_bytes <= pool.target_bytes else min_bytes
            if mapping is None or mapping.size < wanted:
                if mapping is not None:  # its old contents are dead: gone before the check
                    pool.return_pages(slot, fmt.DATA_OFF)
                self.replace(slot, wanted)
        except BaseException:
            # the slot is still main's: FREE again (empty if its old segment went), so
            # a later take() refills it instead of the epoch running one slot short
            self._headers.pop(slot, None)
            self.free.append(slot)
            raise
        self.taking = slot
        self._takes += 1
        self._freed_at.pop(slot, None)
        clean = self.clean
        self.took_clean = slot in clean
        clean.discard(slot)
        self._return_idle()
        return slot

    def _return_idle(self) -> None:
        """The FREE slot just above those at the bottom of the LIFO free list that gave
        their pages back already has been FREE longer than any other: if no take
        wanted it for IDLE_TAKES takes, the pool is deeper than its requests and the
        batches held need, so its data pages go back to the system (the header and
        request area stay): a memory cgroup is charged for what is in flight, not for
        how deep the pool once had to be. A later take reuses the slot as it is; a
        batch written there faults its pages in again. A few comparisons per take,
        one slot at most. Never a slot with a view alive: only FREE slots are in
        `free`. On CUDA (registered slots) and for share_batches leaders nothing is
        returned (SlotPool.return_pages)."""
        free = self.free
        emptied = self._emptied = min(self._emptied, len(free))  # pops reached into them
        if emptied == len(free):
            return
        slot = free[emptied]
        freed = self._freed_at.setdefault(slot, self._takes)
        if self._takes - freed < IDLE_TAKES:
            return
        self._emptied = emptied + 1
        if self.pool.return_pages(slot, fmt.DATA_OFF):
            self.stats.pages_returned += 1
            self.clean.add(slot)

    def put_back(self) -> None:
        """The caller of take() could not record the slot it got (an error or an
        interrupt before its request was recorded): FREE again."""
        slot, self.taking = self.taking, None
        if slot is not None and slot not in self.inflight:
            self.give_back(slot)

    def push(self, ring, slot: int, pushed: list) -> int:
        """Push the request in `slot` on `ring` (a request ring, with room for every
        slot) under a new ticket (its claim word in the control block, and the ring
        value's high bits: slot_format.ring_value) and append try_push's result to `pushed`, in one C-level
        call: whatever a signal handler raises, `pushed` says whether the slot went
        out. Returns the ticket."""
        ticket = new_ticket()
        self.pool.control.claims[slot] = ticket
        pushed.extend(itertools.starmap(type(ring).try_push,
                                        ((ring, fmt.ring_value(slot, ticket)),)))
        return ticket

    def dirty_top(self) -> int | None:
        """The FREE slot the next take() hands out (on top of `free`) if a batch wrote
        its pages and clean_top() has not run for RETURN_EVERY takes; else None."""
        if self.released:
            self.drain()
        free = self.free
        if not free or free[-1] in self.clean or self._takes - self._cleaned_at < RETURN_EVERY:
            return None
        return free[-1]

    def clean_top(self) -> None:
        """Give back the pages of dirty_top()'s slot (returning 66 MiB costs main ~5 ms,
        and the next batch written there the page faults): PoolLoaderIter._clean_top."""
        slot = self.free[-1]
        self._cleaned_at = self._takes
        if self.pool.return_pages(slot, fmt.DATA_OFF):
            self.stats.pages_returned += 1
            self.clean.add(slot)

    def move_target(self, slot: int) -> int | None:
        """Where the request in `slot` (a clean one) may move: the FREE slot on top of
        `free` (the batch the consumer dropped last), if a batch wrote its pages and it
        is as big as `slot`; else None."""
        if self.released:
            self.drain()
        free = self.free
        if not free:
            return None
        target = free[-1]
        pool = self.pool
        if target in self.clean or pool.mappings[target] is None or pool.size(target) < pool.size(slot):
            return None
        return target

    def settle(self) -> None:
        """Drop the replies at the front of `returned` that were handled (their slot
        left `inflight`) but not yet removed: an interrupt came between the two. Only
        at the start of a call, before any slot can be reused."""
        returned, inflight = self.returned, self.inflight
        while returned and returned[0][0] not in inflight:
            returned.popleft()

    def _reclaim(self) -> int:
        """The pool may not grow: wait (bounded) for a slot cooling behind CUDA copies,
        which costs nothing but time, else detach the oldest held batch."""
        gate = self.gate
        if gate is not None and gate.pending:
            self._take_ready(gate.wait_any(COOL_TIMEOUT_S))
            if self.free:
                return self.free.pop()
        if self.parked:  # only followers hold it: their mappings keep the segment
            slot = self.parked.pop()
            self._unshare(slot)
            self._renew(slot)
            self.stats.detaches += 1
            return slot
        if self.leases:
            return self._detach_oldest()
        if gate is not None and gate.pending:
            raise RuntimeError(
                f"PoolLoader: all {self.pool.num_slots} slots wait for CUDA copies that have "
                f"not finished after {COOL_TIMEOUT_S:.0f} s; a stream seems stuck.")
        raise SlotCorrupt(f"internal error: all {self.pool.num_slots} slots are in flight")

    def give_back(self, slot: int) -> None:
        """A slot main owns and no view of which was delivered."""
        if self.gate is not None:
            self.gate.release(slot)  # FREE once every copy that may read it is done
        else:
            self._freed_at[slot] = self._takes
            self.free.append(slot)

    def drain(self) -> None:
        """Take back the slots (and detached segments) whose last view died."""
        released, leases = self.released, self.leases
        while released:
            ref = released.popleft()
            slot = leases.pop(ref, None)
            if slot is None:
                self.detached.pop(ref, None)  # unmapped already (no gate), when the lease died
                mapping = self._registered_detached.pop(ref, None)
                if mapping is not None:
                    self._retire(mapping)
                continue
            if slot in self.shared:
                self.parked.add(slot)  # a follower still holds it (share_back frees it)
                continue
            self._free_viewed(slot)

    def _free_viewed(self, slot: int) -> None:
        """The last view of a delivered slot died: FREE again."""
        mapping = self.pool.view(slot)  # the one its batches viewed (a fork marks it)
        if mapping is not None and mapping.forked:
            self._renew(slot)  # a forked child may still read it: never rewrite it
        self.give_back(slot)

    def _renew(self, slot: int) -> None:
        """Another process may still read `slot`'s segment: it leaves the pool (retired
        here, kept by whoever maps it) and the slot is refilled with a new one when taken."""
        self._headers.pop(slot, None)
        self._retire(self.pool.detach(slot))

    # -- share_batches: the followers' holds (poolloader.main.share) --------------------
    def share_out(self, slot: int, generation: int) -> None:
        """A follower got the batch in `slot`: the slot waits for its release too."""
        entry = self.shared.setdefault(slot, [generation, 0])
        entry[1] += 1

    def share_back(self, slot: int, generation: int) -> None:
        """A follower dropped (or left with) the batch of that slot's `generation`; a
        segment detached since is the follower's own, nothing to give back."""
        entry = self.shared.get(slot)
        if entry is None or entry[0] != generation:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del self.shared[slot]
        if slot in self.parked:
            self.parked.discard(slot)
            self._free_viewed(slot)

    def share_abandon(self, slot: int, generation: int) -> None:
        """A follower may read that slot's segment from now on without saying when it
        stops (it left with a batch still viewed, or a child it forked inherited the
        mapping): the slot never comes back FREE with that segment; it is detached
        when a slot is needed (_reclaim: parked first)."""
        entry = self.shared.get(slot)
        if entry is not None and entry[0] == generation:
            entry[1] = _NEVER

    def _unshare(self, slot: int) -> None:
        self.shared.pop(slot, None)
        self.parked.discard(slot)

    def _take_ready(self, keys) -> None:
        for key in keys:
            if isinstance(key, int):
                self.free.append(key)
            else:  # a detached mapping whose copies have finished
                self.pool.unmap(key)

    def _retire(self, mapping) -> None:
        if self.gate is not None:
            self.gate.release(mapping)  # unregistered and dropped once its copies are done
        else:
            retire(mapping)

    # -- detach, grow ------------------------------------------------------------------
    def _detach_oldest(self) -> int:
        ref = next(iter(self.leases))
        slot = self.leases.pop(ref)
        self._unshare(slot)  # the followers' mappings keep their segment
        self._headers.pop(slot, None)
        mapping = self.pool.detach(slot)
        self.detached[ref] = weakref.ref(mapping)
        if self.gate is not None:
            self._registered_detached[ref] = mapping
        self.stats.detaches += 1
        if not self._warned_detach:
            self._warned_detach = True
            warn(
                f"PoolLoader: the consumer still holds batches in all {self.pool.num_slots} "
                "slots; the oldest ones are detached from the pool (they stay valid and are "
                "freed when dropped) and their slots get new shared memory. That costs a new "
                "segment per batch: pass a larger slots= if you keep batches on purpose.")
        return slot

    def _add(self) -> int:
        try:
            slot = self.pool.add_slot()
        except ShmSpaceError as e:
            raise self._space_error(e) from None
        self.stats.pool_growths += 1
        self.clean.add(slot)
        return slot

    def _refill(self, slot: int) -> None:
        try:
            self.pool.refill(slot)
        except ShmSpaceError as e:
            raise self._space_error(e) from None
        self.clean.add(slot)

    def replace(self, slot: int, nbytes: int, written: int | None = None) -> None:
        self._headers.pop(slot, None)
        try:
            self.pool.replace(slot, nbytes, written)
        except ShmSpaceError as e:
            raise self._space_error(e) from None
        self.stats.slot_growths += 1
        if written is None:
            self.clean.add(slot)
        else:  # grown for a batch its worker holds: written next
            self.clean.discard(slot)

    def grow(self, slot: int, needed: int, worker: int) -> None:
        """A worker needs `slot` to hold `needed` bytes: a fresh, larger segment."""
        if needed <= self.pool.size(slot):
            raise SlotCorrupt(f"worker {worker} asked for {needed} bytes for slot {slot}, "
                              f"which already has {self.pool.size(slot)}")
        # the old segment stays charged meanwhile: the worker's batch may still view it
        self.replace(slot, page_round(int(needed * GROWTH_FACTOR)), written=needed)

    def held_bytes(self) -> int:
        """Shared memory that batches the consumer still holds keep alive."""
        held = self.detached_bytes()
        pool = self.pool
        return held + sum(pool.size(slot) for slot in self.leases.values())

    def detached_bytes(self) -> int:
        """Shared memory of detached batches the consumer still holds (a view alive)."""
        total = 0
        for ref in list(self.detached.values()):  # a lease may die meanwhile (any thread)
            mapping = ref()
            if mapping is not None and not mapping.closed and mapping.leases:
                total += mapping.size
        return total

    def _space_error(self, error: ShmSpaceError) -> ShmSpaceError:
        held = self.held_bytes()
        if not held:
            return error
        return ShmSpaceError(
            f"{error} Batches the consumer still holds keep {held} bytes of it "
            f"({len(self.leases) + len(self.detached)} batches): drop the ones you no longer "
            "need, or keep copies (tensor.clone()) of what you keep.")

    # -- end ----------------------------------------------------------------------------------
    def reset_free(self) -> None:
        """Every slot not in flight and not leased is FREE (persistent workers, new epoch):
        also takes back any slot an interrupted call left in between."""
        self.taking = None
        self.drain()
        leased = set(self.leases.values()) | set(self.shared)
        cooling = set(self.gate.cooling_keys()) if self.gate is not None else set()
        self.free = [s for s in range(self.pool.num_slots - 1, -1, -1)
                     if s not in leased and s not in self.inflight and s not in cooling]
        self._emptied = 0  # a new order: idle slots are found again (returning twice is harmless)
        self.newest = None

    def close(self) -> None:
        """Before the pool closes (workers stopped). With a gate: wait (bounded) for the
        copies that may read a slot, then unregister the detached mappings too; each
        detached mapping is unmapped when its batch's last view dies."""
        self._headers.clear()
        if self.gate is not None:
            for key in self.gate.close():
                if not isinstance(key, int):
                    self.pool.unmap(key)
            for mapping in self._registered_detached.values():
                self.pool.unmap(mapping)
        self._registered_detached.clear()
        self.detached.clear()
