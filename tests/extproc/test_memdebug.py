"""extproc.memdebug: off unless ADAPTER_TRACEMALLOC asks; on, SIGUSR2 writes a snapshot that compare reads."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import tracemalloc

from extproc import memdebug


class _Loop:
    def __init__(self):
        self.handlers = {}

    def add_signal_handler(self, sig, fn):
        self.handlers[sig] = fn


def test_off_by_default_and_for_zero_or_garbage():
    for env in ({}, {memdebug.ENV: ""}, {memdebug.ENV: "0"}, {memdebug.ENV: "yes"}):
        loop = _Loop()
        assert memdebug.install(loop, "/nonexistent", 0, environ=env) is None, env
        assert loop.handlers == {}, env
    assert memdebug.frames_from_env({memdebug.ENV: "3"}) == 3


def test_on_a_dump_per_signal_and_the_diff_names_the_growing_line(tmp_path):
    loop = _Loop()
    was = tracemalloc.is_tracing()
    try:
        out = memdebug.install(loop, str(tmp_path / "state"), 7, environ={memdebug.ENV: "1"})
        assert out == str(tmp_path / "state") and tracemalloc.is_tracing()
        dump = loop.handlers[signal.SIGUSR2]
        dump()
        kept = [bytearray(1000) for _ in range(200)]  # the growth the diff must show
        dump()
        snaps = sorted(p for p in os.listdir(out) if p.endswith(".snap"))
        assert snaps == [f"tracemalloc-7-{os.getpid()}-0.snap", f"tracemalloc-7-{os.getpid()}-1.snap"]
        assert all(os.path.exists(os.path.join(out, s + ".json")) for s in snaps)
        top = memdebug.compare(os.path.join(out, snaps[0]), os.path.join(out, snaps[1]), top=3)
        grown = re.search(r"size=[^(]*\(\+(\d+) KiB\)", top[0])
        assert "test_memdebug.py:" in top[0] and grown and int(grown.group(1)) >= 195, top  # 200 x 1000 B
        del kept
    finally:
        if not was:
            tracemalloc.stop()


def test_the_dump_directory_env_wins_over_the_state_dir(tmp_path):
    loop = _Loop()
    was = tracemalloc.is_tracing()
    try:
        out = memdebug.install(loop, str(tmp_path / "state"), 0,
                               environ={memdebug.ENV: "1", memdebug.DIR_ENV: str(tmp_path / "snaps")})
        assert out == str(tmp_path / "snaps")
    finally:
        if not was:
            tracemalloc.stop()


def test_the_worker_installs_it_with_a_real_loop_only_when_asked(monkeypatch, tmp_path):
    async def main(env):
        loop = asyncio.get_running_loop()
        try:
            return memdebug.install(loop, str(tmp_path), 0, environ=env)
        finally:
            loop.remove_signal_handler(signal.SIGUSR2)

    was = tracemalloc.is_tracing()
    try:
        assert asyncio.run(main({})) is None
        assert asyncio.run(main({memdebug.ENV: "2"})) == str(tmp_path) and tracemalloc.get_traceback_limit() == 2
    finally:
        if not was:
            tracemalloc.stop()
