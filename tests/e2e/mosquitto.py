"""A real MQTT broker for the tests (Debian's mosquitto, `make setup` installs it) and a test device.

`Mosquitto(tmp_dir).start()` writes a config (one listener on a free 127.0.0.1 port, anonymous,
no persistence) into the temp dir, starts `mosquitto -c` and waits until the port accepts; `stop()`
terminates that PID (and kills it if it does not exit). `Device(port, ...)` is a device in a thread
(paho-mqtt): it subscribes to a command filter and answers each command on the MQTT v5 response
topic with the correlation data (or, `v5=False`, on a fixed reply topic with the correlation id in
the payload), recording what it received; `answer=False` makes it silent.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import orjson

from extproc.stack import free_port


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto", "/usr/bin/mosquitto")
                                               if os.access(p, os.X_OK)), None)


class Mosquitto:
    def __init__(self, tmp_dir: str | Path, port: int | None = None):
        self.dir = Path(tmp_dir)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Mosquitto":
        binary = mosquitto_binary()
        if binary is None:
            raise RuntimeError("mosquitto is not installed (make setup installs Debian's mosquitto as root)")
        conf = self.dir / f"mosquitto-{self.port}.conf"
        conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\nset_tcp_nodelay true\n"
                        f"log_dest file {self.dir / f'mosquitto-{self.port}.log'}\nlog_type error\nlog_type warning\n")
        self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}; see {self.dir}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mosquitto did not listen on {self.port} within 10s") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


class Device:
    """A device in a thread: subscribes to `commands` (a topic filter) and answers each command."""

    def __init__(self, port: int, commands: str, answer: bool | Callable[[str, Any], Any] = True,
                 v5: bool = True, reply_topic: Callable[[str], str] | None = None, client_id: str = "test-device"):
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.received: list[tuple[str, Any, Any]] = []  # (topic, payload document, v5 properties)
        self.answer, self.v5, self.reply_topic = answer, v5, reply_topic
        self._subscribed = threading.Event()
        c = self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        def on_connect(cl: Any, u: Any, f: Any, rc: Any, p: Any) -> None:
            cl.socket().setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # answer at once (no Nagle wait)
            cl.subscribe(commands, qos=1)

        c.on_connect = on_connect
        c.on_subscribe = lambda cl, u, mid, rcs, p: self._subscribed.set()
        c.on_message = self._on_message
        c.connect("127.0.0.1", port)
        c.loop_start()
        if not self._subscribed.wait(10):
            raise RuntimeError(f"test device did not subscribe to {commands}")

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        doc = orjson.loads(msg.payload)
        self.received.append((msg.topic, doc, msg.properties))
        if self.answer is False:
            return
        reply = self.answer(msg.topic, doc) if callable(self.answer) else {"ok": True, "echo": doc}
        if self.v5:
            if not hasattr(msg.properties, "ResponseTopic"):  # a command that awaits no reply
                return
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = msg.properties.CorrelationData
            client.publish(msg.properties.ResponseTopic, orjson.dumps(reply), qos=1, properties=props)
        else:
            client.publish(self.reply_topic(msg.topic), orjson.dumps(reply), qos=1)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
