"""`spec.plugins` and `routes[].plugins`: validated at load, errors with file:line and field paths."""

from __future__ import annotations

import pytest

from extproc.config.loader import ConfigError, load_text
from extproc.config.snapshot import PluginRef
from extproc.scheduling.least_in_flight import LeastInFlightParameters
from extproc.scheduling.pinned_endpoint import PinnedEndpointParameters

HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: plugins}
spec:
  backends:
    - {name: beta, endpoints: ["127.0.0.1:9001", "127.0.0.1:9002"], models: [m2]}
    - {name: alpha, endpoints: ["127.0.0.1:8001"], models: [m1]}
"""


def config(plugins: str, routes: str = "    - {path: /v1/, match: prefix, kind: openai, targets: [beta]}\n",
           extra: str = "") -> str:
    return HEAD + extra + "  plugins:\n" + plugins + "  routes:\n" + routes


def issues(text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_text(text, "cfg.yaml")
    return [str(i) for i in e.value.issues]


def line(text: str, needle: str, nth: int = 0) -> int:
    """1-based line of the `nth` line containing `needle`."""
    hits = [i + 1 for i, ln in enumerate(text.splitlines()) if needle in ln]
    return hits[nth]


# --- spec.plugins ----------------------------------------------------------------------------------


def test_unknown_plugin_type_lists_the_known_ones():
    from extproc.scheduling import plugin_types

    known = sorted(plugin_types())
    assert {"least-in-flight", "pinned-endpoint", "max-score-picker", "queue-scorer"} <= set(known)
    text = config("    - name: p\n      type: round-robin\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'type: round-robin')}: spec.plugins[0].type: unknown plugin type "
                            f"'round-robin' (known: {', '.join(known)})"]


def test_every_plugin_module_is_registered():
    """A plugin file whose class is missing from plugin_types() would be unusable from the config."""
    import importlib
    import pkgutil

    import extproc.scheduling as pkg
    from extproc.scheduling import Plugin, plugin_types

    registered = set(plugin_types().values())
    found = set()
    for mod in pkgutil.iter_modules(pkg.__path__):
        m = importlib.import_module(f"extproc.scheduling.{mod.name}")
        for obj in vars(m).values():
            if isinstance(obj, type) and issubclass(obj, Plugin) and obj is not Plugin \
                    and obj.__module__ == m.__name__ and isinstance(getattr(obj, "type", None), str):
                found.add(obj)
    assert found and found <= registered, sorted(c.type for c in found - registered)


def test_unknown_parameter_names_its_path():
    text = config("    - name: p\n      type: least-in-flight\n      parameters:\n        nope: 1\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'nope: 1')}: spec.plugins[0].parameters.nope: unknown parameter"]


def test_missing_required_parameter():
    text = config("    - name: pin\n      type: pinned-endpoint\n      parameters:\n        fallback: false\n")
    # the line of the nearest field that exists in the file: `parameters`
    assert issues(text) == [f"cfg.yaml:{line(text, 'parameters:')}: spec.plugins[0].parameters.endpoint: "
                            "required parameter is missing"]


def test_missing_parameters_block_points_at_the_plugin():
    text = config("    - name: pin\n      type: pinned-endpoint\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'name: pin')}: spec.plugins[0].parameters.endpoint: "
                            "required parameter is missing"]


@pytest.mark.parametrize("value, reason", [
    ('"127.0.0.1"', "endpoint '127.0.0.1' must be host:port"),
    ('"127.0.0.1:99999"', "endpoint '127.0.0.1:99999' must be host:port"),
    ('"bad host!:80"', "endpoint 'bad host!:80' has an invalid host"),
])
def test_bad_endpoint_value(value, reason):
    text = config(f"    - name: pin\n      type: pinned-endpoint\n      parameters:\n        endpoint: {value}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'endpoint: ')}: spec.plugins[0].parameters.endpoint: {reason}"]


def test_parameter_type_and_range_are_checked():
    text = config("    - name: p\n      type: least-in-flight\n      parameters: {fallbacks: 17}\n"
                  "    - name: q\n      type: pinned-endpoint\n      parameters: {endpoint: 9001}\n")
    found = issues(text)
    assert len(found) == 2
    assert found[0].startswith(f"cfg.yaml:{line(text, 'fallbacks: 17')}: spec.plugins[0].parameters.fallbacks: ")
    assert "less than or equal to 16" in found[0]
    assert found[1].startswith("cfg.yaml:") and "spec.plugins[1].parameters.endpoint: " in found[1]
    assert "valid string" in found[1]


def test_duplicate_plugin_name():
    text = config("    - {name: p, type: least-in-flight}\n    - {name: p, type: pinned-endpoint, "
                  "parameters: {endpoint: '127.0.0.1:9001'}}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, '{name: p,', 1)}: spec.plugins[1].name: duplicate plugin name 'p'"]


def test_plugin_name_must_be_a_dns_label():
    text = config("    - {name: Busy_Aware, type: least-in-flight}\n")
    (found,) = issues(text)
    assert found.startswith(f"cfg.yaml:{line(text, 'Busy_Aware')}: spec.plugins[0].name: ")
    assert "like a DNS label" in found


def test_plugin_needs_a_type():
    text = config("    - {name: p}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, '{name: p}')}: spec.plugins[0].type: required field is missing"]


def test_every_plugin_problem_is_reported_at_once():
    text = config("    - {name: a, type: nope}\n    - {name: b, type: least-in-flight, parameters: {x: 1}}\n")
    found = issues(text)
    assert any("spec.plugins[0].type: unknown plugin type 'nope'" in f for f in found)
    assert any("spec.plugins[1].parameters.x: unknown parameter" in f for f in found)


# --- routes[].plugins ------------------------------------------------------------------------------


def test_route_referencing_an_undeclared_plugin():
    text = config("    - {name: busy, type: least-in-flight}\n",
                  "    - path: /v1/\n      match: prefix\n      kind: openai\n      targets: [beta]\n"
                  "      plugins: [ghost]\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'plugins: [ghost]')}: spec.routes[0].plugins[0]: no plugin or "
                            "scheduling profile named 'ghost' (plugins: busy; schedulingProfiles: none)"]


def test_route_referencing_a_plugin_without_any_declared():
    text = HEAD + "  routes:\n    - {path: /v1/, match: prefix, kind: openai, targets: [beta], plugins: [ghost]}\n"
    assert issues(text) == [f"cfg.yaml:{line(text, 'ghost')}: spec.routes[0].plugins[0]: no plugin or scheduling "
                            "profile named 'ghost' (plugins: none; schedulingProfiles: none)"]


def test_two_pickers_on_one_route():
    text = config("    - {name: busy, type: least-in-flight}\n"
                  "    - {name: pin, type: pinned-endpoint, parameters: {endpoint: '127.0.0.1:9001'}}\n",
                  "    - path: /v1/\n      match: prefix\n      kind: openai\n      targets: [beta]\n"
                  "      plugins:\n        - busy\n        - pin\n")
    assert issues(text) == [f"cfg.yaml:{line(text, '- pin')}: spec.routes[0].plugins[1]: route already has picker "
                            "'busy'; a route names one scheduling profile or one picker"]


def test_pinned_endpoint_must_belong_to_the_route_backends():
    text = config("    - {name: pin, type: pinned-endpoint, parameters: {endpoint: '10.0.0.7:8000'}}\n",
                  "    - {path: /v1/, match: prefix, kind: openai, targets: [beta, alpha], plugins: [pin]}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'plugins: [pin]')}: spec.routes[0].plugins[0]: plugin 'pin' pins "
                            "endpoint 10.0.0.7:8000, which is not an endpoint of this route's backends "
                            "(127.0.0.1:9001, 127.0.0.1:9002, 127.0.0.1:8001)"]


def test_pinned_endpoint_of_another_route_backend_is_refused():
    # 127.0.0.1:8001 is alpha's; the route only targets beta
    text = config("    - {name: pin, type: pinned-endpoint, parameters: {endpoint: '127.0.0.1:8001'}}\n",
                  "    - {path: /v1/, match: prefix, kind: openai, targets: [beta], plugins: [pin]}\n")
    (found,) = issues(text)
    assert "spec.routes[0].plugins[0]: plugin 'pin' pins endpoint 127.0.0.1:8001" in found


def test_route_plugin_reference_must_be_a_dns_label():
    text = config("    - {name: busy, type: least-in-flight}\n",
                  "    - {path: /v1/, match: prefix, kind: openai, targets: [beta], plugins: [Busy]}\n")
    found = issues(text)
    # (pydantic adds `spec.routes: Tuple should have at least 1 item` for the refused only route)
    assert found[0].startswith(f"cfg.yaml:{line(text, 'plugins: [Busy]')}: spec.routes[0].plugins[0]: String should "
                               "match pattern")


# --- valid configs ---------------------------------------------------------------------------------


def test_valid_config_gives_the_route_its_picker_with_validated_params():
    text = config("    - {name: busy, type: least-in-flight, parameters: {fallbacks: 1}}\n"
                  "    - {name: pin, type: pinned-endpoint, parameters: {endpoint: '127.0.0.1:9002'}}\n",
                  "    - {path: /a/, match: prefix, kind: openai, name: a, targets: [beta], plugins: [pin]}\n"
                  "    - {path: /b/, match: prefix, kind: openai, name: b, targets: [beta, alpha], plugins: [busy]}\n"
                  "    - {path: /c/, match: prefix, kind: openai, name: c, targets: [beta]}\n")
    snap = load_text(text, "cfg.yaml")
    a = snap.routes["a"].picker
    assert isinstance(a, PluginRef) and (a.name, a.type, a.slot) == ("pin", "pinned-endpoint", "picker")
    assert isinstance(a.params, PinnedEndpointParameters)
    assert a.params.endpoint == "127.0.0.1:9002" and a.params.fallback is True  # default filled in
    b = snap.routes["b"].picker
    assert (b.name, b.type) == ("busy", "least-in-flight")
    assert isinstance(b.params, LeastInFlightParameters) and b.params.fallbacks == 1
    assert snap.routes["c"].picker is None
    assert dict(snap.plugins) == {"busy": b, "pin": a}
    assert snap.routes["a"].picker is snap.plugins["pin"]


def test_least_in_flight_default_parameters():
    snap = load_text(config("    - {name: busy, type: least-in-flight}\n",
                            "    - {path: /v1/, match: prefix, kind: openai, targets: [beta], plugins: [busy]}\n"))
    assert next(iter(snap.plugins.values())).params == LeastInFlightParameters(fallbacks=2)


def test_declared_but_unused_plugins_are_kept():
    snap = load_text(config("    - {name: busy, type: least-in-flight}\n"))
    assert list(snap.plugins) == ["busy"] and snap.routes["v1"].picker is None


def test_plugin_params_are_frozen():
    snap = load_text(config("    - {name: busy, type: least-in-flight}\n"))
    with pytest.raises(Exception):
        snap.plugins["busy"].params.fallbacks = 5  # type: ignore[misc]


def test_a_config_without_plugins_has_none():
    snap = load_text(HEAD + "  routes:\n    - {path: /v1/, match: prefix, kind: openai, targets: [beta]}\n")
    assert dict(snap.plugins) == {} and snap.routes["v1"].picker is None


# --- processor.feedback ----------------------------------------------------------------------------

ROUTES = "  routes:\n    - {path: /v1/, match: prefix, kind: openai, targets: [beta]}\n"


@pytest.mark.parametrize("value", ["accessLog", "stream"])
def test_feedback_values(value):
    snap = load_text(HEAD + f"  processor: {{feedback: {value}}}\n" + ROUTES)
    assert snap.processor.feedback == value


def test_feedback_defaults_to_access_log():
    assert load_text(HEAD + ROUTES).processor.feedback == "accessLog"


@pytest.mark.parametrize("value", ["access_log", "accesslog", "none", "true"])
def test_feedback_other_values_are_refused(value):
    text = HEAD + f"  processor:\n    feedback: {value}\n" + ROUTES
    (found,) = issues(text)
    assert found.startswith(f"cfg.yaml:{line(text, 'feedback:')}: spec.processor.feedback: ")
    assert "'accessLog' or 'stream'" in found


def test_adapterctl_validate_lists_plugins_and_route_pickers(write_config, capsys):
    from extproc.cli import main

    path = write_config("""
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {name: p}
        spec:
          plugins:
            - {name: spread, type: least-in-flight, parameters: {fallbacks: 1}}
          backends:
            - {name: llm, endpoints: ["10.0.0.1:8000", "10.0.0.2:8000"]}
          routes:
            - {path: /v1/, match: prefix, kind: openai, target: llm, plugins: [spread]}
        """)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "picker=spread" in out and "plugin spread: least-in-flight (picker) {'fallbacks': 1}" in out
