"""Config loading: the brief's example, defaults, and every way a config is refused."""

from __future__ import annotations

import pytest

from extproc.config.loader import ConfigError, load_file, load_text
from tests.conftest import BRIEF_EXAMPLE, REPO

MINIMAL = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: t}
spec:
  modelRef: m1
  backends:
    - {name: llm, endpoints: ["127.0.0.1:9000"]}
  routes:
    - path: /a
      transform: '{"x": $.output.x}'
"""


def refused(text: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_text(text, "cfg.yaml")
    return str(e.value)


def test_brief_example_loads_as_is_with_documented_defaults():
    snap = load_file(BRIEF_EXAMPLE)
    assert snap.name == "finance-llm-adapter"
    route = snap.routes["v1-analyze"]
    assert route.kind == "llm"  # a transform makes it an llm route
    assert route.model == "qwen2.5-finance"  # modelRef without its @registry
    backend = route.backend
    assert (backend.name, backend.endpoints, backend.protocol, backend.implicit) == (
        "finance-backend", (("finance-backend", 8080),), "grpc", True)
    assert backend.kind == "openai" and backend.health_path == "/health"
    assert route.failure_mode == "closed" and route.max_body_bytes == 1024 * 1024
    assert snap.listener.port == 8080 and snap.admin.port == 9901
    assert snap.processor.message_timeout == 1.0
    # the model is asked for exactly the fields the transform reads
    assert route.response_schema == {
        "type": "object", "properties": {"amount": {}, "account": {}},
        "required": ["amount", "account"], "additionalProperties": False}
    assert "adapter-health" in snap.routes


def test_example_config_in_repo_is_valid():
    snap = load_file(REPO / "examples" / "finance-llm-adapter.yaml")
    assert snap.routes["v1"].kind == "openai" and snap.routes["v1"].match == "prefix"
    # both routes share the implicit backend defined by the same host:port
    assert snap.routes["v1"].backend is snap.routes["v1-analyze"].backend
    assert snap.routes["v1-fraud-score"].backend.kind == "onnxruntime"


def test_snapshot_is_immutable():
    snap = load_text(MINIMAL)
    with pytest.raises((TypeError, AttributeError)):
        snap.routes["x"] = None  # type: ignore[index]
    with pytest.raises(Exception):
        snap.routes["a"].name = "b"  # type: ignore[misc]


def test_unknown_field_names_file_line_path_and_allowed_fields():
    msg = refused(MINIMAL.replace("      transform:", "      transfrom:"))
    assert "cfg.yaml:10: spec.routes[0].transfrom: unknown field (allowed:" in msg
    assert "transform" in msg


def test_dangling_target_is_refused():
    msg = refused(MINIMAL.replace("    - path: /a\n", "    - path: /a\n      target: nothere\n"))
    assert "spec.routes[0].target" in msg and "'nothere' is neither a declared backend (llm)" in msg


def test_bad_template_points_at_its_line_in_the_file():
    text = MINIMAL.replace("""      transform: '{"x": $.output.x}'""", """      transform: |
        # comment
        {"x": $.output.x,, }""")
    msg = refused(text)
    assert "cfg.yaml:12: spec.routes[0].transform: template error at line 2" in msg


def test_duplicate_yaml_keys_are_refused():
    msg = refused(MINIMAL.replace("  modelRef: m1\n", "  modelRef: m1\n  modelRef: m2\n"))
    assert "cfg.yaml:6: spec.modelRef: duplicate key" in msg


@pytest.mark.parametrize("value, reason", [
    ("!x m2", "cfg.yaml:5: invalid YAML: could not determine a constructor for the tag '!x'"),
    ("!!python/object:os.system m2", "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object"),
    ("!!int m2", "cfg.yaml:5: invalid YAML value for tag:yaml.org,2002:int: invalid literal for int()"),
    ("!!timestamp 2026-13-01", "cfg.yaml:5: invalid YAML value for tag:yaml.org,2002:timestamp: month must be in 1..12"),
])
def test_unknown_tags_and_bad_tagged_values_are_refused_with_their_line(value, reason):
    """Found by tests/fuzz/test_fuzz_config.py: these raised yaml's ConstructorError or ValueError out of
    load_text instead of a ConfigError."""
    assert reason in refused(MINIMAL.replace("  modelRef: m1\n", f"  modelRef: {value}\n"))


@pytest.mark.parametrize("field, value, reason", [
    ("maxBodyBytes", "lots", "invalid size 'lots'"),
    ("timeout", "-1s", "invalid duration"),
    ("failureMode", "sometimes", "'closed' or 'open'"),
])
def test_invalid_policy_values(field, value, reason):
    msg = refused(MINIMAL.replace("    - path: /a\n", f"    - path: /a\n      policy: {{{field}: {value}}}\n"))
    assert f"spec.routes[0].policy.{field}" in msg and reason in msg


def test_every_problem_is_reported_at_once():
    text = MINIMAL.replace("kind: AdapterGateway", "kind: Gateway").replace("127.0.0.1:9000", "nowhere")
    msg = refused(text)
    assert "kind" in msg and "spec.backends[0].endpoints" in msg and "must be host:port" in msg


def test_llm_route_needs_a_model():
    msg = refused(MINIMAL.replace("  modelRef: m1\n", ""))
    assert "spec.routes[0].model: an llm route needs a model" in msg


def test_passthrough_route_cannot_transform():
    msg = refused(MINIMAL.replace("    - path: /a\n", "    - path: /a\n      kind: passthrough\n"))
    assert "spec.routes[0].kind" in msg and "need kind: llm" in msg


def test_duplicate_paths_and_reserved_health_path():
    text = MINIMAL + "    - path: /a\n      name: other\n    - path: /health/adapter\n"
    msg = refused(text)
    assert "spec.routes[1].path: path '/a' is already used by routes[0]" in msg
    assert "spec.routes[2].path" in msg and "built-in health route" in msg


def test_port_clash_is_refused():
    msg = refused(MINIMAL.replace("spec:\n", "spec:\n  listener: {port: 9901}\n"))
    assert "port 9901" in msg


def test_tenant_cpu_quantities():
    snap = load_text(MINIMAL + "  tenants:\n    - {id: a, cpu: {limit: 500m}}\n    - {id: b, cpu: {limit: 1.5}}\n")
    assert [t.cpu.limit for t in snap.tenants] == [0.5, 1.5]
    assert "CPU limit must be between 1m" in refused(MINIMAL + "  tenants:\n    - {id: a, cpu: {limit: 0}}\n")


def test_unreadable_and_non_utf8_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_file(tmp_path / "missing.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(MINIMAL.encode().replace(b"name: t", b"name: \xe9"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_file(bad)


def test_invalid_yaml_names_the_line():
    assert "cfg.yaml:3: invalid YAML" in refused("apiVersion: adapter.ai/v1\nkind: [\nmetadata: {")


def test_endpoint_overrides_replace_backend_endpoints(tmp_path):
    p = tmp_path / "g.yaml"
    p.write_text(MINIMAL)
    snap = load_file(p, endpoints={"llm": (("127.0.0.1", 1234),)})
    assert snap.routes["a"].backend.endpoints == (("127.0.0.1", 1234),)
    with pytest.raises(ConfigError, match="unknown backend"):
        load_file(p, endpoints={"nope": (("127.0.0.1", 1),)})


def test_a_referenced_file_name_with_a_nul_byte_is_a_config_error(tmp_path):
    """Found by tests/fuzz/test_fuzz_config.py: `mapping: "a\\0b"` raised ValueError (embedded null
    byte) out of load_text; `openapi:` the same out of load_spec."""
    for route in ('{path: /o, kind: rest, target: b, mapping: "a\\0b"}', '{path: /t, kind: tool, target: b, openapi: "p\\0.yaml"}'):
        text = ("apiVersion: adapter.ai/v1\nkind: AdapterGateway\nmetadata: {name: t}\nspec:\n"
                "  backends: [{name: b, kind: rest, endpoints: ['127.0.0.1:9']}]\n  routes:\n    - " + route + "\n")
        with pytest.raises(ConfigError) as e:
            load_text(text, str(tmp_path / "cfg.yaml"))
        (issue,) = e.value.issues
        assert issue.where == f"{tmp_path / 'cfg.yaml'}:7" and issue.path.startswith("spec.routes[0].")
