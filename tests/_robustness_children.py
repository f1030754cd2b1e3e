"""Bodies of the child processes in test_robustness.py.

Run as `python tests/_robustness_children.py <body> [args]`, so a crash (SIGSEGV,
SIGBUS, an abort in torch) or a hang fails the test that started the child
instead of killing or stalling pytest. Each body reports on stdout, one
`key=value` line per figure the parent checks, and exits 0 when every check
passed; a failed check exits non-zero with the reason on stderr.
"""
from __future__ import annotations

import collections
import faulthandler
import os
import sys
import time

import proc

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


# ---------------------------------------------------------------------------
# 1. the slot decoder under corrupt input

# Audit events a decode must never cause. A skeleton is a pickle, and pickle
# calls whatever globals it names; if a corrupt one ever reaches these, the
# event is refused (so the fuzz run itself stays harmless) and reported.
_FORBIDDEN_EVENTS = (
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "os.kill", "os.killpg", "os.remove", "os.unlink", "os.rmdir",
    "os.rename", "os.truncate", "os.chmod", "os.chown", "os.putenv", "os.unsetenv",
    "shutil.rmtree", "shutil.move", "socket.connect", "socket.bind", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof", "sys.settrace", "sys.setprofile",
)


class _Guard:
    """Audit hook, armed only around decode(): counts the globals pickle resolves
    (`pickle.find_class`) and the modules imported, and refuses side effects.

    `arm()` starts one decode's record: `resolved` (did pickle resolve any global)
    and `blocked` (the side effects refused) are that decode's alone, so a finding
    is blamed on the input that caused it, never on the examples after it."""

    def __init__(self):
        self.armed = False
        self.globals = collections.Counter()
        self.imports = collections.Counter()
        self.blocked = []
        self.resolved = 0

    def arm(self):
        self.blocked = []
        self.resolved = 0
        self.armed = True

    def __call__(self, event, args):
        if not self.armed:
            return
        if event == "pickle.find_class":
            self.globals[f"{args[0]}.{args[1]}"] += 1
            self.resolved += 1
            return
        if event == "import":
            self.imports[args[0]] += 1
            return
        write = event == "open" and isinstance(args[1], str) and any(c in args[1] for c in "wax+")
        if write or event.startswith(_FORBIDDEN_EVENTS):
            self.blocked.append((event, repr(args)[:200]))
            raise RuntimeError(f"fuzz guard: decode tried {event}{args!r:.200}")


def _byte_bounds(a):
    from numpy.lib.array_utils import byte_bounds
    return byte_bounds(a)


def _check_views(payload, lo_ok: int, hi_ok: int, map_lo: int, map_hi: int,
                 private: dict | None = None) -> int:
    """Walk `payload` (iteratively: a fuzzed skeleton may nest deeply) and check that
    every tensor or array that touches the mapping lies inside [lo_ok, hi_ok).
    Returns how many views were checked; raises AssertionError otherwise. `private`:
    filled with {storage address: bytes} of the tensors' storages outside the mapping
    (what the decode allocated)."""
    import numpy as np
    import torch

    seen, stack, views = set(), [payload], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (int, float, complex, str, bytes, type(None))):
            continue
        seen.add(id(obj))
        if len(seen) > 200_000:
            raise AssertionError("payload has over 200000 objects")
        if isinstance(obj, torch.Tensor):
            if obj.layout == torch.sparse_coo:
                stack += [obj._indices(), obj._values()]
                continue
            if obj.layout != torch.strided:
                stack += [obj.values()]
                stack += ([obj.crow_indices(), obj.col_indices()]
                          if obj.layout in (torch.sparse_csr, torch.sparse_bsr)
                          else [obj.ccol_indices(), obj.row_indices()])
                continue
            storage = obj.untyped_storage()
            if private is not None and not map_lo <= storage.data_ptr() < map_hi:
                private[storage.data_ptr()] = storage.nbytes()
            if obj.numel() == 0:
                continue
            size = obj.element_size()
            base = obj.data_ptr()
            lo = base + size * sum(min(0, (n - 1) * s) for n, s in zip(obj.shape, obj.stride()))
            hi = base + size * (1 + sum(max(0, (n - 1) * s) for n, s in zip(obj.shape, obj.stride())))
            if hi > map_lo and lo < map_hi:
                views += 1
                assert lo_ok <= lo and hi <= hi_ok, (
                    f"tensor view [{lo - map_lo}, {hi - map_lo}) outside the data region "
                    f"[{lo_ok - map_lo}, {hi_ok - map_lo}): {obj.dtype} {tuple(obj.shape)} "
                    f"{obj.stride()}")
            continue
        if isinstance(obj, np.ndarray):
            if obj.size and obj.dtype.itemsize:
                lo, hi = _byte_bounds(obj)
                if hi > map_lo and lo < map_hi:
                    views += 1
                    assert lo_ok <= lo and hi <= hi_ok, (
                        f"array [{lo - map_lo}, {hi - map_lo}) outside the data region "
                        f"[{lo_ok - map_lo}, {hi_ok - map_lo}): {obj.dtype} {obj.shape}")
            if obj.dtype.hasobject:
                stack += list(obj.ravel()[:10_000])
            continue
        if isinstance(obj, dict):
            stack += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += list(obj)
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            stack.append(d)
    return views


class _Pid:
    """Stands for a persistent id in a forged skeleton."""

    def __init__(self, value):
        self.value = value


def _fuzz_batches():
    """Real batches, as a worker builds them: (name, payload, uses slot_collate)."""
    import loader_datasets as ds
    import torch
    from torch._utils import ExceptionWrapper

    try:
        raise KeyError("bad sample 7")
    except KeyError:
        error = ExceptionWrapper(where="in DataLoader worker process 1")
    rfdetr = ds.rfdetr_collate([ds.rfdetr_like(i, 24) for i in range(16)])
    varied = [ds.VariedDataset()[i] for i in range(4)]
    varied[0]["csr"] = torch.eye(3).to_sparse_csr()
    augment = [ds.AugmentDataset()[i] for i in range(5)]
    return [("rfdetr", rfdetr, False), ("varied", varied, False),
            ("augment", augment, True), ("error", error, False)]


SLOT_BYTES = 1 << 19


def _encoded_slots() -> dict:
    """{name: (mapping, header view, pristine bytes up to the skeleton's end)}: each of
    _fuzz_batches() encoded into a slot of its own (names unlinked at once), and
    checked to decode as it was written."""
    import posix_ipc

    from poolloader import collate as slot_collate_mod
    from poolloader.shm._shm import Mapping
    from poolloader.wire import codec, filling
    from poolloader.wire import slot_format as fmt

    slot_bytes = SLOT_BYTES
    slots = {}
    for name, batch, via_collate in _fuzz_batches():
        shm_name = f"/pltest-{os.getpid()}-fuzz-{name}"
        shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=0o600, size=slot_bytes)
        try:
            mapping = Mapping(shm.fd, slot_bytes)
        finally:
            shm.close_fd()
            shm.unlink()
        header = fmt.header_view(mapping)
        writer = codec.SlotWriter()
        writer.begin(mapping)
        if via_collate:  # what a worker does: collate straight into the slot
            filling.set_writer(writer)
            batch = slot_collate_mod.slot_collate(batch)
            filling.set_writer(None)
        codec.encode(writer, header, batch, fmt.ST_READY)
        writer.end()
        del writer
        end = int(header[fmt.F_SKELETON_OFF]) + int(header[fmt.F_SKELETON_LEN])
        pristine = bytes(memoryview(mapping)[:end])
        payload, lease = codec.decode(mapping, header)  # the unmodified slot decodes
        base, data_end = mapping.address, fmt.DATA_OFF + int(header[fmt.F_DATA_LEN])
        in_slot = _check_views(payload, base + fmt.DATA_OFF, base + data_end, base,
                               base + mapping.size)
        # the lease is kept exactly when a tensor of the batch stays in the slot
        assert (lease is None) == (in_slot == 0), name
        del payload, lease
        slots[name] = (mapping, header, pristine)

    return slots


def fuzz(examples: str = "400") -> None:
    """Hypothesis fuzz of slot_format.decode over real encoded batches."""
    import resource
    import warnings

    faulthandler.enable()
    warnings.simplefilter("ignore")
    examples = int(examples)

    import io
    import pickle
    import zlib

    import numpy as np
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from poolloader.errors import SlotCorrupt
    from poolloader.wire import codec
    from poolloader.wire import slot_format as fmt

    # A corrupt length must fail fast (MemoryError -> SlotCorrupt), not push the
    # machine into swap: cap the address space at what we use now plus 4 GiB.
    vm = proc.vm_size_bytes()
    resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 30), resource.RLIM_INFINITY))

    slot_bytes = SLOT_BYTES
    slots = _encoded_slots()

    guard = _Guard()
    sys.addaudithook(guard)
    # CPython reports some memory errors (a bytearray freed while a buffer of it is
    # exported) only through sys.excepthook: count them as failures of the decode.
    # One is CPython's own (3.11): when a pickle's BYTEARRAY8 asks for more memory
    # than there is, PyByteArray_FromStringAndSize frees the new object before
    # setting ob_exports, and the dealloc may read garbage there and print this
    # (nothing is freed wrongly; MemoryError follows, and decode says SlotCorrupt).
    printed = []
    cpython_quirks = collections.Counter()
    quirk = "deallocated bytearray object has exported buffers"

    def excepthook(kind, value, tb):
        if kind is SystemError and str(value) == quirk:
            cpython_quirks[quirk] += 1
            return
        import traceback
        where = "".join(traceback.format_stack(limit=12)[:-1])
        printed.append(f"{kind.__name__}: {value}, at\n{where}")
        sys.__excepthook__(kind, value, tb)
    sys.excepthook = excepthook
    outcomes = collections.Counter()
    slowest = [0.0, ""]  # reported, not checked: wall-clock time depends on the machine's load
    largest = [0, ""]  # the most tensor bytes one decode allocated (checked in attempt())

    def restore(mapping, pristine):
        memoryview(mapping)[:len(pristine)] = pristine

    def skeleton_of(header):
        return int(header[fmt.F_SKELETON_OFF]), int(header[fmt.F_SKELETON_LEN])

    def set_skeleton(mapping, header, blob: bytes, crc: bool = True):
        off = int(header[fmt.F_SKELETON_OFF])
        blob = blob[:mapping.size - off]
        memoryview(mapping)[off:off + len(blob)] = blob
        header[fmt.F_SKELETON_LEN] = len(blob)
        if crc:
            header[fmt.F_SKELETON_CRC] = zlib.crc32(blob)

    def attempt(kind, mapping, header, strict=False):
        """decode must raise SlotCorrupt or give views inside the data region;
        `strict`: must raise SlotCorrupt before pickle resolves anything.

        The trust model (poolloader/wire/codec.py): the CRC is integrity, not
        authenticity. A skeleton whose checksum was fixed up ("crc fixed up" kinds) is
        what a worker wrote, and is unpickled as DataLoader unpickles its workers'
        sends: it may call any global it names. Such a call is refused here by the
        guard (so the fuzz run stays harmless), which decode reports as SlotCorrupt;
        it is counted as an outcome, not a finding. Every other kind of corruption
        (header fields, data bytes, flips under the original checksum) must never
        reach a side effect."""
        data_end = fmt.DATA_OFF + int(header[fmt.F_DATA_LEN])
        assert not printed, f"before {kind}: {printed}"
        t0 = time.perf_counter()
        guard.arm()
        try:
            result = codec.decode(mapping, header)
        except SlotCorrupt:
            result = None
        except BaseException as e:  # noqa: BLE001 - anything else is the finding
            raise AssertionError(f"{kind}: decode raised {type(e).__name__}: {e}") from e
        finally:
            guard.armed = False
            took = time.perf_counter() - t0
            if took > slowest[0]:
                slowest[:] = [took, kind]
        # the exception and whatever its frames held are gone by now
        forged = "(crc fixed up)" in kind
        if guard.blocked and forged:
            assert result is None, f"{kind}: decode went on after the guard refused {guard.blocked}"
            outcomes[kind, "named a side effect (trusted writer; refused by the guard)"] += 1
            return
        assert not guard.blocked, f"{kind}: decode reached {guard.blocked}"
        assert not (strict and guard.resolved), f"{kind}: pickle resolved a global of a corrupt skeleton"
        assert not printed, f"{kind}: decode reported {printed}"
        if result is None:
            outcomes[kind, "SlotCorrupt"] += 1
            return
        payload, lease = result
        del result
        assert not strict, f"{kind}: a corrupt skeleton decoded to {type(payload).__name__}"
        base = mapping.address
        private: dict = {}
        views = _check_views(payload, base + fmt.DATA_OFF, base + data_end, base, base + mapping.size,
                             private)
        # What a decode may allocate is bounded by what the slot holds (the small block,
        # pickled fallbacks from the skeleton), never by a size a corrupt field claims.
        allocated = sum(private.values())
        assert allocated <= mapping.size, (
            f"{kind}: decode allocated {allocated} bytes of tensors for a slot of {mapping.size}")
        if allocated > largest[0]:
            largest[:] = [allocated, kind]
        outcomes[kind, "decoded, views inside" if views else "decoded, no views"] += 1
        del payload, lease
        assert not printed, f"{kind}: dropping the payload reported {printed}"

    names = st.sampled_from(sorted(slots))
    # derandomize: the same examples on every run and machine (a CI failure reproduces)
    common = dict(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))

    def interesting(original, size):
        return st.one_of(
            st.integers(0, 2**64 - 1),
            st.sampled_from([0, 1, 63, 64, 65, fmt.DATA_OFF, fmt.DATA_OFF + 64, size - 1, size,
                             size + 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]),
            st.integers(-4096, 4096).map(lambda d: min(2**64 - 1, max(0, original + d))))

    @settings(**common)
    @given(names, st.data())
    def header_fields(name, data):
        mapping, header, pristine = slots[name]
        restore(mapping, pristine)
        for field in data.draw(st.lists(st.integers(0, fmt.HEADER_FIELDS - 1), min_size=1, max_size=4)):
            header[field] = data.draw(interesting(int(header[field]), mapping.size))
        attempt("header fields", mapping, header)

    @settings(**common)
    @given(names, st.data(), st.booleans())
    def skeleton_bits(name, data, fix_crc):
        mapping, header, pristine = slots[name]
        restore(mapping, pristine)
        off, n = skeleton_of(header)
        blob = bytearray(memoryview(mapping)[off:off + n])
        flips = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 7)),
                                   min_size=1, max_size=12))
        for at, bit in flips:
            blob[at] ^= 1 << bit
        changed = bytes(blob) != pristine[off:off + n]
        set_skeleton(mapping, header, bytes(blob), crc=fix_crc)
        kind = "skeleton bit flips" + (" (crc fixed up)" if fix_crc else "")
        attempt(kind if changed else "skeleton bit flips that cancel out", mapping, header,
                strict=changed and not fix_crc)

    @settings(**common)
    @given(names, st.data())
    def skeleton_splice(name, data):
        mapping, header, pristine = slots[name]
        restore(mapping, pristine)
        off, n = skeleton_of(header)
        blob = bytes(memoryview(mapping)[off:off + n])
        a = data.draw(st.integers(0, n))
        b = data.draw(st.integers(a, min(n, a + 64)))
        junk = data.draw(st.one_of(
            st.binary(max_size=64),
            st.sampled_from([b"c", b"\x93", b"R", b"Q", b"\x8c\x08builtins\x8c\x04eval\x93",
                             b"cos\nsystem\n", b"\x8e\xff\xff\xff\xff\xff\x00\x00\x00",
                             b"B\xff\xff\xff\x7f", b"(]" * 32, b"h\xff", b"j\xff\xff\xff\xff"])))
        set_skeleton(mapping, header, blob[:a] + junk + blob[b:])
        attempt("skeleton splice (crc fixed up)", mapping, header)

    @settings(**common)
    @given(names, st.binary(max_size=256), st.booleans())
    def random_skeleton(name, blob, with_proto):
        mapping, header, pristine = slots[name]
        restore(mapping, pristine)
        set_skeleton(mapping, header, (b"\x80\x05" if with_proto else b"") + blob)
        attempt("random skeleton (crc fixed up)", mapping, header)

    small = st.integers(-3, 70)
    anyint = st.one_of(small, st.sampled_from([2**31, 2**32 + 1, 2**62, 2**63, 2**64, -(2**63)]),
                       st.integers(fmt.DATA_OFF - 128, fmt.DATA_OFF + slot_bytes))
    dims = st.lists(anyint, max_size=6).map(tuple)
    near_valid = st.tuples(  # a tensor in the data region: (kind, code, offset, shape, stride, count)
        st.just(1), st.integers(0, len(fmt.DTYPES) - 1),
        st.integers(fmt.DATA_OFF - 64, fmt.DATA_OFF + (1 << 17)).map(lambda o: o // 8 * 8),
        st.lists(st.integers(0, 40), max_size=4).map(tuple),
        st.lists(st.integers(0, 40), max_size=4).map(tuple),
        st.one_of(st.integers(0, 1 << 16), anyint))
    near_small = st.tuples(  # a tensor in the small block: (kind, code, offset, shape, stride)
        st.just(3), st.integers(0, len(fmt.DTYPES) - 1),
        st.integers(-64, 1 << 12).map(lambda o: o // 8 * 8),
        st.lists(st.integers(0, 40), max_size=4).map(tuple),
        st.lists(st.integers(0, 40), max_size=4).map(tuple))
    zero_count = st.integers(1, 3).flatmap(lambda ndim: st.tuples(
        # a count of 0 (an empty tensor) under a shape that is not empty
        st.just(1), st.integers(0, len(fmt.DTYPES) - 1), st.just(fmt.DATA_OFF),
        st.lists(st.integers(1, 1 << 12), min_size=ndim, max_size=ndim).map(tuple),
        st.lists(st.integers(1, 1 << 12), min_size=ndim, max_size=ndim).map(tuple), st.just(0)))
    pid = st.one_of(
        near_valid, near_valid, near_small, zero_count,
        st.tuples(st.sampled_from([1, 2, 0, 3, True]), st.one_of(small, st.none()),
                  anyint, dims, dims),
        st.tuples(st.just(2), st.sampled_from(["<f4", "|u1", "<c16", "|O", "i4,f8", "(2,3)<i2",
                                                "S0", "U3", "V8", ">i8", "M8[s]", "?", "x"]),
                  anyint, dims, st.sampled_from(["C", "F", "K", None])),
        st.tuples(st.just(1), small, anyint, dims, dims, small),  # wrong arity
        st.one_of(st.integers(), st.text(max_size=4), st.lists(small, max_size=6)))

    class _PidPickler(pickle.Pickler):
        def persistent_id(self, obj):
            return obj.value if type(obj) is _Pid else None

    @settings(**common)
    @given(names, st.lists(pid, min_size=1, max_size=3))
    def persistent_ids(name, pids):
        mapping, header, pristine = slots[name]
        restore(mapping, pristine)
        buf = io.BytesIO()
        _PidPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump([_Pid(p) for p in pids])
        set_skeleton(mapping, header, buf.getvalue())
        attempt("forged persistent ids (crc fixed up)", mapping, header)

    @settings(**common)
    @given(names, st.data())
    def data_bits(name, data):
        mapping, header, pristine = slots[name]
        restore(mapping, pristine)
        data_len = int(header[fmt.F_DATA_LEN]) + int(header[fmt.F_SMALL_LEN])  # and the small block
        if not data_len:
            return
        u8 = np.frombuffer(mapping, np.uint8, count=data_len, offset=fmt.DATA_OFF)
        for at, bit in data.draw(st.lists(st.tuples(st.integers(0, data_len - 1), st.integers(0, 7)),
                                          min_size=1, max_size=16)):
            u8[at] ^= 1 << bit
        del u8
        attempt("data region bit flips", mapping, header)

    t0 = time.perf_counter()
    for body in (header_fields, skeleton_bits, skeleton_splice, random_skeleton,
                 persistent_ids, data_bits):
        body()
    elapsed = time.perf_counter() - t0
    total = sum(outcomes.values())
    print(f"examples={total}")
    print(f"seconds={elapsed:.1f}")
    print(f"slowest_decode_s={slowest[0]:.4f} ({slowest[1]})")
    print(f"largest_decode_allocation={largest[0]} ({largest[1]})")
    for (kind, result), count in sorted(outcomes.items()):
        print(f"outcome {kind} -> {result}={count}")
    print("globals_resolved=" + ",".join(f"{g}:{c}" for g, c in guard.globals.most_common(20)))
    print(f"cpython_bytearray_quirk={cpython_quirks[quirk]}")
    print("imports=" + ",".join(f"{g}:{c}" for g, c in guard.imports.most_common(20)))


def forged_skeleton() -> None:
    """The case the fuzz found (issue 33): the "varied" slot's skeleton with the two
    bytes before its `torch.sparse_coo` string replaced by `cos\nsystem\n` (a GLOBAL
    of os.system), which the next REDUCE then calls with that string.

    The trust model it pins (poolloader/wire/codec.py): with the checksum fixed up
    the forgery is what a worker wrote, and decode unpickles it as DataLoader
    unpickles its workers' sends, so it reaches os.system (refused here by the
    guard, which decode reports as SlotCorrupt); under the original checksum, as any
    stray write leaves it, decode refuses it before pickle resolves a single global."""
    import warnings
    import zlib

    from poolloader.errors import SlotCorrupt
    from poolloader.wire import codec
    from poolloader.wire import slot_format as fmt

    warnings.simplefilter("ignore")
    slots = _encoded_slots()
    mapping, header, pristine = slots["varied"]
    off, n = int(header[fmt.F_SKELETON_OFF]), int(header[fmt.F_SKELETON_LEN])
    blob = pristine[off:off + n]
    at = blob.find(b"\x94\x8c\x10torch.sparse_coo")
    assert at >= 2, "the varied batch's skeleton no longer names torch.sparse_coo"
    forged = blob[:at - 2] + b"cos\nsystem\n" + blob[at:]
    guard = _Guard()
    sys.addaudithook(guard)

    def decode(crc):
        memoryview(mapping)[:len(pristine)] = pristine
        memoryview(mapping)[off:off + len(forged)] = forged
        header[fmt.F_SKELETON_LEN] = len(forged)
        header[fmt.F_SKELETON_CRC] = crc
        guard.arm()
        try:
            codec.decode(mapping, header)
            return "decoded"
        except SlotCorrupt as e:
            return f"SlotCorrupt: {e}"
        finally:
            guard.armed = False

    stray = decode(int(header[fmt.F_SKELETON_CRC]))
    print(f"original_crc={stray[:80]}")
    print(f"original_crc_globals={guard.resolved}")
    print(f"original_crc_blocked={guard.blocked}")
    fixed = decode(zlib.crc32(forged))
    print(f"fixed_crc={fixed[:80]}")
    print(f"fixed_crc_blocked={guard.blocked}")


# ---------------------------------------------------------------------------
# 3. signals to the main process

def signalled(mode: str) -> None:
    """A training loop that runs until a signal ends it. Prints `READY <prefix> <worker
    pids>` once batches flow. mode "sigterm-handler" installs what training scripts
    do: a SIGTERM handler that raises SystemExit."""
    import signal

    # A shell that starts a job in the background (as some CI runners do) leaves
    # SIGINT ignored in it, and Python keeps it so; a terminal's Ctrl-C does not.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if mode == "sigterm-handler":
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    import loader_datasets as ds

    from poolloader import PoolLoader

    loader = PoolLoader(ds.PidDataset(n=1_000_000, delay=0.005), batch_size=2, num_workers=2,
                        slot_bytes=1 << 16)
    it = iter(loader)
    for k, _batch in enumerate(it):
        if k == 5:
            print("READY", it.shm_prefix, *it.worker_pids, flush=True)
        elif k == 25:
            print("FLOWING", flush=True)  # batches keep coming after READY
    sys.exit("the epoch ended before any signal came")


# ---------------------------------------------------------------------------
# 5. descriptor limit

def fd_limit(limit: str, workers: str, batches: str) -> None:
    """RLIMIT_NOFILE first, then torch and poolloader; then RF-DETR shaped batches
    (16 x [3,96,96] + mask + 16 target dicts of 7 tensors = 114 tensors)."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (int(limit), int(limit)))
    import warnings

    warnings.simplefilter("ignore")  # "32 workers on 2 CPUs"
    import loader_datasets as ds
    import torch
    from torch.utils.data import RandomSampler

    from poolloader import PoolLoader

    fds = proc.fd_count

    def targets():
        return set(proc.fd_targets())

    workers, batches = int(workers), int(batches)
    print(f"base_fds={fds()}", flush=True)
    base_targets = targets()
    data = ds.RFDETRShaped(n=32, hw=96)
    sampler = RandomSampler(data, replacement=True, num_samples=16 * batches,
                            generator=torch.Generator().manual_seed(0))
    loader = PoolLoader(data, batch_size=16, sampler=sampler, collate_fn=ds.rfdetr_collate,
                        num_workers=workers, timeout=60)
    try:
        it = iter(loader)
    except OSError as e:
        print(f"start_error={type(e).__name__}: {e}", flush=True)
        raise
    print(f"start_fds={fds()}", flush=True)
    print(f"backend={it._pool.backend}", flush=True)
    # what the pool holds open: its owner lock on the control segment (pool.py); a
    # memfd pool also each segment's descriptor until every worker has mapped it
    print(f"pool_fd_targets={' '.join(sorted(targets() - base_targets))}", flush=True)
    got = peak = 0
    for batch in it:
        images, masks, targets_ = batch
        assert images.shape == (16, 3, 96, 96) and masks.shape == (16, 96, 96)
        assert len(targets_) == 16 and all(len(t) == 7 for t in targets_)
        got += 1
        del batch, images, masks, targets_
        live = fds()  # the pool is alive until the loop asks past the last batch
        peak = max(peak, live)
        if got == 90 and it._pool.backend == "memfd":
            # segments made while workers were busy (each slot's first growth) keep their
            # descriptor until every worker has synced; idle workers sync at their tick
            deadline = time.monotonic() + 20
            while it._pool.unlink_mapped() and time.monotonic() < deadline:
                time.sleep(0.01)
            live = fds()
            print(f"late_fds={live}", flush=True)
            late = ' '.join(sorted(targets() - base_targets)).replace(' (deleted)', '')
            print(f"late_fd_targets={late}", flush=True)
    print(f"batches={got}", flush=True)
    print(f"end_fds={live}", flush=True)
    print(f"peak_fds={peak}", flush=True)
    print(f"after_fds={fds()}", flush=True)


# ---------------------------------------------------------------------------
# 7. several loaders at once

def concurrent(tag: str, epochs: str) -> None:
    """One process, one loader over TaggedSamples(tag), started when the parent says
    `go`: checks every value of every batch and prints the pool prefixes it used."""
    import robustness_datasets as rds
    import torch

    from poolloader import PoolLoader

    tag, n = int(tag), 40
    loader = PoolLoader(rds.TaggedSamples(tag, n), batch_size=4, num_workers=2,
                        multiprocessing_context="fork", slot_bytes=1 << 16)
    it = iter(loader)
    prefixes = [it.shm_prefix]
    print("READY", it.shm_prefix, flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit("the parent did not say go")
    for epoch in range(int(epochs)):
        if epoch:
            it = iter(loader)
            prefixes.append(it.shm_prefix)
        seen = []
        for batch in it:
            index = batch["index"]
            expected = (tag * 1000 + index).double().view(-1, 1, 1, 1).expand(-1, 3, 16, 16)
            assert torch.equal(batch["image"], expected), f"epoch {epoch}: foreign data in batch"
            assert batch["tag"].tolist() == [tag] * len(index)
            assert batch["name"] == [f"tag{tag}-sample{i}" for i in index.tolist()]
            seen += index.tolist()
        assert seen == list(range(n)), f"epoch {epoch}: {seen}"
    del it
    print("OK", *prefixes, flush=True)


# ---------------------------------------------------------------------------
# 8. the at-fork hook while other threads make and drop mappings

def fork_hook_threads(forks: str = "200") -> None:
    """Fork `forks` times from a thread, each time right after leasing a fresh DONTFORK
    mapping, while another thread makes and drops mappings and the interpreter
    switches threads every microsecond. Each child reads the leased bytes (a mapping
    the hook missed is not in the child: SIGSEGV). Prints the figures; the parent test
    also checks stderr for what the hook may have printed."""
    import threading

    from poolloader.shm import fork  # noqa: F401 - registers the at-fork hooks
    from poolloader.shm._shm import Lease, Mapping

    faulthandler.enable()
    forks = int(forks)
    size = 1 << 16
    fd = os.memfd_create("pltest-forkhook")  # anonymous: no name to leave behind
    os.ftruncate(fd, size)
    unraisable = []
    sys.unraisablehook = lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}")
    # a long registry to walk (a WeakSet walk of it let another thread add mid-walk)
    live = [Mapping(fd, size, True) for _ in range(20000)]
    stop = threading.Event()
    churned = [0]

    def churn():
        while not stop.is_set():
            made = [Mapping(fd, size, True) for _ in range(16)]
            churned[0] += len(made)
            del made

    bad = []

    def fork_many():
        for i in range(forks):
            mapping = Mapping(fd, size, True)
            lease = Lease(mapping, 0, size)
            memoryview(lease)[:8] = i.to_bytes(8, "little")
            pid = os.fork()
            if pid == 0:
                ok = int.from_bytes(bytes(memoryview(lease)[:8]), "little") == i
                os._exit(0 if ok else 3)
            deadline = time.monotonic() + 30
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    status = -1
                    break
                time.sleep(0.001)
            if status != 0:
                bad.append((i, status, mapping.forked))
            del lease, mapping

    sys.setswitchinterval(1e-6)
    churner = threading.Thread(target=churn, daemon=True)
    forker = threading.Thread(target=fork_many)
    churner.start()
    forker.start()
    forker.join(240)
    stop.set()
    churner.join(30)
    sys.setswitchinterval(0.005)
    os.close(fd)
    print(f"forks={forks}")
    print(f"churned={churned[0]}")
    print(f"bad_children={len(bad)}")
    print(f"unraisable={len(unraisable)}")
    assert not forker.is_alive(), "the forking thread did not finish"
    assert not unraisable, f"the fork hook raised: {unraisable[:3]}"
    assert not bad, f"children that could not read their leased mapping: {bad[:5]}"
    del live


# ---------------------------------------------------------------------------

if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
