"""Low-latency socket options for Envoy's backend clusters and its listener, where the kernel allows them.

What: `spec.backends[].lowLatency` (and `spec.listener.lowLatency`) ask for TCP_NODELAY, SO_BUSY_POLL
(microseconds the kernel busy-polls the device queue on a blocking read instead of sleeping for the
interrupt) and TCP Fast Open (upstream: TCP_FASTOPEN_CONNECT, data in the SYN of a repeat connection;
listener: Envoy's `tcp_fast_open_queue_length`). `KernelSupport.probe()` tries each option with
setsockopt on a throw-away socket and reads /proc/sys/net/ipv4/tcp_fastopen (bit 1: client side, bit 2:
server side); `plan(spec, support, where)` returns the options to render and, for each one left out,
why (logged once per compile by `extproc/config/compile.py`). Rendered by `extproc/envoy_render.py`:
a cluster's `upstream_bind_config.socket_options` (set before connect, STATE_PREBIND), the
listener's `socket_options` (on the listening socket; Linux copies SO_BUSY_POLL to accepted ones)
and `tcp_fast_open_queue_length`.
Linux numbers (Envoy takes raw level/name): SOL_SOCKET=1, SO_BUSY_POLL=46, IPPROTO_TCP=6,
TCP_NODELAY=1, TCP_FASTOPEN=23, TCP_FASTOPEN_CONNECT=30.
Why a probe: SO_BUSY_POLL above net.core.busy_read's limit needs CAP_NET_ADMIN on some kernels, and
TCP Fast Open may be off by sysctl; Envoy would otherwise fail every connection (upstream) or the
listener (server side) on a host that refuses an option. The probe runs where the config is compiled:
the supervisor next to Envoy; a config rendered for another host (`render-k8s`) carries this host's
answer.
Note: Envoy already sets TCP_NODELAY on its upstream and downstream connections; rendering it is
explicit, not a change. Busy polling trades CPU for latency: a reading thread spins up to the given
microseconds.
Cost: nothing per request; one probe (a socket, up to four setsockopt calls, one file read) per compile
of a config that asks for low latency.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

SOL_SOCKET, SO_BUSY_POLL = 1, 46
IPPROTO_TCP, TCP_NODELAY, TCP_FASTOPEN, TCP_FASTOPEN_CONNECT = 6, 1, 23, 30
TCP_FASTOPEN_SYSCTL = Path("/proc/sys/net/ipv4/tcp_fastopen")
DEFAULT_BUSY_POLL_US = 50
DEFAULT_TFO_QUEUE = 256  # pending Fast Open requests a listener keeps


@dataclasses.dataclass(frozen=True, slots=True)
class SocketOption:
    """One `envoy.config.core.v3.SocketOption`."""
    description: str
    level: int
    name: int
    int_value: int

    def envoy(self) -> dict[str, Any]:
        return {"description": self.description, "level": self.level, "name": self.name,
                "int_value": self.int_value, "state": "STATE_PREBIND"}


@dataclasses.dataclass(frozen=True, slots=True)
class LowLatency:
    """What a backend or the listener asks for (`lowLatency: true` is all three, busy poll 50 us)."""
    tcp_no_delay: bool = True
    busy_poll_us: int = DEFAULT_BUSY_POLL_US  # 0: off
    tcp_fast_open: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class KernelSupport:
    """What this host's kernel lets a process set: None means allowed, else the reason it is not."""
    tcp_no_delay: str | None = None
    busy_poll: str | None = None
    fast_open_connect: str | None = None  # client side (upstream connections)
    fast_open_listen: str | None = None   # server side (the listener)

    @classmethod
    def probe(cls, sysctl: Path = TCP_FASTOPEN_SYSCTL) -> "KernelSupport":
        def attempt(level: int, name: int, value: int, label: str) -> str | None:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.setsockopt(level, name, value)
            except OSError as e:
                return f"setsockopt({label}) refused on this host: {e.strerror or e}"
            return None

        try:
            tfo = int(sysctl.read_text().split()[0])
        except (OSError, ValueError, IndexError) as e:
            tfo, tfo_error = None, f"{sysctl} unreadable ({e})"
        else:
            tfo_error = None
        connect = attempt(IPPROTO_TCP, TCP_FASTOPEN_CONNECT, 1, "TCP_FASTOPEN_CONNECT")
        if connect is None and tfo is not None and not tfo & 1:
            connect = f"{sysctl} is {tfo}: client-side Fast Open off (bit 1 unset)"
        listen = attempt(IPPROTO_TCP, TCP_FASTOPEN, DEFAULT_TFO_QUEUE, "TCP_FASTOPEN")
        if listen is None and tfo is not None and not tfo & 2:
            listen = f"{sysctl} is {tfo}: server-side Fast Open off (bit 2 unset)"
        return cls(
            tcp_no_delay=attempt(IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY"),
            busy_poll=attempt(SOL_SOCKET, SO_BUSY_POLL, DEFAULT_BUSY_POLL_US, "SO_BUSY_POLL"),
            fast_open_connect=connect or (tfo_error if tfo is None else None),
            fast_open_listen=listen or (tfo_error if tfo is None else None),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What to render for one cluster or the listener, and what was left out (option, reason)."""
    options: tuple[SocketOption, ...] = ()
    tfo_queue_length: int = 0  # listener only
    skipped: tuple[tuple[str, str], ...] = ()


def plan(spec: LowLatency | None, support: KernelSupport, where: str) -> Plan:
    """`where` is "upstream" (a backend cluster) or "listener"."""
    if spec is None:
        return Plan()
    options: list[SocketOption] = []
    skipped: list[tuple[str, str]] = []
    queue = 0
    if spec.tcp_no_delay:
        if support.tcp_no_delay is None:
            options.append(SocketOption("TCP_NODELAY", IPPROTO_TCP, TCP_NODELAY, 1))
        else:
            skipped.append(("TCP_NODELAY", support.tcp_no_delay))
    if spec.busy_poll_us > 0:
        if support.busy_poll is None:
            options.append(SocketOption(f"SO_BUSY_POLL {spec.busy_poll_us}us", SOL_SOCKET, SO_BUSY_POLL,
                                        spec.busy_poll_us))
        else:
            skipped.append(("SO_BUSY_POLL", support.busy_poll))
    if spec.tcp_fast_open:
        if where == "upstream":
            if support.fast_open_connect is None:
                options.append(SocketOption("TCP_FASTOPEN_CONNECT", IPPROTO_TCP, TCP_FASTOPEN_CONNECT, 1))
            else:
                skipped.append(("TCP_FASTOPEN_CONNECT", support.fast_open_connect))
        elif support.fast_open_listen is None:
            queue = DEFAULT_TFO_QUEUE
        else:
            skipped.append(("TCP_FASTOPEN", support.fast_open_listen))
    return Plan(tuple(options), queue, tuple(skipped))


def cluster_fields(p: Plan) -> dict[str, Any]:
    """Fields merged into an Envoy Cluster (none when nothing is rendered)."""
    if not p.options:
        return {}
    return {"upstream_bind_config": {"socket_options": [o.envoy() for o in p.options]}}


def listener_fields(p: Plan) -> dict[str, Any]:
    """Fields merged into Envoy's Listener."""
    fields: dict[str, Any] = {}
    if p.options:
        fields["socket_options"] = [o.envoy() for o in p.options]
    if p.tfo_queue_length:
        fields["tcp_fast_open_queue_length"] = p.tfo_queue_length
    return fields
