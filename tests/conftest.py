"""Shared fixtures: repo paths, free ports, config writing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
BRIEF_EXAMPLE = DATA / "brief-example.yaml"


@pytest.fixture
def write_config(tmp_path):
    """Write YAML text (dedented) to a temp file and return its path."""

    def write(text: str, name: str = "gateway.yaml") -> Path:
        p = tmp_path / name
        p.write_text(textwrap.dedent(text).lstrip())
        return p

    return write
