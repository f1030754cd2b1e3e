# cython: language_level=3
"""Shared-memory mappings that hold no file descriptor, and per-batch leases over them.

Python's mmap.mmap keeps a dup of its descriptor for as long as it lives (before
3.13), which would cost the main process one descriptor per slot. Mapping maps a
descriptor with mmap(2) and keeps nothing but the address: the caller closes the
descriptor right after. The mapping exports the buffer protocol; it is unmapped
only when the last export (numpy array, torch tensor, memoryview) is gone and the
object itself dies, so no view can outlive its memory.

A Lease is what every view of one delivered batch keeps alive: a buffer exporter
over the batch's bytes of one mapping. `take_lease` creates it and registers a
weakref whose callback is a C-level callable, in C, with no Python bytecode in
between: from that instant the lease owns the slot, and its death (the last view
of the batch gone, in any thread) queues the weakref for the iterator, with no
point at which a signal handler could run and lose the slot.

Fork safety: main's slot mappings are MADV_DONTFORK, so children forked later do
not inherit (and pin) the pool's segments. A mapping that a live lease views is
different: the user owns that batch and a forked child may read it, as with a
DataLoader batch. `share_leased_with_children()`, run just before every fork,
clears DONTFORK on those mappings and marks them `forked`, and the iterator never
reuses a forked mapping for another batch. The hook may run while other threads
make and drop mappings: it works on a snapshot of the registry (`_dontfork`, a dict
address -> weakref, copied by one C call that runs no bytecode, so no thread switch
can land in it), never on the live container.

Private mappings (`private=True`, MAP_PRIVATE): what each rank of a share_batches
group decodes its batches from (poolloader.main.share). Reading one maps the
segment's own pages, so every rank reads the same physical memory and nothing is
copied; a write copies only the page it touches, into this process alone. A page
this process has not copied shows whatever the segment holds now (a worker's next
batch included); a copied one keeps this process's bytes until `discard()` drops the
copies (MADV_DONTNEED: the next read maps the segment's page again). `pull()` copies
bytes in from another mapping of the segment instead: for a private mapping that is
registered with CUDA, whose pages must stay the ones pinned (poolloader.shm.pool,
`renew_view`).
"""
from cpython.buffer cimport PyBuffer_FillInfo
from cpython.dict cimport PyDict_Values
from cpython.weakref cimport PyWeakref_NewRef
from libc.stdint cimport uintptr_t
from libc.string cimport memcpy

cdef extern from "sys/mman.h" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int madvise(void *addr, size_t length, int advice)
    int PROT_READ, PROT_WRITE, MAP_SHARED, MAP_PRIVATE, MADV_DONTFORK, MADV_DOFORK
    int MADV_DONTNEED
    int MADV_REMOVE
    int mincore(void *addr, size_t length, unsigned char *vec)
    void *MAP_FAILED

from libc.errno cimport errno
from posix.unistd cimport getpid, pid_t

# Main's DONTFORK mappings, so the fork hook can find those a lease views: start
# address -> weakref to the Mapping. A mapping enters in __cinit__ and leaves when it
# is unmapped (an address is unique among live mappings). A dict, not a WeakSet:
# PyDict_Values copies it atomically under the GIL, while iterating a WeakSet runs
# bytecode, between which another thread may add to it ("Set changed size").
cdef dict _dontfork = {}


cdef class Mapping:
    """`size` bytes of `fd`, mapped shared and writable; see the module docstring.

    `private=True` maps it copy-on-write instead (MAP_PRIVATE): see the module
    docstring, `discard()` and `pull()`. `dontfork=True` keeps children forked later (other loaders' workers) from
    inheriting the mapping, which would keep replaced segments alive in them.
    `exports` counts live buffer exports, `leases` live Leases over it; `close()`
    unmaps early and refuses (BufferError) while any export is alive.
    """
    cdef void *_addr
    cdef readonly size_t size
    cdef readonly Py_ssize_t exports
    cdef readonly Py_ssize_t leases
    cdef readonly bint forked
    cdef readonly bint private
    cdef pid_t _owner
    cdef bint _dontfork
    cdef object __weakref__

    def __cinit__(self, int fd, size_t size, bint dontfork=False, bint private=False):
        if size == 0:
            raise ValueError("cannot map 0 bytes")
        cdef void *addr = mmap(NULL, size, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE if private else MAP_SHARED, fd, 0)
        if addr == MAP_FAILED:
            raise OSError(errno, f"mmap of {size} bytes failed")
        if dontfork:
            madvise(addr, size, MADV_DONTFORK)
        self._owner = getpid()
        self._dontfork = dontfork
        self._addr = addr
        self.size = size
        self.exports = 0
        self.leases = 0
        self.forked = False
        self.private = private
        if dontfork:
            _dontfork[<uintptr_t>addr] = PyWeakref_NewRef(self, None)

    @property
    def address(self):
        """Start address (page-aligned), e.g. for cudaHostRegister."""
        return <uintptr_t>self._addr

    @property
    def closed(self):
        return self._addr == NULL

    def share_with_children(self):
        """Let children forked from now on inherit this mapping (clears DONTFORK)
        and mark it `forked`: its bytes may be read by another process from now on."""
        self._share()

    cdef void _share(self):
        if self._addr != NULL and self._dontfork and getpid() == self._owner:
            madvise(self._addr, self.size, MADV_DOFORK)
            self._dontfork = False
        self.forked = True

    cdef void *_range(self, size_t offset, size_t length, what) except NULL:
        if self._addr == NULL:
            raise ValueError("mapping is closed")
        if offset > self.size or length > self.size - offset:
            raise ValueError(f"{what} [{offset}, {offset + length}) outside a mapping of "
                             f"{self.size} bytes")
        if not self.private:
            raise ValueError(f"{what} of a shared mapping: its pages are the segment's own")
        if self.leases:
            raise BufferError(f"cannot {what}: {self.leases} batches view this mapping")
        return <char *>self._addr + offset

    def discard(self, size_t offset, size_t length):
        """Drop this process's copies of the pages of [offset, offset + length) (a
        private mapping, no Lease alive): the next read maps the segment's own pages,
        and shows what the segment holds. `offset` is page-aligned; the range ends on
        its last page."""
        if length == 0:
            return
        cdef char *start = <char *>self._range(offset, length, "discard")
        cdef int code
        with nogil:
            code = madvise(start, length, MADV_DONTNEED)
        if code != 0:
            raise OSError(errno, f"madvise(MADV_DONTNEED) of {length} bytes at offset {offset} failed")

    def return_pages(self, size_t offset, size_t length):
        """Give the segment's pages of [offset, offset + length) back to the system
        (MADV_REMOVE: a hole punched in the memfd or tmpfs file, in every process that
        maps it; the next write there faults in zeroed pages, charged anew). A shared
        mapping with no Lease alive, which only its one owner may call (a FREE slot,
        main's; never one registered with CUDA: a pinned page would stay the device's
        while the segment got a new one). `offset` page-aligned."""
        if length == 0:
            return
        if self._addr == NULL:
            raise ValueError("mapping is closed")
        if offset > self.size or length > self.size - offset:
            raise ValueError(f"return_pages [{offset}, {offset + length}) outside a mapping "
                             f"of {self.size} bytes")
        if self.private:
            raise ValueError("return_pages of a private mapping: discard() drops its copies")
        if self.leases:
            raise BufferError(f"cannot return pages: {self.leases} batches view this mapping")
        cdef char *start = <char *>self._addr + offset
        cdef int code
        with nogil:
            code = madvise(start, length, MADV_REMOVE)
        if code != 0:
            raise OSError(errno, f"madvise(MADV_REMOVE) of {length} bytes at offset {offset} failed")

    def resident_bytes(self):
        """Bytes of this mapping whose pages are in memory now (mincore; for a shared
        mapping, the segment's pages that exist, whoever wrote them). O(pages): for
        reports, never the per-batch path."""
        if self._addr == NULL:
            return 0
        cdef size_t page = 4096
        cdef size_t pages = (self.size + page - 1) // page
        cdef bytearray vec = bytearray(pages)
        cdef unsigned char *v = vec
        cdef int code
        with nogil:
            code = mincore(self._addr, self.size, v)
        if code != 0:
            raise OSError(errno, "mincore failed")
        cdef size_t count = 0, i
        for i in range(pages):
            count += v[i] & 1
        return count * page

    def pull(self, Mapping source, size_t offset, size_t length):
        """Copy [offset, offset + length) of `source` (a mapping of the same size) into
        this private mapping (no Lease alive): every page it touches becomes this
        process's own, and keeps the bytes it has now."""
        if source._addr == NULL or source.size != self.size:
            raise ValueError("pull from a closed mapping or one of another size")
        cdef char *dest = <char *>self._range(offset, length, "pull")
        cdef char *src = <char *>source._addr + offset
        with nogil:
            memcpy(dest, src, length)

    def close(self):
        """Unmap now. Raises BufferError if a view is still alive."""
        if self._addr == NULL:
            return
        if self.exports or self.leases:
            raise BufferError(f"cannot unmap: {self.exports + self.leases} views of this "
                              "mapping are alive")
        self._unmap()

    cdef void _unmap(self):
        # A child forked after a dontfork mapping inherits this object but not the
        # pages: the address range is not ours to unmap there.
        if not (self._dontfork and getpid() != self._owner):
            munmap(self._addr, self.size)
        self._unregister()
        self._addr = NULL

    cdef void _unregister(self):
        # In a forked child the address may already belong to a new mapping there:
        # leave that one's entry (during __dealloc__ our own weakref reads None).
        if _dontfork is None:  # only while the module is torn down
            return
        key = <uintptr_t>self._addr
        ref = _dontfork.get(key)
        if ref is not None:
            current = ref()
            if current is None or current is self:
                del _dontfork[key]

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if self._addr == NULL:
            raise ValueError("mapping is closed")
        PyBuffer_FillInfo(buffer, self, self._addr, self.size, 0, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self.exports -= 1

    def __len__(self):
        return self.size

    def __dealloc__(self):
        if self._addr != NULL:
            self._unmap()


cdef class Lease:
    """`length` bytes of a mapping from `offset`, as one buffer every view of a
    batch keeps alive. Keeps the mapping mapped; weak-referenceable."""
    cdef readonly Mapping mapping
    cdef readonly size_t offset
    cdef readonly size_t length
    cdef object __weakref__

    def __cinit__(self, Mapping mapping, size_t offset, size_t length):
        if mapping._addr == NULL:
            raise ValueError("mapping is closed")
        if offset > mapping.size or length > mapping.size - offset:
            raise ValueError(f"lease [{offset}, {offset + length}) outside a mapping of "
                             f"{mapping.size} bytes")
        self.mapping = mapping
        self.offset = offset
        self.length = length
        mapping.leases += 1

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        PyBuffer_FillInfo(buffer, self, <char *>self.mapping._addr + self.offset,
                          self.length, 0, flags)

    def __releasebuffer__(self, Py_buffer *buffer):
        pass

    def __len__(self):
        return self.length

    def __dealloc__(self):
        if self.mapping is not None:
            self.mapping.leases -= 1


def take_lease(Mapping mapping, size_t offset, size_t length, dict registry, callback, key):
    """A new Lease, registered as `registry[weakref] = key` with `callback` (a C-level
    callable such as a deque's bound append) called with the weakref when it dies.

    Everything here runs in C: no signal handler can run between the lease's
    creation and its registration, so the slot it stands for is never lost."""
    cdef Lease lease = Lease(mapping, offset, length)
    ref = PyWeakref_NewRef(lease, callback)
    registry[ref] = key
    return lease


def share_leased_with_children():
    """Before a fork: every mapping a live lease views becomes inheritable and is
    marked `forked` (never reused for another batch). Returns how many.

    Safe while other threads make and drop mappings: it walks a snapshot of the
    registry taken in one C call; a mapping made after the snapshot has no lease yet."""
    cdef list refs = PyDict_Values(_dontfork)
    cdef Mapping m
    cdef Py_ssize_t n = 0
    for ref in refs:
        obj = ref()
        if obj is None:
            continue
        m = <Mapping>obj
        if m.leases and m._addr != NULL and m._dontfork:
            m._share()
            n += 1
    return n
