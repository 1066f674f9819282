"""A route's `iot` block compiled once per config load: `IotRoute` with one `Command` per name.

What: the broker the route publishes to (`BrokerConfig`, from `spec.brokers`), and per command its
topic template, payload template, optional reply topic template, response template, the JSON Schema
of its `params` (a compiled validator) and QoS. `compile_iot` returns it or a list of
(field path, reason) problems the config compiler reports with file and line.
Rules: templates are the safe template engine's (extproc/template.py: no code); a reply is awaited
at most `timeout`, which must stay below `spec.processor.messageTimeout` (Envoy would give up on the
processor first); the correlation path must be a single template path.
Cost: compile only; nothing here runs per request.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from extproc.iot.topics import TopicError, TopicTemplate, compile_topic
from extproc.template import Template, TemplateError, compile_template


@dataclass(frozen=True)
class BrokerConfig:
    """What a worker's connection to one broker is made from; a changed value means a new connection."""

    name: str
    host: str
    port: int
    client_id: str
    keepalive: float
    connect_timeout: float
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Command:
    name: str
    topic: TopicTemplate
    payload: Template
    reply_topic: TopicTemplate | None
    response: Template | None
    params: Any  # a jsonschema validator, or None
    qos: int
    retain: bool
    timeout: float


@dataclass(frozen=True)
class IotRoute:
    broker: BrokerConfig
    commands: Mapping[str, Command]
    timeout: float
    device_pattern: "re.Pattern[str]"
    correlation_path: Template

    @property
    def command_schema(self) -> dict[str, Any]:
        """The JSON Schema a model is asked to fill with a command (the optional LLM step): one option
        per command, its name as a constant and its params schema."""
        options = []
        for c in self.commands.values():
            params = dict(c.params.schema) if c.params is not None else {"type": "object"}
            options.append({"type": "object", "additionalProperties": False, "required": ["device", "command", "params"],
                            "properties": {"device": {"type": "string", "pattern": self.device_pattern.pattern},
                                           "command": {"const": c.name}, "params": params}})
        return options[0] if len(options) == 1 else {"type": "object", "anyOf": options}


def compile_broker(spec: Any) -> BrokerConfig:
    from extproc.config.schema import split_host_port

    host, port = split_host_port(spec.address)
    password = os.environ.get(spec.password_env) if spec.password_env else None
    return BrokerConfig(spec.name, host, port, spec.client_id, spec.keepalive, spec.connect_timeout,
                        spec.username, password)


def compile_iot(spec: Any, brokers: Mapping[str, BrokerConfig], message_timeout: float
                ) -> tuple[IotRoute | None, list[tuple[tuple, str]]]:
    """(the compiled route, problems as (path under `iot`, reason)); the route is None with problems."""
    problems: list[tuple[tuple, str]] = []
    if spec is None:
        return None, [((), "an iot route needs an `iot` block: its broker and commands")]
    if spec.broker is None:
        if len(brokers) != 1:
            problems.append((("broker",), "required when spec.brokers does not declare exactly one broker"))
            broker = None
        else:
            broker = next(iter(brokers.values()))
    else:
        broker = brokers.get(spec.broker)
        if broker is None:
            names = ", ".join(sorted(brokers)) or "none declared"
            problems.append((("broker",), f"no broker {spec.broker!r} in spec.brokers ({names})"))
    try:
        pattern = re.compile(spec.device_pattern)
    except re.error as e:
        problems.append((("devicePattern",), f"not a regular expression: {e}"))
        pattern = None
    try:
        corr = compile_template(spec.correlation_path)
        if len(corr.paths) != 1:
            raise TemplateError("must be one path such as $.correlationId", 1, 1)
    except TemplateError as e:
        problems.append((("correlationPath",), f"{e.message}"))
        corr = None
    commands: dict[str, Command] = {}
    for name, c in spec.commands.items():
        where = ("commands", name)
        timeout = c.timeout if c.timeout is not None else spec.timeout
        if timeout >= message_timeout:
            problems.append((where + (("timeout",) if c.timeout is not None else ()),
                             f"a timeout of {timeout:g}s must be below spec.processor.messageTimeout "
                             f"({message_timeout:g}s): Envoy would stop waiting for the processor first"))
        topics: dict[str, TopicTemplate | None] = {}
        for key, text in (("topic", c.topic), ("replyTopic", c.reply_topic)):
            if text is None:
                topics[key] = None
                continue
            try:
                topics[key] = compile_topic(text)
            except TopicError as e:
                problems.append((where + (key,), str(e)))
        templates: dict[str, Template | None] = {}
        for key, text in (("payload", c.payload), ("response", c.response)):
            if text is None:
                templates[key] = None
                continue
            try:
                templates[key] = compile_template(text)
            except TemplateError as e:
                problems.append((where + (key,), f"template error at line {e.line}, column {e.column}: {e.message}"))
        validator = None
        if c.params is not None:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(c.params)
                validator = Draft202012Validator(c.params)
            except SchemaError as e:
                problems.append((where + ("params",), f"not a valid JSON Schema: {e.message}"))
        if c.response is not None and c.reply_topic is None:
            problems.append((where + ("response",), "a response template needs a replyTopic (no reply is awaited)"))
        if "topic" in topics and "payload" in templates and ("replyTopic" in topics):
            commands[name] = Command(name, topics["topic"], templates["payload"], topics["replyTopic"],
                                     templates.get("response"), validator, c.qos, c.retain, timeout)
    if problems or broker is None or pattern is None or corr is None:
        return None, problems
    return IotRoute(broker, MappingProxyType(commands), spec.timeout, pattern, corr), []


__all__ = ["BrokerConfig", "Command", "IotRoute", "compile_broker", "compile_iot"]
