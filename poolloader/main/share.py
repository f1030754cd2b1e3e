"""Identical batches once: PoolLoader(share_batches=[global ranks]) under torchrun.

Ranks that consume the same batches (a tensor- or context-parallel group, ranks that
evaluate the same data) name each other in `share_batches`. On each node, the lowest
of the group's ranks there is the *leader*: its loader runs as any PoolLoader (its own
workers, or a node pool's) and, as it delivers each batch, hands the same slot to the
group's other ranks on the node, the *followers*. A follower starts no worker: it
maps the leader's segment (the memfd descriptor travels once per segment over an
abstract SOCK_SEQPACKET socket, SCM_RIGHTS) and decodes the batch from the same
physical pages, no copy. A group that spans nodes is made once per node.

What keeps it exact and safe:

* Each rank's batch is its own. Every rank, the leader included, decodes its batches
  from its own copy-on-write mapping of the slot (MAP_PRIVATE: the leader's pool keeps
  one beside each slot's shared mapping, poolloader.shm.pool `private_views`; a
  follower maps the descriptor it gets so): reads map the segment's pages, so no page
  is copied while nobody writes, and a write (x.sub_(mean)) copies only the page it
  touches, in that rank alone. Before the next batch in the slot is decoded, the rank
  drops the pages it copied (`renew`, MADV_DONTNEED), so the view shows the workers'
  new batch. The slot is then reused, so no view of this rank's last batch in it is
  alive (below); a batch kept longer keeps its segment (a detach). On CUDA the view is
  registered, and a pin cannot stay copy-on-write: its pages are made the rank's own
  before registration, kept, and each batch is copied in from the segment's shared
  mapping (docs/node.md, share_batches, "On CUDA").

* Each follower still iterates its own sampler and compares each batch's indices
  with the leader's: ranks whose samplers disagree get an error at the first batch
  that differs, never another rank's data. So share_batches needs a map-style
  dataset and in_order=True.
* A slot is reused only after the leader and every follower dropped the batch in it
  (poolloader.main.ledger: `shared`, `parked`); a follower says so with its next
  next(). If the leader runs out of slots meanwhile, it detaches the segment, as it
  does for a batch its own consumer keeps: the followers' mappings keep it alive.
* On CUDA (pin_memory=True, device=) each rank registers its own private mapping of a
  segment once, and a follower's release reaches the leader only once its own copies
  from the batch finished (poolloader.main.share_cuda); the leader's own copies gate it
  as any pool's (its SlotGate).
* A follower that exits gives back what it held (its socket closes) and the others go
  on, with a warning on the leader; a leader that exits, or whose iterator fails, is an
  error on every follower at its next wait (the socket closes, or says why).

The parts: this module plans a group and joins it; poolloader.main.share_leader and
poolloader.main.share_follower are the two sides; poolloader.main.follower_iter is a
follower's iterator.

Rendezvous (poolloader.main.rendezvous): the group's loaders meet where they are built
in the program, by a name that carries the job, the group's ranks on this node and that
place; the leader listens, each follower connects. Both ends check the peer
(SO_PEERCRED) before anything is unpickled, and a follower whose loader differs from the
leader's (dataset class and length, collate_fn, batch_size, drop_last, num_workers,
worker_init_fn, persistent_workers, the resume options: `fingerprint`) is refused at
construction.
The group is made at the leader's first batch, which waits for its followers up to
POOLLOADER_SHARE_WAIT from its first iter(), as a follower waits for its leader's loader
when it builds its own; a rank that did not come by then loads on its own (its own
workers, the same batches) for that loader's life, so a loader only some ranks build (an
evaluation on rank 0) costs that wait once per place, never an error (`_missed`).
"""
from __future__ import annotations

import os
import weakref

from torch.utils.data import IterableDataset

from poolloader.errors import warn
from poolloader.main import rendezvous
from poolloader.main.share_follower import ShareFollower, Unshared
from poolloader.main.share_leader import ShareLeader

# Slots the leader's pool gets beyond its own needs: the batches its followers still
# hold when it takes a slot (the one each consumes and the one whose release rides
# with its next next()).
SHARE_SLACK = 2
# (the group's ranks here, build site) -> the ranks that did not come to the last loader
# built there (a loader only some ranks build: an evaluation on rank 0): the next one
# built there does not wait for them (join)
_missed: dict[tuple[str, str], set[int]] = {}


def members(share_batches) -> list[int] | None:
    """The global ranks of `share_batches` (a list of ints or a ProcessGroup); None: none;
    []: a ProcessGroup this rank is not in."""
    if share_batches is None:
        return None
    try:
        import torch.distributed as dist
        if dist.is_available() and isinstance(share_batches, dist.ProcessGroup):
            return sorted(dist.get_process_group_ranks(share_batches))
        if dist.is_available() and dist.is_initialized() \
                and share_batches is dist.GroupMember.NON_GROUP_MEMBER:
            return []  # what new_group(ranks) gives a rank not in `ranks`: not a member
    except (ImportError, RuntimeError):
        pass
    try:
        ranks = list(share_batches)
    except TypeError:
        ranks = None
    if ranks is None or not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0
                                         for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"share_batches must be a list of distinct global ranks (ints >= 0) or "
                         f"a torch.distributed ProcessGroup, got {share_batches!r}")
    return sorted(ranks)


def plan(ranks: list[int] | None):
    """(leader's global rank, this rank, the followers on this node, run key) when this
    rank shares its batches with another rank of this node; None otherwise (not under
    torchrun or an initialised torch.distributed, not a member, or the only member
    here): an ordinary loader."""
    if ranks is None:
        return None
    # also on a rank outside the group: through torch.distributed every rank of the world
    # takes part in finding the node, once (rendezvous._dist_group)
    group = rendezvous.local_group()
    if not ranks or group is None or group.ranks is None:
        return None
    rank = group.ranks[group.rank]
    if rank not in ranks:
        return None
    here = [r for r in ranks if r in group.ranks]
    if len(here) < 2:
        return None
    return here[0], rank, here[1:], group.run_key


def check(loader) -> None:
    """What share_batches needs of a loader, checked at construction."""
    problems = []
    if loader.num_workers < 1:
        problems.append(f"num_workers={loader.num_workers} (the leader's workers make the "
                        "batches: use num_workers >= 1)")
    if isinstance(loader.dataset, IterableDataset):
        problems.append("an IterableDataset (each follower checks the leader's sample indices "
                        "against its own sampler's: use a map-style dataset)")
    if not loader.in_order:
        problems.append("in_order=False (the batches' order would differ between ranks)")
    backend = loader.shm_backend or os.environ.get("POOLLOADER_SHM_BACKEND")
    if backend not in (None, "", "memfd"):
        problems.append(f"shm_backend={backend!r} (followers map the leader's memfd segments)")
    if problems:
        raise ValueError("PoolLoader(share_batches=...) cannot share this loader's batches: "
                         + "; ".join(problems) + ". Or pass share_batches=None.")


def join(loader, share_batches) -> ShareLeader | ShareFollower | None:
    """This loader's side of its share_batches group on this node (None: it shares
    nothing here); the group's loaders meet where they are built in the program
    (poolloader.main.rendezvous); closed when the loader is collected."""
    found = plan(members(share_batches))
    if found is None:
        return None
    check(loader)
    os.environ[rendezvous.RANK_PID_ENV] = str(os.getpid())  # its children are not ranks
    leader, rank, followers, run_key = found
    here = "-".join(map(str, (leader, *followers)))  # [0, 1] and [0, 2] do not meet
    site = rendezvous.build_site()
    address = rendezvous.address(run_key, rendezvous.place(f"share/{here}", site))
    missed = _missed.setdefault((here, site), set())
    wait = rendezvous.share_wait()
    side: ShareLeader | ShareFollower
    if rank == leader:
        what = f"PoolLoader(share_batches=...) on rank {rank}"
        listener = rendezvous.listen(address, what)
        if listener is None:
            rendezvous.close_socket(rendezvous.connect(address, what))
            raise RuntimeError(f"{what}: another process of this job listens for this loader's "
                               "followers (internal error: a place built twice)")

        def on_missed(ranks: set[int]) -> None:
            missed.clear()
            missed.update(ranks)
        side = ShareLeader(loader, listener, rank, followers, wait,
                           [r for r in followers if r not in missed], on_missed)
    else:
        try:
            side = ShareFollower(loader, address, leader, rank, 0.0 if leader in missed else wait)
        except Unshared as e:
            # a leader that never builds a loader here (an evaluation on this rank
            # alone) is told once; a late one each time (the script can fix it)
            if e.late or leader not in missed:
                warn(str(e))
            if not e.late:
                missed.add(leader)
            return None
        missed.discard(leader)
    side.acquire()
    weakref.finalize(loader, side.release)
    return side
