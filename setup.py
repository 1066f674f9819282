"""Only the optional C accelerator; everything else about the package is in pyproject.toml.

`extproc.scheduling._prefix` (prefix-cache-scorer's block hashing and index search, linked with zlib)
is optional: without a C compiler or zlib's headers the install goes on and the scorer uses its
pure-Python code (the same results; tests/extproc/scheduling/test_prefix_native.py). `make setup`
builds it in place (`python setup.py build_ext --inplace`)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("extproc.scheduling._prefix", ["extproc/scheduling/_prefix.c"], libraries=["z"],
                             extra_compile_args=["-O2"], optional=True)])
