"""extproc/stack.py's port choice: a simulator never gets a port the stack chose for itself but has not bound
yet, and no outgoing connection gets a port chosen but not yet bound (ports come from outside the kernel's
ephemeral range)."""

from __future__ import annotations

import pytest

from extproc import stack


@pytest.fixture
def kernel_choice(monkeypatch):
    """free_port falls back to the kernel's bind(0) choice (no fixed range), for the FakeSocket tests."""
    monkeypatch.setattr(stack, "fixed_port_range", lambda: None)


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


def test_free_port_skips_the_reserved_ports(monkeypatch, kernel_choice):
    monkeypatch.delenv(stack.PORT_SLICE_ENV, raising=False)  # no slice (make test sets one per worker)
    monkeypatch.setattr(stack.socket, "socket", FakeSocket)
    FakeSocket.ports = [40001, 40002, 40003]
    assert stack.free_port(avoid={40001, 40002}) == 40003  # the kernel offered two reserved ones first
    FakeSocket.ports = [40005]
    assert stack.free_port() == 40005


def test_free_port_gives_up_when_only_reserved_ports_come(monkeypatch, kernel_choice):
    monkeypatch.delenv(stack.PORT_SLICE_ENV, raising=False)  # no slice (make test sets one per worker)
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


def test_a_port_slice_gives_disjoint_ports_and_blocks_that_stay_inside_it(monkeypatch, kernel_choice):
    monkeypatch.setattr(stack.socket, "socket", FakeSocket)
    monkeypatch.setenv(stack.PORT_SLICE_ENV, "1/3")  # 64-port blocks: block b is slice b % 3
    assert [(p // 64) % 3 for p in (40000, 40001, 40063, 40070, 40130)] == [1, 1, 1, 2, 0]
    FakeSocket.ports = [40070, 40130, 40000]
    assert stack.free_port() == 40000  # the kernel offered two other slices' ports first
    FakeSocket.ports = [40001, 40070, 40063]
    assert stack.free_port(avoid={40001}) == 40063
    FakeSocket.ports = [40063, 40010]  # two ports from 40063 would cross into the next block (slice 2)
    assert stack.free_port(width=2) == 40010


def test_a_malformed_port_slice_is_refused_with_its_name(monkeypatch):
    monkeypatch.setenv(stack.PORT_SLICE_ENV, "3/3")
    with pytest.raises(ValueError, match="ADAPTER_PORT_SLICE='3/3': expected k/n"):
        stack.free_port()


def test_the_suite_runs_each_xdist_worker_in_its_own_slice():
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        pytest.skip("not under pytest-xdist (`make test` runs it): no port slice is set for this run")
    k, n = stack._port_slice()
    assert (k, n) == (int(worker[2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    assert stack._in_slice(stack.free_port(), 1, (k, n)) and stack._in_slice(stack.free_port_block(4), 4, (k, n))


def test_the_fixed_range_lies_below_or_above_the_kernels_ephemeral_range(tmp_path):
    f = tmp_path / "ip_local_port_range"
    f.write_text("32768\t60999\n")  # the default
    assert stack.fixed_port_range(str(f)) == (20000, 32767)
    f.write_text("15000 40000\n")  # too little room below: above it
    assert stack.fixed_port_range(str(f)) == (40001, 65535)
    f.write_text("1024 65000\n")  # no room either side: the kernel's bind(0)
    assert stack.fixed_port_range(str(f)) is None
    f.write_text("garbage\n")
    assert stack.fixed_port_range(str(f)) is None
    assert stack.fixed_port_range(str(tmp_path / "absent")) is None


def test_real_free_ports_come_from_outside_the_ephemeral_range_when_there_is_one():
    span = stack.fixed_port_range()
    if span is None:
        pytest.skip(f"{stack.EPHEMERAL_RANGE} absent or leaves no room outside the ephemeral range")
    for _ in range(20):
        port = stack.free_port()
        assert span[0] <= port <= span[1]
    base = stack.free_port_block(4)
    assert span[0] <= base and base + 3 <= span[1]


def test_a_port_that_is_taken_is_not_offered(monkeypatch):
    import socket

    monkeypatch.delenv(stack.PORT_SLICE_ENV, raising=False)
    with socket.socket() as held:  # two neighbouring ports: one held (bound and listening), one free
        for _ in range(100):
            lo = stack.free_port()
            if stack._bindable("127.0.0.1", lo + 1):
                break
        held.bind(("127.0.0.1", lo))
        held.listen()
        monkeypatch.setattr(stack, "fixed_port_range", lambda: (lo, lo + 1))
        assert {stack.free_port() for _ in range(20)} == {lo + 1}
        monkeypatch.setattr(stack, "fixed_port_range", lambda: (lo, lo))
        with pytest.raises(RuntimeError, match=f"no free port .* in {lo}-{lo}"):
            stack.free_port()
