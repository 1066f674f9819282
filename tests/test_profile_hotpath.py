"""perf/profile_hotpath.py: what it computes from py-spy's output and the commands it runs (no py-spy,
no servers, no timing).

- the top-N aggregation on a small raw (collapsed) py-spy sample committed as a fixture
  (tests/fixtures/pyspy/sample.raw.txt, full file names as `--full-filenames` writes them): own time
  = innermost frame, total = anywhere in the stack counted once per stack (recursion), line numbers
  merged, file names shortened to the worktree / site-packages / stdlib part, blank and malformed
  lines skipped;
- the side-by-side table (with the "same function in B" column);
- the worktree commands: `git worktree add --detach`, .venv and .tools symlinked, the .so copied, and
  its removal; the accelerator build command.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO
from tests.perf_scripts import load_perf


ph = load_perf("profile_hotpath")
SAMPLE = REPO / "tests" / "fixtures" / "pyspy" / "sample.raw.txt"
ROOTS = ["/tmp/wt-prof-abc", "/work/main/.venv/lib/python3.11/site-packages", "/usr/lib/python3.11"]


def _stacks():
    """The fixture's busy stacks (its two blocked ones split off)."""
    busy, waiting = ph.split_waiting(ph.parse_raw(SAMPLE.read_text()))
    assert waiting == 11
    return busy


def test_parse_raw_reads_stacks_and_counts_and_skips_junk():
    stacks = ph.parse_raw(SAMPLE.read_text())
    assert [c for _, c in stacks] == [7, 3, 4, 6, 5, 9, 2]
    assert stacks[2][0][-1] == "walk (/tmp/wt-prof-abc/extproc/jsonpath.py:14)"
    assert len(stacks[4][0]) == 3


def test_blocked_samples_are_split_off_by_their_innermost_frame():
    busy, waiting = ph.split_waiting(ph.parse_raw(SAMPLE.read_text()))
    assert waiting == 9 + 2  # epoll_wait under uvloop's loop, a futex through glibc's syscall() in a gRPC thread
    assert [c for _, c in busy] == [7, 3, 4, 6, 5]  # a wait call higher up the stack does not count


def test_function_key_drops_line_numbers_and_shortens_paths():
    assert ph.function_key("handle (/tmp/wt-prof-abc/extproc/stream.py:120)", ROOTS) == ("handle", "extproc/stream.py")
    assert ph.function_key("_read (/work/main/.venv/lib/python3.11/site-packages/grpc/aio/_call.py:300)", ROOTS) == (
        "_read", "grpc/aio/_call.py")
    assert ph.function_key("<module> (<string>:8)", ROOTS) == ("<module>", "<string>")
    assert ph.function_key("f (/elsewhere/x.py)", ROOTS) == ("f", "/elsewhere/x.py")
    # native frames: an address-only name becomes [native] of its library; pyenv's build tree is cut
    assert ph.function_key("0x7fb619075190 (/work/main/.venv/lib/python3.11/site-packages/grpc/_cython/cygrpc.so)",
                           ROOTS) == ("[native]", "grpc/_cython/cygrpc.so")
    assert ph.function_key("Py_DECREF (/tmp/python-build.2026/Python-3.11.7/./Include/object.h)", ROOTS) == (
        "Py_DECREF", "cpython/./Include/object.h")


def test_top_by_own_time():
    top = ph.top_functions(_stacks(), 3, ROOTS)
    assert [(t["function"], t["file"], t["own"]) for t in top] == [
        ("render", "extproc/semantic/template.py", 10),  # lines 40 and 52 merged: 7 + 3
        ("_read", "grpc/aio/_call.py", 6),
        ("_run_once", "asyncio/base_events.py", 5),
    ]
    assert top[0]["own_pct"] == 40.0  # of 25 samples
    assert top[2]["total"] == 25 and top[2]["total_pct"] == 100.0


def test_total_counts_a_recursive_function_once_per_stack():
    rows = {t["function"]: t for t in ph.top_functions(_stacks(), 100, ROOTS, by="total")}
    assert rows["walk"]["own"] == 4 and rows["walk"]["total"] == 4  # walk;walk 4 is 4 samples, not 8
    assert rows["handle"]["own"] == 0 and rows["handle"]["total"] == 14
    assert rows["<module>"]["total"] == 25
    own = {t["function"] for t in ph.top_functions(_stacks(), 100, ROOTS)}
    assert "<module>" not in own and "handle" not in own  # never innermost: not in the own-time ranking


def test_total_ranking_of_our_code_only():
    ours = ph.top_functions(_stacks(), 10, ROOTS, only=ph.OURS, by="total")
    assert [(t["function"], t["total"]) for t in ours] == [("<module>", 25), ("handle", 14), ("render", 10), ("walk", 4)]
    assert all(t["file"].startswith("extproc/") for t in ours)


def test_side_by_side_shows_where_a_function_went():
    a_stacks = _stacks()
    b_stacks = [(f, c) for f, c in a_stacks if not f[-1].startswith("render")]  # B: render gone
    a = {"label": "A", "top": ph.top_functions(a_stacks, 2, ROOTS), "all_top": ph.top_functions(a_stacks, 99, ROOTS)}
    b = {"label": "B", "top": ph.top_functions(b_stacks, 2, ROOTS), "all_top": ph.top_functions(b_stacks, 99, ROOTS)}
    lines = ph.side_by_side(a, b).splitlines()
    assert lines[0] == "| # | A function | own % | same in B % | B function | own % |"
    # A's first (render, 40 % of 25) is absent in B; B's first is _read, 6 of 15 samples
    assert lines[2] == "| 1 | `render` (extproc/semantic/template.py) | 40.0 | 0 | `_read` (grpc/aio/_call.py) | 40.0 |"
    assert lines[3].startswith("| 2 | `_read` (grpc/aio/_call.py) | 24.0 | 40.0 | `_run_once`")


def test_worktree_commands():
    repo, wt = Path("/work/main"), ph.worktree_path("52c5dad008a6")
    assert wt == Path("/tmp/wt-prof-52c5dad008a6")
    so = Path("extproc/scheduling/_prefix.cpython-311-x86_64-linux-gnu.so")
    assert ph.worktree_commands(repo, "52c5dad008a6aa", wt, [so]) == [
        ["git", "-C", "/work/main", "worktree", "add", "--detach", "/tmp/wt-prof-52c5dad008a6", "52c5dad008a6aa"],
        ["ln", "-sfn", "/work/main/.venv", "/tmp/wt-prof-52c5dad008a6/.venv"],
        ["ln", "-sfn", "/work/main/.tools", "/tmp/wt-prof-52c5dad008a6/.tools"],
        ["cp", "-p", f"/work/main/{so}", f"/tmp/wt-prof-52c5dad008a6/{so}"],
    ]
    assert ph.remove_command(repo, wt) == ["git", "-C", "/work/main", "worktree", "remove", "--force",
                                           "/tmp/wt-prof-52c5dad008a6"]


def test_accelerator_build_command_writes_next_to_the_source():
    import sysconfig
    cmd = ph.build_command(Path("/tmp/wt/extproc/scheduling/_score.c"))
    assert "-ffp-contract=off" in cmd and "-shared" in cmd  # setup.py's flag for _score's exact arithmetic
    assert cmd[cmd.index("-o") + 1] == "/tmp/wt/extproc/scheduling/_score" + sysconfig.get_config_var("EXT_SUFFIX")
