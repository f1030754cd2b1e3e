from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension("poolloader._ring", ["poolloader/_ring.pyx"], include_dirs=["csrc"],
              extra_compile_args=["-std=c11", "-O2"], libraries=["pthread"]),
    Extension("poolloader._shm", ["poolloader/_shm.pyx"], extra_compile_args=["-O2"]),
]

setup(ext_modules=cythonize(extensions, language_level=3))
