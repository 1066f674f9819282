"""`spec.rollouts`: compiled into `canary.assign` objects on each route, and every refusal naming the
file, line and field path with its reason (one problem per config, nothing else refused)."""

from __future__ import annotations

import json

import pytest

from canary.assign import Arm, KeyPolicy, Rollout, TenantKey, TrustedHeader
from extproc.config.loader import ConfigError, load_file, load_text
from tests.conftest import REPO

HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: rollouts}
spec:
  backends:
    - {name: stable, endpoints: ["127.0.0.1:9001"], models: [m]}
    - {name: canary, endpoints: ["127.0.0.1:9002"], models: [m]}
    - {name: other, endpoints: ["127.0.0.1:9003"], models: [m]}
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: v1, targets: [stable, canary]}
    - {path: /v2/, match: prefix, kind: openai, name: v2, targets: [stable, canary, other]}
    - {path: /p, kind: passthrough, name: p, target: stable}
  rollouts:
"""
ARMS = "arms: [{name: stable, backend: stable}, {name: canary, backend: canary, weight: 10}]"
KEY = "key: {sources: [{header: x-user-id}], trustedHeaders: [x-user-id]}"


def config(*rollouts: str) -> str:
    return HEAD + "".join(f"    - {r}\n" for r in rollouts)


def test_a_rollout_compiles_into_the_assignment_objects_hung_on_its_route():
    snap = load_text(config("{name: llama-v2, route: v1, arms: [{name: stable, backend: stable}, "
                            "{name: canary, backend: canary, weight: 2.5}], key: {sources: [{header: x-user-id}, "
                            "{tenant: true}], trustedHeaders: [x-user-id, x-canary], force: {header: x-canary}}, "
                            "salt: s1}"), "gw.yaml")
    ref = snap.routes["v1"].rollout
    assert ref is snap.rollouts["llama-v2"]
    assert ref.rollout == Rollout("llama-v2", canaries=(Arm("canary", 250),), baseline="stable", salt="s1")
    assert ref.policy == KeyPolicy((TrustedHeader("x-user-id"), TenantKey()), frozenset({"x-user-id", "x-canary"}),
                                   force=TrustedHeader("x-canary"))
    assert dict(ref.arm_backends) == {"stable": "stable", "canary": "canary"}
    assert ref.headers == ("x-user-id", "x-canary")  # what the stream keeps at request headers
    assert ref.routes == ("v1",) and ref.arms == ("stable", "canary")
    assert snap.routes["v2"].rollout is None and snap.routes["p"].rollout is None
    with pytest.raises(AttributeError):
        ref.name = "x"  # immutable, like the whole snapshot


def test_defaults_no_forcing_no_salt_baseline_the_rest_and_several_routes_share_one_rollout():
    snap = load_text(config(f"{{name: r, routes: [v1, v2], {ARMS}, {KEY}}}"))
    ref = snap.rollouts["r"]
    assert snap.routes["v1"].rollout is ref and snap.routes["v2"].rollout is ref and ref.routes == ("v1", "v2")
    assert ref.policy.force is None and ref.rollout.salt is None and ref.rollout.hash_salt == "r"
    assert ref.rollout.weight("stable") == 9000 and ref.rollout.weight("canary") == 1000
    assert ref.headers == ("x-user-id",)
    # the baseline's weight may be given when it is the rest; three arms; a dark canary at 0
    snap = load_text(config("{name: r, route: v2, arms: [{name: a, backend: stable, weight: 70}, "
                            "{name: b, backend: canary, weight: 29.99}, {name: c, backend: other, weight: 0.01}]}"))
    ro = snap.rollouts["r"].rollout
    assert ro.canaries == (Arm("b", 2999), Arm("c", 1)) and ro.weight("a") == 7000
    assert snap.rollouts["r"].policy.sources == ()  # no key: every request weighted random
    # an A/A rollout: both arms on the one target of a passthrough route
    snap = load_text(config("{name: aa, route: p, arms: [{name: a, backend: stable}, "
                            "{name: b, backend: stable, weight: 50}]}"))
    assert dict(snap.routes["p"].rollout.arm_backends) == {"a": "stable", "b": "stable"}


def test_the_snapshot_with_other_endpoints_keeps_the_rollout():
    snap = load_text(config(f"{{name: r, route: v1, {ARMS}, {KEY}}}"))
    moved = snap.with_endpoints({"canary": (("127.0.0.1", 9999),)})
    assert moved.routes["v1"].rollout is snap.routes["v1"].rollout


def test_the_example_validates_and_renders_the_variant_header(capsys):
    from extproc.cli import main

    snap = load_file(REPO / "examples" / "canary.yaml")
    ref = snap.routes["v1"].rollout
    assert (ref.name, ref.arms, ref.rollout.weight("canary")) == ("llama-v2", ("stable", "canary"), 1000)
    assert ref.policy.sources == (TrustedHeader("x-user-id"),)
    assert main(["validate", str(REPO / "examples" / "canary.yaml")]) == 0
    assert ("rollout llama-v2 on v1: stable 90% (llama-stable), canary 10% (llama-canary); key header:x-user-id, "
            "forced by header:x-canary") in capsys.readouterr().out


def test_the_envoy_route_adds_the_variant_header_from_dynamic_metadata_only_on_routes_with_a_rollout():
    from extproc.envoy_render import route_configuration

    snap = load_text(config(f"{{name: r, route: v1, {ARMS}, {KEY}}}"))
    entries = {e["name"]: e for e in route_configuration(snap)["virtual_hosts"][0]["routes"]}
    want = [{"header": {"key": "x-adapter-variant", "value": "%DYNAMIC_METADATA(adapter:variant)%"},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    assert entries["v1--stable"]["response_headers_to_add"] == want
    assert entries["v1--canary"]["response_headers_to_add"] == want
    assert "response_headers_to_add" not in entries["v2--stable"]
    assert "response_headers_to_add" not in entries["p--stable"]


REFUSALS = {
    "unknown route": (f"{{name: r, route: nope, {ARMS}}}", "spec.rollouts[0].route",
                      "no route named 'nope' (routes: v1, v2, p)"),
    "unknown route in routes": (f"{{name: r, routes: [v1, nope], {ARMS}}}", "spec.rollouts[0].routes[1]",
                                "no route named 'nope'"),
    "route and routes": (f"{{name: r, route: v1, routes: [v2], {ARMS}}}", "spec.rollouts[0].routes",
                         "set route or routes, not both"),
    "no route": (f"{{name: r, {ARMS}}}", "spec.rollouts[0].route", "required: the route"),
    "backend not a target": ("{name: r, route: v1, arms: [{name: stable, backend: stable}, "
                             "{name: canary, backend: other, weight: 10}]}", "spec.rollouts[0].arms[1].backend",
                             "backend 'other' is not a target of route 'v1' (targets: stable, canary)"),
    "backend not a target of the second route": ("{name: r, routes: [v2, p], arms: [{name: stable, backend: stable},"
                                                 " {name: canary, backend: canary, weight: 10}]}",
                                                 "spec.rollouts[0].arms[1].backend",
                                                 "backend 'canary' is not a target of route 'p' (targets: stable)"),
    "weights over 100": ("{name: r, route: v2, arms: [{name: a, backend: stable}, {name: b, backend: canary, "
                         "weight: 60}, {name: c, backend: other, weight: 40.5}]}", "spec.rollouts[0].arms",
                         "the canary weights add up to 100.5 %, more than 100"),
    "one weight over 100": ("{name: r, route: v1, arms: [{name: a, backend: stable}, {name: b, backend: canary, "
                            "weight: 101}]}", "spec.rollouts[0].arms[1].weight",
                            "weight must be a percentage between 0 and 100, got 101"),
    "negative weight": ("{name: r, route: v1, arms: [{name: a, backend: stable}, {name: b, backend: canary, "
                        "weight: -1}]}", "spec.rollouts[0].arms[1].weight", "between 0 and 100"),
    "weight finer than a basis point": ("{name: r, route: v1, arms: [{name: a, backend: stable}, "
                                        "{name: b, backend: canary, weight: 0.005}]}", "spec.rollouts[0].arms[1].weight",
                                        "more than two decimals: weights are in steps of 0.01 %"),
    "weight not a number": ("{name: r, route: v1, arms: [{name: a, backend: stable}, {name: b, backend: canary, "
                            "weight: ten}]}", "spec.rollouts[0].arms[1].weight", "invalid weight 'ten'"),
    "weight a boolean": ("{name: r, route: v1, arms: [{name: a, backend: stable}, {name: b, backend: canary, "
                         "weight: true}]}", "spec.rollouts[0].arms[1].weight", "expected a percentage"),
    "canary without weight": ("{name: r, route: v1, arms: [{name: a, backend: stable}, {name: b, backend: canary}]}",
                              "spec.rollouts[0].arms[1].weight", "a canary arm needs a weight in percent"),
    "baseline weight not the rest": ("{name: r, route: v1, arms: [{name: a, backend: stable, weight: 80}, "
                                     "{name: b, backend: canary, weight: 10}]}", "spec.rollouts[0].arms[0].weight",
                                     "gets what the canaries leave, 90 %, not 80 %"),
    "duplicate arm names": ("{name: r, route: v1, arms: [{name: a, backend: stable}, {name: a, backend: canary, "
                            "weight: 10}]}", "spec.rollouts[0].arms[1].name",
                            "arm 'a' is already arms[0]; arm names are unique"),
    "one arm": ("{name: r, route: v1, arms: [{name: a, backend: stable}]}", "spec.rollouts[0].arms",
                "a rollout needs a baseline and at least one canary: 2 arms or more, not 1"),
    "arm name not a DNS label": ("{name: r, route: v1, arms: [{name: A/B, backend: stable}, "
                                 "{name: b, backend: canary, weight: 1}]}", "spec.rollouts[0].arms[0].name",
                                 "DNS label"),
    "untrusted key header": (f"{{name: r, route: v1, {ARMS}, key: {{sources: [{{tenant: true}}, "
                             "{header: x-user-id}], trustedHeaders: [x-other]}}",
                             "spec.rollouts[0].key.sources[1].header",
                             "header 'x-user-id' is not in key.trustedHeaders: a client could choose it, so it is "
                             "never used as a key on this route"),
    "untrusted force header": (f"{{name: r, route: v1, {ARMS}, key: {{sources: [{{header: x-user-id}}], "
                               "trustedHeaders: [x-user-id], force: {header: x-canary}}}",
                               "spec.rollouts[0].key.force.header",
                               "header 'x-canary' is not in key.trustedHeaders: a client could choose it, so it "
                               "would never be honoured"),
    "claim source": (f"{{name: r, route: v1, {ARMS}, key: {{sources: [{{claim: sub}}]}}}}",
                     "spec.rollouts[0].key.sources[0].claim", "a JWT claim is a key only where Envoy verifies the token"),
    "two kinds in one source": (f"{{name: r, route: v1, {ARMS}, key: {{sources: [{{header: x-u, tenant: true}}], "
                                "trustedHeaders: [x-u]}}", "spec.rollouts[0].key.sources[0]",
                                "a key source is exactly one of {header: NAME}, {claim: PATH} or {tenant: true}, "
                                "not header and tenant"),
    "tenant false": (f"{{name: r, route: v1, {ARMS}, key: {{sources: [{{tenant: false}}]}}}}",
                     "spec.rollouts[0].key.sources[0].tenant", "must be true"),
    "upper-case header": (f"{{name: r, route: v1, {ARMS}, key: {{trustedHeaders: [X-User-Id]}}}}",
                          "spec.rollouts[0].key.trustedHeaders[0]", "should match pattern"),
    "unknown key field": (f"{{name: r, route: v1, {ARMS}, key: {{trusted: [x]}}}}", "spec.rollouts[0].key.trusted",
                          "unknown field (allowed: sources, trustedHeaders, force)"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal_names_the_field_and_the_reason(case):
    rollout, path, reason = REFUSALS[case]
    with pytest.raises(ConfigError) as e:
        load_text(config(rollout), "gw.yaml")
    issues = e.value.issues
    assert [i.path for i in issues] == [path], issues
    assert reason in issues[0].reason, issues[0].reason
    assert issues[0].where == "gw.yaml:14"  # the rollout's line (flow style: one line)


def test_a_route_has_one_rollout_and_rollout_names_are_unique():
    with pytest.raises(ConfigError) as e:
        load_text(config(f"{{name: r, route: v1, {ARMS}}}", f"{{name: s, routes: [v2, v1], {ARMS}}}",
                         f"{{name: r, route: v2, {ARMS}}}"), "gw.yaml")
    assert [(i.path, i.reason) for i in e.value.issues] == [
        ("spec.rollouts[1].routes[1]", "route 'v1' already has rollout 'r'; a route has one rollout"),
        ("spec.rollouts[2].name", "duplicate rollout name 'r'"),
    ]


def test_a_rollout_of_a_refused_route_adds_no_second_error():
    text = config(f"{{name: r, route: v1, {ARMS}}}").replace("targets: [stable, canary]}", "targets: [stable, nope]}")
    with pytest.raises(ConfigError) as e:
        load_text(text, "gw.yaml")
    assert [i.path for i in e.value.issues] == ["spec.routes[0].targets[1]"]


JWT_TENANCY = ("  tenancy: {source: jwt, jwt: {issuer: 'https://idp.example', jwks: '{\"keys\": []}'}}\n")


def test_a_claim_key_compiles_with_jwt_tenancy_and_envoy_forwards_the_payload():
    from canary.assign import JwtClaim, TrustedHeader
    from extproc.envoy_render import render

    text = config(f"{{name: r, route: v1, {ARMS}, key: {{sources: [{{claim: org.id}}, {{header: x-user-id}}], "
                  "trustedHeaders: [x-user-id]}}")
    snap = load_text(text.replace("  rollouts:\n", JWT_TENANCY + "  rollouts:\n"), "c.yaml")
    ref = snap.rollouts["r"]
    assert ref.policy.sources == (JwtClaim("org.id"), TrustedHeader("x-user-id")) and ref.uses_claims
    boot = json.dumps(render(snap, 1))
    assert '"payload_in_metadata": "jwt_payload"' in boot
    assert '"forwarding_namespaces": {"untyped": ["envoy.filters.http.jwt_authn"]}' in boot
    # without JWT tenancy the same claim source is refused (the processor would get no payload)
    with pytest.raises(ConfigError) as e:
        load_text(text, "c.yaml")
    assert "spec.rollouts[0].key.sources[0].claim" in str(e.value) and "spec.tenancy.source: jwt" in str(e.value)
    assert "forwarding_namespaces" not in json.dumps(render(load_text(config(f"{{name: r, route: v1, {ARMS}, {KEY}}}"),
                                                                      "c.yaml"), 1))


def test_a_bad_claim_path_is_refused_with_its_field():
    text = config(f"{{name: r, route: v1, {ARMS}, key: {{sources: [{{claim: 'org..id'}}]}}}}")
    with pytest.raises(ConfigError) as e:
        load_text(text.replace("  rollouts:\n", JWT_TENANCY + "  rollouts:\n"), "c.yaml")
    assert "spec.rollouts[0].key.sources[0].claim" in str(e.value) and "dotted claim path" in str(e.value)
