"""The perf/ scripts as modules for their tests (tests/test_bench_*.py, tests/test_profile_hotpath.py).

`load_perf("bench_overhead")` imports perf/bench_overhead.py under its own name, once per test process
(a second call, from another test module, gets the same module), as `python perf/NAME.py` would run it
but without running `main`.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.conftest import REPO


def load_perf(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "perf" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod
