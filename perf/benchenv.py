"""What every benchmark records about where it ran (the CPU, the code revision, the command line, the
load around it) and the steps every benchmark's `main` shares: SIGTERM unwinding like Ctrl-C, the JSON
written to `--out` and the default results file, the end-of-run summary, the `__main__` guard.

Imported by the perf/ scripts (run as `python perf/NAME.py`, so this folder is on sys.path).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

# Before a benchmark imports grpc: no gRPC fork handlers (benchmarks start stacks with subprocess and a
# preexec_fn while their own gRPC clients run; every fork is followed by exec; see tests/conftest.py).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

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


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """`.venv/bin/python perf/NAME.py` and the arguments (`argv`, or this process's when None), shell-quoted."""
    return " ".join([f".venv/bin/python {script}", *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))])


def _on_sigterm(*_: object) -> None:
    raise KeyboardInterrupt


def sigterm_unwinds(argv: Sequence[str] | None) -> None:
    """Run from the command line (`argv` None): SIGTERM unwinds like Ctrl-C, so the caller's `finally` stops
    everything it started. Called from a test (`argv` given), the signal handling is left alone."""
    if argv is None:
        signal.signal(signal.SIGTERM, _on_sigterm)


def load_text(load_start: Sequence[float], load_end: Sequence[float], idle_load: float) -> str:
    """The load averages at the start and the end, and the cores other processes used just before."""
    return (f"load average {load_start[0]:.2f} / {load_start[1]:.2f} / {load_start[2]:.2f} at the start, "
            f"{load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f} at the end "
            f"(other processes used {idle_load:.2f} cores just before)")


def write_json(text: str, out: Path | str | None, no_write: bool, default: Path, say: bool = True) -> None:
    """The run's JSON `text` to `out` (`--out`) when given and, unless `no_write` (`--no-write`), to the
    script's `default` results file (once, when `out` is that file); `say`: print `wrote PATH` for each."""
    outs = [Path(out)] if out else []
    if not no_write and default not in outs:
        outs.append(default)
    for path in outs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if say:
            print(f"wrote {path}")


def report(table: str, goals: Sequence[str], elapsed: float, text: str, out: Path | str | None, no_write: bool,
           default: Path) -> None:
    """The end of a run over simulators (bench_routing, bench_qos): on stdout the table, each goal checked as a
    list item and the elapsed seconds; the JSON `text` written as `write_json` writes it (without saying so)."""
    print("\n" + table + "\n\n" + "\n".join("- " + g for g in goals) + f"\n\nelapsed {elapsed:.0f} s")
    write_json(text, out, no_write, default, say=False)


def run(main: Callable[[], int]) -> None:
    """The `__main__` guard: exit with `main()`'s code; on Ctrl-C (or SIGTERM, see `sigterm_unwinds`), 130."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: everything started was stopped", file=sys.stderr)
        sys.exit(130)


def md_table(rows: Sequence[dict], columns: Sequence[tuple[str, str | Callable[[dict], str], str | None]]) -> str:
    """A Markdown table, one line per row of `rows`. `columns`: (header, key, format) each; the cell is the
    row's value at `key` through `format` (a str.format pattern; `-` for None), right-aligned; with format
    None the value as it is, left-aligned. `key` may be a function of the row giving the cell's text."""
    out = ["| " + " | ".join(head for head, _, _ in columns) + " |",
           "|" + "".join("---|" if fmt is None else "---:|" for _, _, fmt in columns)]
    for r in rows:
        cells = []
        for _, key, fmt in columns:
            if callable(key):
                cells.append(key(r))
            else:
                v = r[key]
                cells.append(str(v) if fmt is None else "-" if v is None else fmt.format(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
