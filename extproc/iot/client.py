"""The worker's MQTT connections: one `BrokerClient` per broker, held by the runtime (`Runtime.mqtt`).

What: `MqttClients.configure(snapshot)` keeps a connection per broker the snapshot's iot routes
use: an unchanged `BrokerConfig` keeps its client (connection, subscriptions, pending replies), so
a reload that changes only templates costs nothing here; a changed or removed broker's client is
closed (in a thread: paho's stop joins its network thread). `BrokerClient.request(...)` publishes one
command and waits for the broker's acknowledgement (QoS 1: PUBACK) and, with a reply topic, for
the device's reply:
- the connection is MQTT v5 (paho-mqtt 2.x), made by paho's network thread (`connect_async` +
  `loop_start`), which also reconnects (0.1 s, doubling to 2 s); requests never block the event
  loop: paho's callbacks run in its thread and hand results over with `call_soon_threadsafe`;
- replies: each command's reply topic template is subscribed once as a filter (`plant/+/reply`),
  not once per device, and re-subscribed after a reconnect; the request publishes with the v5
  `ResponseTopic` (the rendered reply topic) and `CorrelationData` (its correlation id), and a
  reply is matched by its v5 correlation data, else by the correlation path in its JSON payload;
  replies nobody waits for (late, or another worker's) are dropped;
- errors: `BrokerUnavailable` (not connected within the broker's `connectTimeout`: 503) and
  `ReplyTimeout` (no reply within the command's timeout: 504; `acked` says whether the broker had
  acknowledged the publish, i.e. whether it was the device that stayed silent).
Every worker subscribes with its own client id (`<clientId>-<pid>`), so each receives every
reply on the filters it subscribed and drops those of others' requests: N workers, N deliveries.
Cost per command: one publish handed to paho's thread (a socket-pair wake-up), the PUBACK and the
reply each one cross-thread hand-over (tens of microseconds); the first command of a reply filter
waits for its SUBACK once. perf/bench_iot.py measures the whole.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Mapping

import orjson

from extproc.iot.commands import BrokerConfig

log = logging.getLogger(__name__)


class BrokerUnavailable(Exception):
    def __init__(self, broker: BrokerConfig, why: str):
        super().__init__(f"MQTT broker {broker.name} ({broker.address}) is unavailable: {why}")
        self.broker = broker


class ReplyTimeout(Exception):
    def __init__(self, topic: str, reply_topic: str | None, timeout: float, acked: bool):
        what = (f"no reply on {reply_topic} within {timeout:g}s" if reply_topic is not None
                else f"the broker did not acknowledge within {timeout:g}s")
        if reply_topic is not None and not acked:
            what += " (the broker had not acknowledged the publish either)"
        super().__init__(f"command published to {topic}: {what}")
        self.topic, self.reply_topic, self.acked = topic, reply_topic, acked


class Reply:
    __slots__ = ("payload", "topic", "correlation")

    def __init__(self, payload: bytes, topic: str, correlation: str):
        self.payload, self.topic, self.correlation = payload, topic, correlation


class BrokerClient:
    """One MQTT v5 connection of this worker to one broker (paho's network thread, started at once)."""

    def __init__(self, config: BrokerConfig, loop: asyncio.AbstractEventLoop | None = None):
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.config = config
        self._Properties, self._PUBLISH = Properties, PacketTypes.PUBLISH
        self._loop = loop or asyncio.get_running_loop()
        self._lock = threading.Lock()  # the dicts below are shared with paho's thread; never held across paho calls
        self._replies: dict[str, asyncio.Future] = {}  # correlation id -> waiting request
        self._acks: dict[int, asyncio.Future] = {}  # publish mid -> waiting request
        self._early_acks: set[int] = set()  # PUBACKs that came before their waiter was registered
        self._subscribed: dict[str, asyncio.Future] = {}  # filter -> SUBACK (done once subscribed)
        self._sub_mids: dict[int, str] = {}
        self._early_subacks: dict[int, Any] = {}  # SUBACKs that came before their mid was registered
        self._corr_paths: dict[str, Any] = {}  # correlation path text -> compiled template
        self._connected = asyncio.Event()
        self.last_error: str | None = None  # why the last connection attempt failed (None: never failed)
        self.closed = False
        c = self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{config.client_id}-{os.getpid()}",
                                       protocol=mqtt.MQTTv5)
        if config.username is not None:
            c.username_pw_set(config.username, config.password)
        c.reconnect_delay_set(0.1, 2.0)
        c.on_connect, c.on_disconnect, c.on_connect_fail = self._on_connect, self._on_disconnect, self._on_connect_fail
        c.on_message, c.on_publish, c.on_subscribe = self._on_message, self._on_publish, self._on_subscribe
        c.connect_async(config.host, config.port, keepalive=max(1, int(config.keepalive)), clean_start=True)
        c.loop_start()

    # --- paho's thread ------------------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (worker stopping)
            pass

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            self.last_error = f"the broker refused the connection: {reason}"
            return
        self.last_error = None
        sock = client.socket()
        if sock is not None:  # small messages both ways: Nagle would hold a reply behind the PUBACK's ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            filters = list(self._subscribed)
            self._sub_mids.clear()
        for flt in filters:  # clean start: the broker forgot them
            rc, mid = client.subscribe(flt, qos=1)
            with self._lock:
                self._sub_mids[mid] = flt
        self._call(self._connected.set)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self.last_error = f"connection lost: {reason}"
        self._call(self._connected.clear)

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        self.last_error = "cannot connect"
        self._call(self._connected.clear)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        with self._lock:
            flt = self._sub_mids.pop(mid, None)
            fut = self._subscribed.get(flt) if flt is not None else None
            if flt is None:
                self._early_subacks[mid] = reasons
        if fut is not None:
            self._call(_suback, fut, flt, reasons)

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        with self._lock:
            fut = self._acks.pop(mid, None)
            if fut is None:
                self._early_acks.add(mid)
        if fut is not None:
            self._call(_resolve, fut, None)

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        corr = None
        data = getattr(msg.properties, "CorrelationData", None) if msg.properties is not None else None
        if data:
            corr = data.decode("utf-8", "replace")
        else:
            try:
                doc = orjson.loads(msg.payload)
            except orjson.JSONDecodeError:
                return
            for path in self._corr_paths.values():
                try:
                    v = path.render(doc)
                except Exception:  # missing path: not this reply's shape
                    continue
                if isinstance(v, str):
                    corr = v
                    break
        if corr is None:
            return
        with self._lock:
            fut = self._replies.pop(corr, None)
        if fut is not None:
            self._call(_resolve, fut, Reply(msg.payload, msg.topic, corr))

    # --- the event loop -----------------------------------------------------------------------------

    async def _ready(self) -> None:
        if self._connected.is_set():
            return
        if self.last_error is not None:  # the last attempt failed: answer now, paho keeps retrying
            raise BrokerUnavailable(self.config, self.last_error)
        try:
            await asyncio.wait_for(self._connected.wait(), self.config.connect_timeout)
        except asyncio.TimeoutError:
            raise BrokerUnavailable(self.config, self.last_error or
                                    f"not connected within {self.config.connect_timeout:g}s") from None

    async def _subscribe(self, flt: str) -> None:
        fut = self._subscribed.get(flt)
        if fut is None:
            fut = self._loop.create_future()
            with self._lock:
                self._subscribed[flt] = fut
            rc, mid = self._client.subscribe(flt, qos=1)
            with self._lock:
                early = self._early_subacks.pop(mid, None)
                if early is None:
                    self._sub_mids[mid] = flt
            if early is not None:
                _suback(fut, flt, early)
        if not fut.done():
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.config.connect_timeout)
            except asyncio.TimeoutError:
                raise BrokerUnavailable(self.config, f"no SUBACK for {flt} within "
                                        f"{self.config.connect_timeout:g}s") from None
        if fut.exception() is not None:
            with self._lock:
                self._subscribed.pop(flt, None)
            raise BrokerUnavailable(self.config, str(fut.exception()))

    async def request(self, topic: str, payload: bytes, qos: int, retain: bool, timeout: float,
                      reply_topic: str | None = None, reply_filter: str | None = None,
                      correlation: str | None = None, correlation_path: Any = None) -> Reply | None:
        """Publish `payload` on `topic`; wait for the PUBACK (QoS > 0) and, with `reply_topic`, the reply
        correlated by `correlation` (a fresh id when None). Raises BrokerUnavailable, ReplyTimeout."""
        await self._ready()
        props = None
        reply_fut = None
        if reply_topic is not None:
            if correlation_path is not None and correlation_path.source not in self._corr_paths:
                self._corr_paths = {**self._corr_paths, correlation_path.source: correlation_path}
            await self._subscribe(reply_filter or reply_topic)
            correlation = correlation or secrets.token_hex(8)
            props = self._Properties(self._PUBLISH)
            props.ResponseTopic = reply_topic
            props.CorrelationData = correlation.encode()
            reply_fut = self._loop.create_future()
            with self._lock:
                self._replies[correlation] = reply_fut
        info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        ack_fut = None
        if qos > 0 and info.rc == 0:
            ack_fut = self._loop.create_future()
            with self._lock:
                early = info.mid in self._early_acks
                if early:
                    self._early_acks.discard(info.mid)
                else:
                    self._acks[info.mid] = ack_fut
            if early:
                ack_fut.set_result(None)
        if info.rc != 0:
            self._forget(correlation, None)
            raise BrokerUnavailable(self.config, f"publish refused (paho rc {info.rc})")
        waits = [f for f in (ack_fut, reply_fut) if f is not None]
        try:
            if waits:
                await asyncio.wait_for(asyncio.gather(*waits), timeout)
        except asyncio.TimeoutError:
            acked = ack_fut is None or (ack_fut.done() and not ack_fut.cancelled())
            raise ReplyTimeout(topic, reply_topic, timeout, acked) from None
        finally:
            self._forget(correlation if reply_fut is not None else None, info.mid if ack_fut is not None else None)
        return reply_fut.result() if reply_fut is not None else None

    def _forget(self, correlation: str | None, mid: int | None) -> None:
        with self._lock:
            if correlation is not None:
                self._replies.pop(correlation, None)
            if mid is not None:
                self._acks.pop(mid, None)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def close(self) -> None:
        """Disconnect and stop paho's thread, in a thread of its own (its stop joins the network thread)."""
        if self.closed:
            return
        self.closed = True

        def stop() -> None:
            try:
                self._client.disconnect()
            finally:
                self._client.loop_stop()

        threading.Thread(target=stop, name=f"mqtt-close-{self.config.name}", daemon=True).start()


def _suback(fut: asyncio.Future, flt: str, reasons: Any) -> None:
    failed = [r for r in reasons if r.is_failure]
    _resolve(fut, None if not failed else RuntimeError(f"subscribe {flt} refused: {failed[0]}"))


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


class MqttClients:
    """The worker's broker connections by broker name; `configure(snapshot)` on every install."""

    def __init__(self) -> None:
        self._clients: dict[str, BrokerClient] = {}

    @staticmethod
    def brokers_of(snapshot: Any) -> dict[str, BrokerConfig]:
        out: dict[str, BrokerConfig] = {}
        for r in getattr(snapshot, "routes", {}).values():
            iot = getattr(r, "iot", None)
            if iot is not None:
                out[iot.broker.name] = iot.broker
        return out

    def configure(self, snapshot: Any) -> None:
        """Keep the clients of unchanged brokers, close changed and removed ones. New ones are made on
        first use (inside the worker's loop: paho's callbacks need it)."""
        wanted = self.brokers_of(snapshot)
        for name in list(self._clients):
            if wanted.get(name) != self._clients[name].config:
                self._clients.pop(name).close()

    def client(self, broker: BrokerConfig) -> BrokerClient:
        """The connection to `broker`, made now if this worker has none for that exact config (a request
        of an older snapshot with another broker config replaces it; Envoy's routes lag a reload only briefly)."""
        c = self._clients.get(broker.name)
        if c is not None and c.config == broker:
            return c
        if c is not None:
            c.close()
        c = self._clients[broker.name] = BrokerClient(broker)
        return c

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def __len__(self) -> int:
        return len(self._clients)


__all__ = ["BrokerClient", "BrokerUnavailable", "MqttClients", "ReplyTimeout", "Reply"]
