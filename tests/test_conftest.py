"""tests/conftest.py's process settings: no gRPC fork handlers, so a test process with gRPC threads still
running can start servers (subprocess with a preexec_fn: fork, then exec) without gRPC running its
fork handlers in the child (at CI on 2026-12-02 a simulator started that way aborted, exit -6)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_the_suite_turns_grpcs_fork_handlers_off():
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "false"


SCRIPT = textwrap.dedent("""
    import subprocess, sys, threading, time
    import grpc
    from concurrent import futures
    server = grpc.server(futures.ThreadPoolExecutor(4))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = False
    def calls():  # other threads inside gRPC while this one forks
        call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/x/y")
        while not stop:
            try:
                call(b"", timeout=0.05)
            except grpc.RpcError:
                pass
    for _ in range(4):
        threading.Thread(target=calls, daemon=True).start()
    time.sleep(0.3)
    failed = sum(subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: None).returncode != 0
                 for _ in range(40))
    stop = True
    print("failed children", failed)
""")


def run_script(fork_support: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    if fork_support is not None:
        env["GRPC_ENABLE_FORK_SUPPORT"] = fork_support
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)


def test_with_the_handlers_off_forking_beside_grpc_threads_runs_no_fork_handler():
    off = run_script("false")
    assert off.returncode == 0 and "failed children 0" in off.stdout, off.stderr[-2000:]
    assert "fork_posix" not in off.stderr, off.stderr[-2000:]
    # the control: gRPC's default here runs its fork handlers (and says it skipped them, other threads
    # being inside gRPC), which is what the setting avoids
    on = run_script(None)
    assert on.returncode == 0, on.stderr[-2000:]
    assert "skipping fork() handlers" in on.stderr, on.stderr[-2000:]
