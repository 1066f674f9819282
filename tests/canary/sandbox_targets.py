"""Targets for tests/canary/test_preload.py: what a hostile input could make the preload do."""

from __future__ import annotations

import socket


def echo(payload):
    return {"echo": payload}


def loop(payload):
    while True:
        pass


def sleep_forever(payload):
    import time

    while True:
        time.sleep(1)


def allocate(payload):
    blocks = []
    while True:
        blocks.append(bytearray(64 << 20))


def connect(payload):
    s = socket.create_connection(("127.0.0.1", int(payload["port"])), timeout=2)
    s.close()
    return {"connected": True}


def raises(payload):
    raise ValueError("bad template")


def compile_peak(payload):
    """Compile a config file and answer the process's peak virtual memory (kB), for sizing RLIMIT_AS."""
    from extproc.config.loader import load_file

    load_file(payload["config"])
    status = open("/proc/self/status").read()
    return {"vm_peak_kb": int(status.split("VmPeak:")[1].split()[0])}
