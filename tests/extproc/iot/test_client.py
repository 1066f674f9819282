"""The worker's MQTT connections against a real mosquitto: QoS 1 publish, replies by v5 correlation data
or by the payload's correlation id, a silent device, a broker that is down, and reloads that keep
(or replace) the connection."""

from __future__ import annotations

import asyncio
import types

import pytest

from extproc.iot.client import BrokerClient, BrokerUnavailable, MqttClients, ReplyTimeout
from extproc.iot.commands import BrokerConfig
from extproc.stack import free_port
from extproc.template import compile_template
from tests.e2e.mosquitto import Device

CORR = compile_template("$.correlationId")


def broker(port: int, **kw) -> BrokerConfig:
    return BrokerConfig(**{"name": "plant", "host": "127.0.0.1", "port": port, "client_id": "unit",
                           "keepalive": 30.0, "connect_timeout": 2.0, **kw})


def run(coro):
    return asyncio.run(coro)


def test_a_request_gets_the_reply_correlated_by_v5_correlation_data(mosquitto):
    dev = Device(mosquitto.port, "u1/+/set")

    async def go():
        c = BrokerClient(broker(mosquitto.port))
        try:
            replies = await asyncio.gather(*(c.request(f"u1/d{i}/set", b'{"n": %d}' % i, 1, False, 2.0,
                                                       f"u1/d{i}/reply", "u1/+/reply", None, CORR) for i in range(20)))
            return replies
        finally:
            c.close()

    try:
        replies = run(go())
    finally:
        dev.stop()
    assert [r.topic for r in replies] == [f"u1/d{i}/reply" for i in range(20)]
    assert [r.payload for r in replies] == [b'{"ok":true,"echo":{"n":%d}}' % i for i in range(20)]
    assert len({r.correlation for r in replies}) == 20


def test_a_reply_without_v5_properties_is_matched_by_the_payload_correlation_id(mosquitto):
    dev = Device(mosquitto.port, "u2/+/cmd", v5=False, reply_topic=lambda t: t.replace("/cmd", "/ans"),
                 answer=lambda t, doc: {"correlationId": doc["id"], "v": 7}, client_id="u2")

    async def go():
        c = BrokerClient(broker(mosquitto.port))
        try:
            return await c.request("u2/a/cmd", b'{"id": "c-42"}', 1, False, 2.0, "u2/a/ans", "u2/+/ans", "c-42", CORR)
        finally:
            c.close()

    try:
        r = run(go())
    finally:
        dev.stop()
    assert r.correlation == "c-42" and r.payload == b'{"correlationId":"c-42","v":7}'


def test_a_silent_device_times_out_after_the_broker_acknowledged(mosquitto):
    dev = Device(mosquitto.port, "u3/+/set", answer=False, client_id="u3")

    async def go():
        c = BrokerClient(broker(mosquitto.port))
        try:
            await c.request("u3/d/set", b"{}", 1, False, 0.2, "u3/d/reply", "u3/+/reply", None, CORR)
        finally:
            c.close()

    try:
        with pytest.raises(ReplyTimeout) as e:
            run(go())
    finally:
        dev.stop()
    assert e.value.acked and e.value.topic == "u3/d/set" and "u3/d/reply" in str(e.value)
    assert len(dev.received) == 1


def test_without_a_reply_topic_the_pubacks_are_awaited(mosquitto):
    async def go():
        c = BrokerClient(broker(mosquitto.port))
        try:
            return await asyncio.gather(*(c.request(f"u4/{i}", b"{}", 1, False, 2.0) for i in range(50)))
        finally:
            c.close()

    assert run(go()) == [None] * 50


def test_a_broker_that_is_down_is_unavailable_at_once_after_the_first_failed_attempt():
    port = free_port()

    async def go():
        c = BrokerClient(broker(port, connect_timeout=1.0))
        try:
            errors = []
            for _ in range(2):
                try:
                    await c.request("x", b"{}", 1, False, 0.2)
                except BrokerUnavailable as e:
                    errors.append(str(e))
            return errors
        finally:
            c.close()

    errors = run(go())
    assert len(errors) == 2 and all(f"127.0.0.1:{port}" in e and "plant" in e for e in errors)


def test_configure_keeps_an_unchanged_brokers_connection_and_replaces_a_changed_one(mosquitto):
    def snap(cfg):
        return types.SimpleNamespace(routes={"r": types.SimpleNamespace(iot=types.SimpleNamespace(broker=cfg))})

    async def go():
        clients = MqttClients()
        a = broker(mosquitto.port)
        clients.configure(snap(a))
        first = clients.client(a)
        await first.request("u5/x", b"{}", 1, False, 2.0)
        clients.configure(snap(broker(mosquitto.port)))  # a reload with an equal broker config
        kept = clients.client(a)
        b = broker(mosquitto.port, keepalive=10.0)
        clients.configure(snap(b))  # a changed broker: the old connection is closed
        replaced = clients.client(b)
        await replaced.request("u5/y", b"{}", 1, False, 2.0)
        clients.configure(types.SimpleNamespace(routes={}))
        try:
            return first, kept, replaced, len(clients)
        finally:
            clients.close()

    first, kept, replaced, left = run(go())
    assert kept is first and first.closed and replaced is not first and replaced.closed and left == 0
