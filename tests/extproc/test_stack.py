"""extproc/stack.py's port choice: a simulator never gets a port the stack chose for itself but has not bound yet."""

from __future__ import annotations

import pytest

from extproc import stack


class FakeSocket:
    """socket.socket whose bind(("h", 0)) hands out the given ports in turn."""

    ports: list[int] = []

    def __init__(self, *a):
        self.port = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, addr):
        self.port = addr[1] or FakeSocket.ports.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_free_port_skips_the_reserved_ports(monkeypatch):
    monkeypatch.setattr(stack.socket, "socket", FakeSocket)
    FakeSocket.ports = [40001, 40002, 40003]
    assert stack.free_port(avoid={40001, 40002}) == 40003  # the kernel offered two reserved ones first
    FakeSocket.ports = [40005]
    assert stack.free_port() == 40005


def test_free_port_gives_up_when_only_reserved_ports_come(monkeypatch):
    monkeypatch.setattr(stack.socket, "socket", FakeSocket)
    FakeSocket.ports = [40001] * 100
    with pytest.raises(RuntimeError, match="no free port outside the 1 reserved"):
        stack.free_port(avoid={40001})


def test_a_real_free_port_is_bindable_and_outside_avoid():
    import socket

    first = stack.free_port()
    port = stack.free_port(avoid={first})
    assert port != first
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
