"""Envoy and the processor agree on one config digest: older routes find their snapshot, unknown ones are refused."""

from __future__ import annotations

import orjson
from prometheus_client import CollectorRegistry

from extproc.config.loader import load_file
from extproc.metrics import ProcessorMetrics
from extproc.stream import KEEP_SNAPSHOTS, ConfigRef, ExtProcService
from tests.extproc.test_lifecycle import RECORDED, _Context, recorded
from tests.promtext import collect


async def replay(svc, route: str, digest: str | None):
    ctx = _Context(route, digest)

    async def source():
        for r in recorded("v1-analyze-rec-llm-ok.txtpb"):
            yield r

    return [reply async for reply in svc.Process(source(), ctx)]


def voucher_keys(replies) -> set[str]:
    return set(orjson.loads(replies[3].response_body.response.body_mutation.body)["voucher"])


async def test_streams_use_the_snapshot_of_the_digest_envoy_sent(write_config):
    registry = CollectorRegistry()
    old = load_file(RECORDED / "config.yaml")
    svc = ExtProcService(ConfigRef(old), ProcessorMetrics(registry))
    text = (RECORDED / "config.yaml").read_text().replace('"account": $.output.account', '"acct": $.output.account')
    new = load_file(write_config(text), generation=2)
    assert new.digest != old.digest
    svc.config.swap(new)
    assert voucher_keys(await replay(svc, "v1-analyze", new.digest)) == {"amount", "acct"}
    # Envoy still on the previous routes (its files are rewritten after the workers acknowledged)
    assert voucher_keys(await replay(svc, "v1-analyze", old.digest)) == {"amount", "account"}
    assert voucher_keys(await replay(svc, "v1-analyze", None)) == {"amount", "acct"}  # no digest: current

    replies = await replay(svc, "v1-analyze", "0123456789abcdef")
    ir = replies[0].immediate_response
    err = orjson.loads(ir.body)["error"]
    assert ir.status.code == 503 and err["code"] == "config_mismatch"
    assert "0123456789abcdef" in err["message"] and new.digest in err["message"]
    assert err["envoy_digest"] == "0123456789abcdef" and err["processor_digest"] == new.digest
    assert collect(registry, [svc]).value("adapter_processor_config_mismatch_total") == 1  # the one unknown digest


def test_only_a_few_recent_snapshots_are_kept(write_config):
    ref = ConfigRef(load_file(RECORDED / "config.yaml"))
    first = ref.current.digest
    base = (RECORDED / "config.yaml").read_text()
    for i in range(KEEP_SNAPSHOTS):
        ref.swap(load_file(write_config(base.replace("name: exp", f"name: exp{i}")), generation=i + 2))
    assert ref.resolve(first) is None  # dropped: a stream from it is refused, never mis-served
    assert ref.resolve(ref.current.digest) is ref.current and len(ref.digests) == KEEP_SNAPSHOTS
