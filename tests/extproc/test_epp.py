"""EPP mode (extproc/epp.py) in process: the config, the subset hint, and one stream's replies.

Through a real Envoy in tests/e2e/test_epp_mode.py; here the parts Envoy does not vary: the
`spec.epp` checks, the hint's two encodings, a body larger than one streamed chunk going back
whole and in order, the BUFFERED reply shape, and the outcome counted once per request.
"""

from __future__ import annotations

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from extproc import codec
from extproc.config.loader import ConfigError, load_text
from extproc.epp import CHUNK, SUBSET_KEY, SUBSET_NAMESPACE, restrict, subset_of
from extproc.metrics import ProcessorMetrics
from extproc.stream import ConfigRef, ExtProcService
from extproc.types import Outcome
from tests.extproc.test_stream import _Context

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: epp}
spec:
  processor: {basePort: 9002, feedback: stream}
  backends:
    - name: pool
      endpoints: [{address: "10.0.0.1:8000", labels: {gpu: a100}}, "10.0.0.2:8000", "10.0.0.2:8001"]
  plugins:
    - {type: in-flight-scorer}
    - {type: max-score-picker, parameters: {fallbacks: 1}}
    - {name: a100, type: label-filter, parameters: {matchLabels: {gpu: a100}}}
  schedulingProfiles:
    - {name: spread, plugins: [{pluginRef: in-flight-scorer}, {pluginRef: max-score-picker}]}
    - {name: on-a100, plugins: [{pluginRef: a100}, {pluginRef: in-flight-scorer}]}
  epp: {pool: pool, profile: PROFILE, healthPort: 9003, modelRewrites: {alias: base}}
"""


def snapshot(profile: str = "spread", text: str = CONFIG):
    return load_text(text.replace("PROFILE", profile), "epp.yaml")


def test_subset_hint_as_a_list_or_a_comma_separated_string():
    assert subset_of(None) is None
    assert subset_of("10.0.0.1:8000, 10.0.0.2:8000") == ("10.0.0.1:8000", "10.0.0.2:8000")
    assert subset_of(["10.0.0.1:8000", "10.0.0.2:8000,10.0.0.2:8001"]) == ("10.0.0.1:8000", "10.0.0.2:8000",
                                                                          "10.0.0.2:8001")
    assert subset_of([]) == ()  # a hint with no entry: nothing is eligible (503)
    pool = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.2:8001", "[fd00::1]:8000")
    assert restrict(pool, None) == pool
    assert restrict(pool, ("10.0.0.2:8001", "10.9.9.9:1")) == ("10.0.0.2:8001",)
    assert restrict(pool, ("10.0.0.2", "fd00::1")) == ("10.0.0.2:8000", "10.0.0.2:8001", "[fd00::1]:8000")
    assert restrict(pool, ()) == ()


@pytest.mark.parametrize("change, error", [
    (("pool: pool,", "pool: nope,"), "spec.epp.pool: no backend named 'nope' (backends: pool)"),
    (('"10.0.0.2:8000"', '"model-b:8000"'), "spec.epp.pool: the endpoint-picker protocol names endpoints as "
                                            "ip:port: backend 'pool' lists host names"),
    (("profile: PROFILE", "profile: nope"), "spec.epp.profile: no plugin or scheduling profile named 'nope'"),
    (("profile: PROFILE", "profile: a100"), "spec.epp.profile: 'a100' is a filter"),
    (("basePort: 9002,", "basePort: 9002, workers: 2,"), "spec.processor.workers: EPP mode serves one port"),
    (("healthPort: 9003", "healthPort: 9002"), "port 9002 is also used by spec.processor.basePort"),
    (("healthPort: 9003", "tls: {certFile: /nonexistent/epp.crt, keyFile: /nonexistent/epp.key}"),
     "spec.epp.tls.certFile: cannot read /nonexistent/epp.crt"),
    (("healthPort: 9003", "tls: {certFile: epp.crt, keyFile: /epp.key}"), "spec.epp.tls.certFile: String should match"),
])
def test_epp_config_errors_name_the_field(change, error):
    with pytest.raises(ConfigError) as e:
        snapshot(text=CONFIG.replace(*change))
    assert error in str(e.value)


def test_routes_are_optional_only_in_epp_mode():
    assert snapshot().epp.pool.name == "pool" and snapshot().epp.health_port == 9003
    with pytest.raises(ConfigError) as e:
        snapshot(text=CONFIG.replace("  epp: {pool: pool, profile: PROFILE, healthPort: 9003, "
                                     "modelRewrites: {alias: base}}\n", ""))
    assert "spec.routes: at least one route is needed (or an `epp` section: EPP mode)" in str(e.value)


def request_headers(subset=None, mode="FULL_DUPLEX_STREAMED", eos=False):
    req = pb.ProcessingRequest()
    for k, v in ((":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")):
        h = req.request_headers.headers.headers.add()
        h.key, h.raw_value = k, v.encode()
    req.request_headers.end_of_stream = eos
    if subset is not None:
        fields = req.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields
        if isinstance(subset, str):
            fields[SUBSET_KEY].string_value = subset
        else:
            fields[SUBSET_KEY].list_value.SetInParent()
            for s in subset:
                fields[SUBSET_KEY].list_value.values.add().string_value = s
    req.protocol_config.request_body_mode = codec._BODY_MODES.Value(mode)
    req.protocol_config.response_body_mode = codec._BODY_MODES.Value(mode)
    return req


def body(data: bytes, eos: bool):
    req = pb.ProcessingRequest()
    req.request_body.body = data
    req.request_body.end_of_stream = eos
    return req


async def run(snap, messages):
    svc = ExtProcService(ConfigRef(snap), ProcessorMetrics(CollectorRegistry()))
    outcomes = []
    svc.runtime.lifecycle.observers.append(lambda state, outcome: outcomes.append((state, outcome)))

    async def source():
        for m in messages:
            yield m
    replies = [r async for r in svc.Process(source(), _Context())]  # no x-adapter-route: EPP mode
    return replies, outcomes


def destination(reply):
    part = reply.request_headers if reply.HasField("request_headers") else reply.request_body
    headers = {h.header.key: h.header.raw_value.decode() for h in part.response.header_mutation.set_headers}
    meta = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert headers["x-gateway-destination-endpoint"] == meta.string_value  # the protocol: never two values
    return meta.string_value


async def test_streamed_body_is_sent_back_whole_in_chunks_after_the_headers_reply():
    prompt = "x" * (2 * CHUNK)
    raw = orjson.dumps({"model": "alias", "messages": [{"role": "user", "content": prompt}]})
    half = len(raw) // 2
    replies, outcomes = await run(snapshot(), [request_headers(["10.0.0.2:8000", "10.0.0.2:8001"]),
                                               body(raw[:half], False), body(raw[half:], True)])
    # nothing until the body has ended; then the headers reply with the pick, then the body
    assert [r.WhichOneof("response") for r in replies] == ["request_headers"] + ["request_body"] * 3
    picked = destination(replies[0]).split(",")
    assert sorted(picked) == ["10.0.0.2:8000", "10.0.0.2:8001"]  # the hint's two; the pick and one fallback
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert [len(c.body) <= CHUNK for c in chunks] == [True] * 3 and [c.end_of_stream for c in chunks] == [
        False, False, True]
    sent = orjson.loads(b"".join(c.body for c in chunks))
    assert sent["model"] == "base" and sent["messages"][0]["content"] == prompt  # rewritten, otherwise as sent
    (state, outcome), = outcomes  # once, when the stream ended; the pick's in-flight count released
    assert outcome is Outcome.OK and state.endpoint == picked[0] and state.runtime.inflight.get(picked[0]) == 0


async def test_buffered_mode_answers_headers_at_once_and_picks_on_the_body():
    raw = orjson.dumps({"model": "m", "prompt": "hi"})
    replies, outcomes = await run(snapshot("on-a100"), [request_headers(mode="BUFFERED"), body(raw, True)])
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    assert not replies[0].request_headers.response.HasField("header_mutation")
    assert destination(replies[1]) == "10.0.0.1:8000"  # the filter leaves one: no fallback
    assert not replies[1].request_body.response.HasField("body_mutation")  # not rewritten: forwarded as is
    assert [o for _, o in outcomes] == [Outcome.OK]


@pytest.mark.parametrize("subset", ["10.0.0.2:8000", []])
async def test_a_hint_that_leaves_no_candidate_is_a_503_in_the_openai_format(subset):
    raw = orjson.dumps({"model": "m", "prompt": "hi"})
    replies, outcomes = await run(snapshot("on-a100"), [request_headers(subset), body(raw, True)])
    assert len(replies) == 1 and replies[0].immediate_response.status.code == 503
    assert orjson.loads(replies[0].immediate_response.body)["error"]["code"] == "no_capacity"
    assert [o for _, o in outcomes] == [Outcome.REJECTED]


async def test_a_bodiless_request_is_picked_at_its_headers():
    replies, _ = await run(snapshot("on-a100"), [request_headers(eos=True)])
    assert len(replies) == 1 and destination(replies[0]) == "10.0.0.1:8000"
