"""The byte layout of one slot, and what its header says.

This module is the only reader and writer of a slot's header: the worker, the codec
and the iterator call the functions below and never index the header themselves.
How a batch fills the data region is poolloader.wire.codec's.

A slot is one page-aligned shared segment:

    0            header: HEADER_FIELDS u64, fields F_* below
    REQUEST_OFF  request area: main writes the sampler index here (encode_request; a larger
                 index goes at DATA_OFF instead: main owns the whole slot while it
                 writes a request, and the worker reads it before writing data);
                 once read, the worker writes its reply's resume state here
                 (write_state; a state too large for it goes after the reply)
    DATA_OFF     data region: tensor and array bytes, each 64-byte aligned,
                 then the small block (at F_SMALL_OFF), then the skeleton
    slot size    (page multiple)

The skeleton is the batch pickled with every plain CPU tensor and numpy array
replaced by a persistent id that points into the slot. Decoding unpickles it and
turns each id into a tensor: O(objects), never O(bytes), and the batch belongs to
the user as a DataLoader batch does (docs/how-it-works.md, "Ownership mechanisms"):

* a tensor above SMALL_TENSOR_BYTES stays in the slot, with a storage of its own
  covering exactly its bytes (torch.save, deepcopy, share_memory_() and sending it
  act on that tensor alone); every such storage keeps the batch's Lease, and the
  slot is reused only when the last one dies;
* smaller tensors (labels, boxes, ids, packed target fields; up to
  SMALL_BATCH_BYTES per batch) are laid out by the worker in one contiguous small
  block, which main copies once into a private buffer: they share that buffer's
  storage and never keep the slot.

As DataLoader's, no tensor of a decoded batch is a view of another (`_base` is None)
and each has its own version counter, where the batch is plain containers, tensors,
arrays and PackedTargets (codec.VIEWS_UNTRACKED).

Everything else (strings, numbers, dicts, namedtuples, dataclasses, tensor
subclasses, sparse, quantized, nested, tensors that require grad or carry a
conj/neg bit, object arrays) is pickled into the skeleton as DataLoader's own
pickling would carry it: lossless, one copy, documented as the fallback.
"""
from __future__ import annotations

import pickle
import struct

import numpy as np
import torch

from poolloader.errors import SlotCorrupt
from poolloader.shm.backend import page_round

SLOT_MAGIC = 0x746F6C536C50  # "PlSlot"
HEADER_FIELDS = 17
(F_MAGIC,          # SLOT_MAGIC
 F_STATUS,         # one of the ST_* values
 F_SEQ,            # the batch's send index (main writes, worker echoes: main's ownership check)
 F_EPOCH,          # main's epoch counter: a new value makes the worker restart its fetcher
 F_WORKER,         # the worker main sent the request to (main writes, worker echoes)
 F_REQUEST_OFF,    # where the encoded index starts (REQUEST_OFF, or DATA_OFF when large)
 F_REQUEST_LEN,    # its length in bytes
 F_DATA_LEN,       # bytes of the data region in use (64-byte multiple)
 F_SMALL_OFF,      # absolute offset of the small block (>= DATA_OFF + data length)
 F_SMALL_LEN,      # its length (64-byte multiple)
 F_SKELETON_OFF,   # absolute offset of the skeleton (>= small block's end)
 F_SKELETON_LEN,   # its length in bytes
 F_NEEDED,         # ST_GROW: slot bytes the payload needs
 F_SKELETON_CRC,   # zlib.crc32 of the skeleton: a torn or stray write never reaches pickle
 F_STATE_OFF,      # where the worker's resume state of this reply starts (write_state)
 F_STATE_LEN,      # its length in bytes (0: none)
 F_SHARED_SEED,    # the epoch's shared seed (DataLoader's _shared_seed: IterDataPipe
                   # shuffles draw from it); main writes, a worker reads it at a new epoch
 ) = range(HEADER_FIELDS)
REQUEST_OFF = HEADER_FIELDS * 8
DATA_OFF = 65536
REQUEST_MAX = DATA_OFF - REQUEST_OFF
MIN_SLOT_BYTES = DATA_OFF + 4096

ST_REQUESTED, ST_READY, ST_GROW, ST_ERROR, ST_END = 1, 2, 3, 4, 5

# A request ring's value: the slot in the low SLOT_BITS bits, the request's ticket (a
# number main never gives twice, never 0, increasing on each ring) above them. The
# ticket is also the slot's claim word in the control block until the request is
# claimed, so a worker popping a request that main moved to another slot meanwhile (or
# a slot that carries a later request by then) finds another value there and skips it
# (poolloader.main.requests, _move_newest; poolloader.worker.loop, claimed).
SLOT_BITS = 24
MAX_SLOTS = 1 << SLOT_BITS
TICKET_LIMIT = 1 << (63 - SLOT_BITS)


def ring_value(slot: int, ticket: int) -> int:
    return slot | ticket << SLOT_BITS


def ring_entry(value: int) -> tuple[int, int]:
    """(slot, ticket) of a request ring's value; a negative value (a stray write) is
    returned as the slot, which the worker's bounds check refuses."""
    if value < 0:
        return value, 0
    return value & (MAX_SLOTS - 1), value >> SLOT_BITS

# A tensor up to SMALL_TENSOR_BYTES is copied into the batch's private small buffer
# instead of viewed in the slot: copying 64 KiB costs main about what making one
# more storage does (a few µs), while keeping such a tensor as a view would keep a
# whole slot (MBs) alive. SMALL_BATCH_BYTES bounds main's copy per batch (~50 µs);
# small tensors past it stay in the slot, as views with storages of their own.
SMALL_TENSOR_BYTES = 64 << 10
SMALL_BATCH_BYTES = 1 << 20
SMALL_ALIGN = 16  # the largest itemsize (complex128)

# Dense dtypes a slot carries as views; the code is the index here.
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    torch.complex32, torch.uint16, torch.uint32, torch.uint64,
]
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPES.append(getattr(torch, _name))
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}
ITEMSIZE = [dt.itemsize for dt in DTYPES]
NUM_DTYPES = len(DTYPES)


def align64(n: int) -> int:
    return (n + 63) & ~63


def align_small(n: int) -> int:
    return (n + SMALL_ALIGN - 1) & ~(SMALL_ALIGN - 1)


def header_view(mapping) -> np.ndarray:
    return np.ndarray((HEADER_FIELDS,), np.uint64, buffer=mapping, offset=0)


def span_elements(shape, stride) -> int:
    """Elements of storage a strided view covers from its first element (0 if empty)."""
    n = 1
    for size, st in zip(shape, stride):
        if size == 0:
            return 0
        n += (size - 1) * st
    return n


class NeedsGrow(Exception):
    """The payload needs a slot of `needed` bytes; nothing was published."""

    def __init__(self, needed: int):
        super().__init__(needed)
        self.needed = needed


# ---------------------------------------------------------------------------
# the header: requests (main writes, worker reads), replies (worker writes, main reads)

# A request is the sampler's index, as the worker's fetcher must see it. A list of
# Python ints (what torch's samplers give a BatchSampler) goes as raw int64 after
# INT64_REQUEST; anything else is pickled (a pickle starts with its PROTO opcode,
# 0x80, never with this tag).
INT64_REQUEST = b"PLi64\0\0\0"


def encode_request(index, int_list: bool = False) -> bytes:
    """The bytes of a request for `index`. `int_list`: the caller knows `index` is a list
    of Python ints (a torch sampler's batch), so it is written raw, without pickling;
    an int beyond int64 still falls back to pickle. read_request gives back an object
    of the same types either way."""
    if int_list and type(index) is list:
        packer = _INT64_PACKERS.get(len(index))
        if packer is None:
            packer = _INT64_PACKERS[len(index)] = struct.Struct(f"={len(index)}q")
        try:
            return INT64_REQUEST + packer.pack(*index)
        except struct.error:  # an int beyond int64
            pass
    return pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)


_INT64_PACKERS: dict[int, struct.Struct] = {}  # by batch length: a few per loader


def request_slot_bytes(request: bytes) -> int:
    """Slot bytes a request needs: 0 when it fits the request area (any slot will do)."""
    return 0 if len(request) <= REQUEST_MAX else DATA_OFF + len(request)


def write_request(mapping, header: np.ndarray, seq: int, epoch: int, worker: int,
                  request: bytes, shared_seed: int | None = None) -> None:
    """Main, owning the slot: the encoded index, the fields the worker echoes, and the
    epoch's shared seed (None: the dataset is not an IterDataPipe).

    An index larger than the request area goes at DATA_OFF; the caller has made the
    slot large enough (request_slot_bytes)."""
    n = len(request)
    off = REQUEST_OFF if n <= REQUEST_MAX else DATA_OFF
    if off + n > mapping.size:
        raise ValueError(f"internal error: a request of {n} bytes does not fit a slot "
                         f"of {mapping.size} bytes")
    memoryview(mapping)[off:off + n] = request
    header[F_SHARED_SEED] = 0 if shared_seed is None else shared_seed
    # the fields from F_MAGIC to F_REQUEST_LEN (stamp's, the status, where the request
    # is) in one C call; the worker reads none before the ring hands it the slot
    _REQUEST_FIELDS.pack_into(mapping, 0, SLOT_MAGIC, ST_REQUESTED, seq, epoch, worker, off, n)


def copy_request(source, source_header: np.ndarray, target, target_header: np.ndarray) -> None:
    """Main, owning `target` and the request in `source` (not yet claimed by its
    worker): the same request, written into `target` as write_request wrote it."""
    off, n = int(source_header[F_REQUEST_OFF]), int(source_header[F_REQUEST_LEN])
    if off + n > target.size:
        raise ValueError(f"internal error: a request of {n} bytes at {off} does not fit a slot "
                         f"of {target.size} bytes")
    memoryview(target)[off:off + n] = memoryview(source)[off:off + n]
    target_header[F_SHARED_SEED] = source_header[F_SHARED_SEED]
    _REQUEST_FIELDS.pack_into(target, 0, *source_header[:_REQUEST_FIELDS.size // 8].tolist())


# F_MAGIC, F_STATUS, F_SEQ, F_EPOCH, F_WORKER, F_REQUEST_OFF, F_REQUEST_LEN: the header's
# first seven fields, in order, as header_view's uint64 (native order). Keep in sync
# with the field list at the top.
_REQUEST_FIELDS = struct.Struct("=7Q")


def stamp(header: np.ndarray, seq: int, epoch: int, worker: int) -> None:
    """Main: who the slot is for (also on a fresh segment after growth)."""
    header[F_MAGIC] = SLOT_MAGIC
    header[F_SEQ] = seq
    header[F_EPOCH] = epoch
    header[F_WORKER] = worker


def request_epoch(header: np.ndarray) -> int:
    return int(header[F_EPOCH])


def request_seq(header: np.ndarray) -> int:
    """Worker: the request's send index in its epoch (its step: resume snapshots)."""
    return int(header[F_SEQ])


def request_shared_seed(header: np.ndarray) -> int:
    """Worker: the shared seed of the request's epoch (see write_request)."""
    return int(header[F_SHARED_SEED])


def read_request(mapping, header: np.ndarray):
    """Worker: the sampler index main wrote (bounds-checked)."""
    off, n = int(header[F_REQUEST_OFF]), int(header[F_REQUEST_LEN])
    if off not in (REQUEST_OFF, DATA_OFF) or off + n > mapping.size or (
            off == REQUEST_OFF and n > REQUEST_MAX):
        raise SlotCorrupt(f"request of {n} bytes at {off} is outside the slot ({mapping.size} bytes)")
    request = memoryview(mapping)[off:off + n]
    tag = len(INT64_REQUEST)
    if request[:tag] == INT64_REQUEST:
        if (n - tag) % 8:
            raise SlotCorrupt(f"an int64 request of {n - tag} bytes is not a whole number of int64")
        return request[tag:].cast("q").tolist()  # native order, as packed
    return pickle.loads(request)


def mark_grow(header: np.ndarray, needed: int) -> None:
    """Worker: the payload needs a slot of `needed` bytes; nothing was published."""
    header[F_NEEDED] = needed
    header[F_STATUS] = ST_GROW


def mark_end(header: np.ndarray) -> None:
    """Worker: its iterable dataset is exhausted."""
    header[F_STATUS] = ST_END


def reply_status(header: np.ndarray, slot: int, seq: int, worker: int) -> int:
    """Main: the status of a returned slot, after checking it is the reply to the
    request main wrote there (magic, batch number and worker echoed unchanged)."""
    status = int(header[F_STATUS])
    if (int(header[F_MAGIC]) != SLOT_MAGIC or int(header[F_SEQ]) != seq
            or int(header[F_WORKER]) != worker
            or status not in (ST_READY, ST_GROW, ST_ERROR, ST_END)):
        raise SlotCorrupt(
            f"slot {slot} came back from worker {worker} with a header that is not the reply "
            f"to batch {seq}: magic {int(header[F_MAGIC]):#x}, batch {int(header[F_SEQ])}, "
            f"worker {int(header[F_WORKER])}, status {status}")
    return status


def needed_bytes(header: np.ndarray) -> int:
    return int(header[F_NEEDED])


def reply_is_error(header: np.ndarray) -> bool:
    return int(header[F_STATUS]) == ST_ERROR


# -- resume state (poolloader.resume.keys): a few KB of worker RNG and dataset position
# that rides with every reply. The worker has read the request by then, so the
# request area is free; main copies the bytes out when it takes the reply and
# never unpickles them on the per-batch path.

def write_state(mapping, header: np.ndarray, state: bytes) -> None:
    """Worker, after the reply is encoded (or for an END reply): store `state`.

    It goes in the request area when it fits, else after whatever the reply uses
    (the skeleton, or DATA_OFF for an END); raises NeedsGrow when the slot is too
    small for it."""
    n = len(state)
    if n <= REQUEST_MAX:
        off = REQUEST_OFF
    else:
        end = DATA_OFF
        if int(header[F_STATUS]) in (ST_READY, ST_ERROR):
            end = int(header[F_SKELETON_OFF]) + int(header[F_SKELETON_LEN])
        off = align64(end)
        if off + n > mapping.size:
            raise NeedsGrow(off + n)
    memoryview(mapping)[off:off + n] = state
    header[F_STATE_OFF] = off
    header[F_STATE_LEN] = n


def reply_state(mapping, header: np.ndarray) -> bytes:
    """Main: a copy of the resume state of a returned reply (b"" if it has none)."""
    off, n = int(header[F_STATE_OFF]), int(header[F_STATE_LEN])
    if n == 0:
        return b""
    if not ((off == REQUEST_OFF and n <= REQUEST_MAX)
            or (off >= DATA_OFF and off % 64 == 0 and off + n <= mapping.size)):
        raise SlotCorrupt(f"resume state of {n} bytes at {off} is outside the slot "
                          f"({mapping.size} bytes)")
    return bytes(memoryview(mapping)[off:off + n])


def reply_seq(header: np.ndarray) -> int:
    """Main: the batch number a reply answers (checked by reply_status)."""
    return int(header[F_SEQ])


# -- a reply's layout: written by the codec's encode, checked by its decode ----------

def publish_reply(header: np.ndarray, data_end: int, small_len: int, skeleton_off: int,
                  skeleton_len: int, skeleton_crc: int, status: int) -> None:
    """Fill the header of an encoded reply; the small block starts at `data_end` and
    the status goes last (main reads nothing before the ring says the slot is done)."""
    header[F_SKELETON_CRC] = skeleton_crc
    header[F_DATA_LEN] = data_end - DATA_OFF
    header[F_SMALL_OFF] = data_end
    header[F_SMALL_LEN] = small_len
    header[F_SKELETON_OFF] = skeleton_off
    header[F_SKELETON_LEN] = skeleton_len
    header[F_MAGIC] = SLOT_MAGIC
    header[F_STATUS] = status


def claimed_data_len(header: np.ndarray, slot_size: int) -> int:
    """The data region's length as the header claims it, clamped to the slot (what a
    lease may cover before `check_reply` has validated the rest)."""
    return min(int(header[F_DATA_LEN]), slot_size - DATA_OFF)


def reply_end(header: np.ndarray, slot_size: int) -> int:
    """Where the bytes a reply claims (data region, small block, skeleton) end, clamped
    to the slot: what a copy of the reply must cover (decode checks the claims)."""
    ends = (DATA_OFF + int(header[F_DATA_LEN]),
            int(header[F_SMALL_OFF]) + int(header[F_SMALL_LEN]),
            int(header[F_SKELETON_OFF]) + int(header[F_SKELETON_LEN]))
    return max(DATA_OFF, min(max(ends), slot_size))


TAIL_RETURN_MIN = 1 << 20  # return_tail: fewer bytes past a reply are left as they are


def return_tail(mapping, header: np.ndarray) -> None:
    """Worker, after publishing a READY or ERROR reply into a slot whose pages are
    charged as written (WorkerSlots.returns_tail): give back the slot's pages past
    what the reply and its resume state use, when that is TAIL_RETURN_MIN or more and
    a quarter of the slot or more. A slot keeps the pages its largest batch wrote,
    so with batches of varying size every slot came to be charged for the largest
    while DataLoader's segments hold each batch's own bytes (issue 45: a 640 MiB
    cgroup, batches of 8 to 48 MiB). A slot as full as its growth headroom leaves
    it (GROWTH_FACTOR: a fifth free) makes no call; a range with no pages costs one
    madvise. The worker owns the slot (main holds no view of it until the reply is
    popped), and the next batch written there faults its pages in again, as a
    DataLoader batch's fresh segment does."""
    end = reply_end(header, mapping.size)
    state_len = int(header[F_STATE_LEN])
    if state_len:
        end = max(end, int(header[F_STATE_OFF]) + state_len)
    end = page_round(end)
    tail = mapping.size - end
    if tail >= TAIL_RETURN_MIN and 4 * tail >= mapping.size:
        mapping.return_pages(end, tail)


def check_reply(header: np.ndarray, slot_size: int) -> tuple[int, int, int, int, int, int]:
    """Validate a published reply's header against the slot size; returns
    (data_len, small_off, small_len, skeleton_off, skeleton_len, skeleton_crc)."""
    fields = header.tolist()  # one C call: Python ints, not one numpy scalar per field
    if fields[F_MAGIC] != SLOT_MAGIC:
        raise SlotCorrupt(f"bad slot magic {fields[F_MAGIC]:#x}")
    data_len = fields[F_DATA_LEN]
    small_off, small_len = fields[F_SMALL_OFF], fields[F_SMALL_LEN]
    skel_off, skel_len = fields[F_SKELETON_OFF], fields[F_SKELETON_LEN]
    if (data_len % 64 or small_len % 64 or DATA_OFF + data_len > slot_size
            or small_off < DATA_OFF + data_len or small_len > SMALL_BATCH_BYTES + 64
            or skel_off < small_off + small_len or skel_off + skel_len > slot_size):
        raise SlotCorrupt(
            f"slot header out of bounds: data {data_len} bytes, small block {small_len} bytes "
            f"at {small_off}, skeleton {skel_len} bytes at {skel_off}, slot {slot_size} bytes")
    return data_len, small_off, small_len, skel_off, skel_len, fields[F_SKELETON_CRC]
