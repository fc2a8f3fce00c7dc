"""Only the C extension: everything else is in pyproject.toml.

Page hashing in C (ckpt/_pagehash.c) needs a C compiler, Python's headers and xxhash.h
(libxxhash-dev), which `make setup` installs; without it ckpt hashes in Python, slower.
(setuptools can declare extensions in pyproject.toml too, but only experimentally.)"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckpt._pagehash", sources=["ckpt/_pagehash.c"], extra_compile_args=["-O2"])])
