"""Shared fixtures: repo paths, free ports, config writing."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

# Before any test imports grpc (it reads this once): no gRPC fork handlers in the test processes. They
# start servers with subprocess and a preexec_fn, which forks while gRPC threads of earlier tests may
# still run; the handlers then run in the child between fork and exec and can abort it (a simulator
# "exited with code -6 during start-up" at CI, 2026-12-02; grpc doc/fork_support.md: set it to false
# when every fork is followed by exec).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest  # noqa: E402

from extproc.stack import PORT_SLICE_ENV  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
BRIEF_EXAMPLE = DATA / "brief-example.yaml"


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs the suite on several workers) each worker, and every process
    it starts (the variable is inherited), picks ports in its own slice (extproc/stack.py free_port):
    a port one worker chose but has not bound yet is never another's choice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count and worker[2:].isdigit():
        os.environ[PORT_SLICE_ENV] = f"{int(worker[2:])}/{count}"


@pytest.fixture
def write_config(tmp_path):
    """Write YAML text (dedented) to a temp file and return its path."""

    def write(text: str, name: str = "gateway.yaml") -> Path:
        p = tmp_path / name
        p.write_text(textwrap.dedent(text).lstrip())
        return p

    return write


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the end-to-end files (the long ones: 10 s to 5 min each) go first, so the
    workers do not end with one of them running alone; pytest-randomly has already shuffled the files
    and their tests, and this stable sort keeps that order inside each group (xdist's `loadfile` hands
    out whole files in this order). Without xdist the order is pytest-randomly's alone."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    e2e = REPO / "tests" / "e2e"
    items.sort(key=lambda item: 0 if item.path.is_relative_to(e2e) else 1)
