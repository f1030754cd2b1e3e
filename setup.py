import os

from Cython.Build import cythonize
from setuptools import Extension, setup

# POOLLOADER_FORCE_SEM_TIMEDWAIT=1 builds the ring's timed waits on sem_timedwait even
# where glibc has sem_clockwait (see csrc/ring.h; the tests use it to cover that path).
# The compiler prints the path it compiled ("poolloader ring: timed waits use ...").
force_timedwait = os.environ.get("POOLLOADER_FORCE_SEM_TIMEDWAIT", "") not in ("", "0")
print("poolloader: ring timed waits: "
      + ("sem_timedwait (forced by POOLLOADER_FORCE_SEM_TIMEDWAIT)" if force_timedwait
         else "sem_clockwait if the C library is glibc >= 2.30, else sem_timedwait"))

extensions = [
    Extension("poolloader.shm._ring", ["poolloader/shm/_ring.pyx"], include_dirs=["csrc"], depends=["csrc/ring.h"],
              define_macros=[("PL_FORCE_SEM_TIMEDWAIT", "1")] if force_timedwait else [],
              extra_compile_args=["-std=c11", "-O2"], libraries=["pthread"]),
    Extension("poolloader.shm._shm", ["poolloader/shm/_shm.pyx"], extra_compile_args=["-O2"]),
]

setup(ext_modules=cythonize(extensions, language_level=3))
