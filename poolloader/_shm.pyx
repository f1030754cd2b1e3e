# cython: language_level=3
"""A shared-memory mapping that holds no file descriptor.

Python's mmap.mmap keeps a dup of its descriptor for as long as it lives (before
3.13), which would cost the main process one descriptor per slot. Mapping maps a
descriptor with mmap(2) and keeps nothing but the address: the caller closes the
descriptor right after. The mapping exports the buffer protocol; it is unmapped
only when the last export (numpy array, torch tensor, memoryview) is gone and the
object itself dies, so no view can outlive its memory.
"""
from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdint cimport uintptr_t

cdef extern from "sys/mman.h" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int madvise(void *addr, size_t length, int advice)
    int PROT_READ, PROT_WRITE, MAP_SHARED, MADV_DONTFORK
    void *MAP_FAILED

from libc.errno cimport errno
from posix.unistd cimport getpid, pid_t


cdef class Mapping:
    """`size` bytes of `fd`, mapped shared and writable; see the module docstring.

    `dontfork=True` keeps children forked later (other loaders' workers) from
    inheriting the mapping, which would keep replaced segments alive in them.
    `exports` counts live buffer exports; `close()` unmaps early and refuses
    (BufferError) while any export is alive.
    """
    cdef void *_addr
    cdef readonly size_t size
    cdef readonly Py_ssize_t exports
    cdef pid_t _owner
    cdef bint _dontfork

    def __cinit__(self, int fd, size_t size, bint dontfork=False):
        if size == 0:
            raise ValueError("cannot map 0 bytes")
        cdef void *addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if addr == MAP_FAILED:
            raise OSError(errno, f"mmap of {size} bytes failed")
        if dontfork:
            madvise(addr, size, MADV_DONTFORK)
        self._owner = getpid()
        self._dontfork = dontfork
        self._addr = addr
        self.size = size
        self.exports = 0

    @property
    def address(self):
        """Start address (page-aligned), e.g. for cudaHostRegister."""
        return <uintptr_t>self._addr

    @property
    def closed(self):
        return self._addr == NULL

    def close(self):
        """Unmap now. Raises BufferError if a view is still alive."""
        if self._addr == NULL:
            return
        if self.exports:
            raise BufferError(f"cannot unmap: {self.exports} views of this mapping are alive")
        self._unmap()

    cdef void _unmap(self):
        # A child forked after a dontfork mapping inherits this object but not the
        # pages: the address range is not ours to unmap there.
        if not (self._dontfork and getpid() != self._owner):
            munmap(self._addr, self.size)
        self._addr = NULL

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
