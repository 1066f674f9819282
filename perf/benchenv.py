"""What every benchmark records about where it ran: the CPU and the code revision.

Imported by the perf/ scripts (run as `python perf/NAME.py`, so this folder is on sys.path).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu() -> str:
    """`"AMD EPYC, 2 cores"`: the CPU model from /proc/cpuinfo and the core count."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def git_revision(*paths: str) -> str:
    """The short commit, with a mark when tracked files (under `paths`, default all) have changes."""
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--",
                                *paths], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    where = f" in {', '.join(paths)}" if paths else ""
    return rev + (f" with uncommitted changes{where}" if dirty else "")


RESULTS = REPO / "perf" / "RESULTS.md"


def append_results(text: str) -> None:
    """Append a section to perf/RESULTS.md and say so."""
    with RESULTS.open("a", encoding="utf-8") as f:
        f.write(text)
    print(f"appended to {RESULTS.relative_to(REPO)}")
