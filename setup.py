"""Only the optional C accelerators; everything else about the package is in pyproject.toml.

`extproc.scheduling._prefix` (prefix-cache-scorer's block hashing and index search, linked with zlib)
is optional: without a C compiler or zlib's headers the install goes on and the scorer uses its
pure-Python code (the same results; tests/extproc/scheduling/test_prefix_native.py).
`extproc.scheduling._score` (the scheduling profile's normalisation, weighted sum and max-score ranking)
is optional the same way; profile.py's Python code is the reference
(tests/extproc/scheduling/test_score_native.py); -ffp-contract=off keeps its arithmetic bit-identical to
Python's (no fused multiply-add). `make setup`
builds it in place (`python setup.py build_ext --inplace`)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("extproc.scheduling._prefix", ["extproc/scheduling/_prefix.c"], libraries=["z"],
                             extra_compile_args=["-O2"], optional=True),
                   Extension("extproc.scheduling._score", ["extproc/scheduling/_score.c"],
                             extra_compile_args=["-O2", "-ffp-contract=off"], optional=True)])
