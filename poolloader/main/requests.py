"""How PoolLoaderIter (poolloader.main.iterator) sends its requests: DataLoader's
`_try_put_index`, call for call (each call draws its index and picks its worker when
DataLoader's does), the requests past a node pool rank's cap held and sent in the order
drawn, a slot taken, written and pushed with everything undone if the push did not
happen, and a slot grown and sent back to the worker that asked. A mixin: the
iterator's state is its own (set in its __init__ and _reset)."""
from __future__ import annotations

import itertools
from typing import Any

from poolloader.errors import ControlCorrupt, SlotCorrupt
from poolloader.main.ledger import new_ticket
from poolloader.shm._ring import claim_and_push
from poolloader.wire import slot_format as fmt

# What giving back a slot's pages costs main here (MADV_REMOVE / a hole punched in a
# memfd: ~5 ms for 66 MiB measured, 0.1 s per GiB allowed): _clean_top
RETURN_S_PER_BYTE = 0.1 / (1 << 30)


class RequestScheduling:
    """The request side of PoolLoaderIter."""

    # the iterator's (poolloader.main.iterator and torch's base class)
    _ledger: Any
    _held: Any
    _cap: int | None
    _cap_weight: int
    _cap_most: int
    _node: Any
    _node_gen: Any
    _send_idx: int
    _tasks_outstanding: int
    _picking: tuple[int, list]
    _sampler_exhausted: bool
    _epoch: Any
    _fail: Any
    _in_order: Any
    _int_list_requests: Any
    _next_index: Any
    _num_workers: Any
    _prefetch_factor: Any
    _puts_owed: Any
    _request_bells: Any
    _request_rings: Any
    _sent_indices: Any
    _share: Any
    _shared_seed: Any
    _task_info: Any
    _worker_queue_idx_cycle: Any
    _workers_num_tasks: Any
    _workers_status: Any
    _stats: Any
    _wait_mark: float
    _recent_wait: float

    def _try_put_index(self) -> None:
        """DataLoader's _try_put_index, call for call: each call draws its index and
        picks its worker now, as DataLoader's does, and sends them when it can. A draw
        that raises (the sampler's error) stays owed, drawn first by the next call (or
        next()); a send that raises (no shared memory for a slot, an index that cannot
        be pickled) keeps its index and worker held, sent first by the next call; so no
        index is lost and the prefetch depth comes back. An iterator with a cap (a node
        pool rank's share of the node's requests: poolloader.main.node) holds the
        requests past it until a batch is delivered; they go in the order drawn."""
        self._puts_owed += 1
        self._send_owed()

    def _send_owed(self) -> None:
        while self._puts_owed:
            self._draw()  # raises: still owed; each call that returns paid one
        self._send_held()

    def _send_held(self) -> None:
        held, cap = self._held, self._cap
        if cap is not None:  # a node pool rank's share, as the ranks sharing it are now
            # (of the processes it attached to; never past what its pool was sized for)
            cap = self._cap = min(self._cap_most, self._node.in_flight(
                self._num_workers, self._prefetch_factor, self._cap_weight, gen=self._node_gen))
        while held and (cap is None or self._slots_out() < cap):
            index, worker, seed = held[0]
            if self._workers_status[worker]:
                self._send(index, worker, seed)  # raises: still held
            else:
                # its worker ended meanwhile (iterable): DataLoader would have sent it
                # there (its send index taken), and nothing would have come of it
                self._send_idx += 1
                held.popleft()  # last: an interrupt comes after a call, never inside this pair

    def _slots_out(self) -> int:
        """The slots the requests hold until delivered, which the cap counts: in flight
        (an earlier epoch's too, while _reclaim_all takes them back) or READY. Counted
        afresh (at most the cap's entries), so no interrupt can leave a count behind."""
        ready = sum(len(info) == 2 for info in self._task_info.values())
        return len(self._ledger.inflight) + ready

    def _draw(self) -> None:
        """Draw one owed request's index and worker, as DataLoader's _try_put_index does,
        and hold them. A call an interrupt cuts short is redone by the next one with the
        same index (the resume tracker keeps it under its send index) and the workers
        the round robin already gave it (`_picking`), so nothing is skipped or moved."""
        max_tasks = self._prefetch_factor * self._num_workers
        seq = self._send_idx + len(self._held)
        try:
            index = self._next_index()
        except StopIteration:
            self._sampler_exhausted = True
            self._puts_owed -= 1
            return
        if self._picking[0] != seq:
            self._picking = (seq, [])
        picked = self._picking[1]  # the round robin's workers for this draw, in order
        k = 0
        while True:
            if k == len(picked):
                if k == self._num_workers:
                    self._puts_owed -= 1
                    return
                # taken from the round robin and recorded in one C-level call
                picked.extend(itertools.islice(self._worker_queue_idx_cycle, 1))
            worker = picked[k]
            k += 1
            if self._workers_status[worker]:
                if self._in_order:
                    break
                if self._workers_num_tasks[worker] < max_tasks // sum(self._workers_status):
                    break
        # drawn and counted as DataLoader counts it (the resume tracker has it under
        # the send index it will go with): held until sent, never dropped, with its
        # epoch's shared seed. The append is the only call: an interrupt (checked as a
        # call returns) comes before all three steps or after them
        self._workers_num_tasks[worker] += 1
        self._puts_owed -= 1
        self._held.append((index, worker, self._shared_seed))

    def _clean_top(self) -> None:
        """Give back the pages of the FREE slot the next take() hands out, if a batch
        wrote them (SlotLedger.dirty_top: at most once per RETURN_EVERY takes) and main
        has been waiting for its workers of late at least as long as that takes it
        (RETURN_S_PER_BYTE): the next request then waits in a clean slot, which the next
        call can keep clean by moving it. Otherwise a pool whose workers take their
        requests at once pays nothing (the next batch written there would fault every
        page in again)."""
        ledger = self._ledger
        slot = ledger.dirty_top()
        if slot is None:
            return
        waited = max(self._recent_wait, self._stats.main_wait_s - self._wait_mark)
        if waited >= RETURN_S_PER_BYTE * ledger.pool.size(slot):
            ledger.clean_top()

    def _move_newest(self) -> None:
        """Move the last request sent to a FREE slot that a batch has written, if it
        went into a clean slot (no batch wrote its pages: a memory cgroup is not
        charged for them) and its worker has not started on it: the clean slot is
        FREE again, for the request about to be sent, so a `for` loop's pool keeps one
        slot clean (issue 45). The request goes when DataLoader's would (it was sent
        at its call), to the same worker, in the same place of that worker's order
        (nothing was pushed since): its worker, popping the old entry, finds the claim
        taken and skips it (poolloader.worker.loop.claimed). A move that loses the
        race to its worker leaves everything as it was. O(1): a header copy, one
        atomic swap and one push.

        Every step until the swap-and-push (one C call) is recorded in
        `ledger.moving` first, so an interrupt anywhere leaves it to _settle_move."""
        ledger = self._ledger
        slot, ticket, worker = ledger.newest
        ledger.newest = None
        if slot not in ledger.inflight:
            return
        target = ledger.move_target(slot)
        if target is None:
            return
        ring = self._request_rings[worker]
        if len(ring) >= ring.capacity:  # its stale entry needs a cell too, until popped
            return
        fmt.copy_request(ledger.mapping(slot), ledger.header(slot), ledger.mapping(target),
                         ledger.header(target))
        control = ledger.pool.control
        moved_ticket = new_ticket()
        control.claims[target] = moved_ticket
        moved: list = []
        ledger.moving = (slot, target, moved)
        ledger.free.pop()  # `target`, on top (move_target)
        ledger.inflight[target] = ledger.inflight[slot]
        self._sent_indices[target] = self._sent_indices.get(slot)
        moved.extend(itertools.starmap(claim_and_push, (
            (control.mapping, control.layout.claim_offset(slot), ticket, ring,
             fmt.ring_value(target, moved_ticket)),)))
        self._settle_move()

    def _settle_move(self) -> None:
        """Record the move in `ledger.moving` (also for one an interrupt cut short; each
        step may run twice): the request's old slot FREE and clean if the move won its
        claim, else the target FREE again."""
        ledger = self._ledger
        source, target, moved = ledger.moving
        won = bool(moved) and moved[0] != 0
        back = source if won else target  # main's again: FREE
        ledger.inflight.pop(back, None)
        self._sent_indices.pop(back, None)
        if back not in ledger.free:
            ledger.free.append(back)
        if won:
            ledger.clean.add(source)
            ledger.stats.requests_moved += 1  # (twice if an interrupt makes this run again)
        elif moved:
            # its worker took it first, into the clean slot, while the target's pages
            # are charged for a batch that is dead: they may go back now, before that
            # worker writes its batch, so the pool's charge stays where it was
            self._clean_top()
        if won and moved[0] == 1 and self._request_bells is not None:
            # before `moving` is cleared: an interrupt before the ring leaves it to the
            # next call's settle (a second ring only wakes the worker once more)
            self._request_bells[ledger.inflight[target][1]].ring()
        ledger.moving = None
        if won and moved[0] != 1:  # the request is nowhere now: nothing can go on
            worker = ledger.inflight[target][1]
            error: Exception = SlotCorrupt(
                f"internal error: the request ring of worker {worker} is full")
            if moved[0] == 3:
                error = ControlCorrupt(
                    f"the request ring of worker {worker} refused a moved request (closed, "
                    "or its shared fields overwritten)")
            self._fail(error)
            raise error

    def _send(self, index, worker: int, seed) -> None:
        """Write and push the first held request. Everything it records is recorded
        before the push, and the push marks itself in the same C call
        (SlotLedger.push): an exception before the push (no space, an index that
        cannot be pickled, an interrupt) undoes all of it, keeping the request held
        for the retry; one after the push (a signal handler's) leaves it sent, once."""
        ledger = self._ledger
        if ledger.newest is not None:
            self._move_newest()
        plain = ledger.gate is None and self._share is None and self._node is None
        if plain:
            self._clean_top()  # after a time the workers took every request at once
        seq, outstanding, held = self._send_idx, self._tasks_outstanding, self._held
        request_held = held[0]
        ring = self._request_rings[worker]
        pushed: list = []
        try:
            request = fmt.encode_request(index, self._int_list_requests)
            if self._share is not None:
                self._share.collect()  # the followers' releases: slots take() may reuse
            needed = fmt.request_slot_bytes(request)  # 0: it fits the request area
            slot = ledger.take(needed)
            fmt.write_request(ledger.mapping(slot), ledger.header(slot), seq,
                              self._epoch, worker, request, seed)
            ledger.inflight[slot] = (seq, worker)
            self._sent_indices[slot] = index
            self._task_info[seq] = (worker,)
            self._tasks_outstanding = outstanding + 1
            self._send_idx = seq + 1
            held.popleft()
            ticket = ledger.push(ring, slot, pushed)
            if not pushed[0]:
                raise SlotCorrupt(f"internal error: the request ring of worker {worker} is "
                                  f"full ({ring.capacity} cells, two per slot)")
            # a request too large for the request area lies in the data pages: the slot
            # is written already, and moving the request would call it clean
            movable = ledger.took_clean and plain and not needed
            ledger.newest = (slot, ticket, worker) if movable else None
            if self._request_bells is not None:
                self._request_bells[worker].ring()
        except BaseException as e:
            if pushed and pushed[0]:
                ledger.taking = None
                raise  # the request went out: an exception after the push keeps it
            taken = ledger.taking
            if taken is not None:
                ledger.inflight.pop(taken, None)
                self._sent_indices.pop(taken, None)
            ledger.put_back()
            self._task_info.pop(seq, None)
            self._tasks_outstanding = outstanding
            self._send_idx = seq
            if not held or held[0] is not request_held:
                held.appendleft(request_held)
            if isinstance(e, ControlCorrupt) or pushed:  # a broken ring, or a full one
                self._fail(e)
            raise
        ledger.taking = None

    def _grow_and_resend(self, slot: int) -> None:
        """`slot` is ledger.returned[0] with a request to grow: a bigger segment, then
        back to its worker, which holds the batch for it."""
        ledger = self._ledger
        seq, worker = ledger.inflight[slot]
        pushed: list = []
        try:
            ledger.grow(slot, fmt.needed_bytes(ledger.header(slot)), worker)
            fmt.stamp(ledger.header(slot), seq, self._epoch, worker)
            ledger.returned.popleft()
            if ledger.newest is not None and ledger.newest[2] == worker:
                ledger.newest = None  # behind it on its worker's ring now: stays where it is
            ledger.push(self._request_rings[worker], slot, pushed)
            if not pushed[0]:
                raise SlotCorrupt(f"internal error: the request ring of worker {worker} is full")
            if self._request_bells is not None:
                self._request_bells[worker].ring()
        except BaseException as e:
            if not (pushed and pushed[0]):
                # the worker holds the batch and waits for this slot, which did not
                # go back: nothing can continue, so stop everything (a clear error
                # from then on) rather than wait for it forever
                self._fail(e)
            raise
