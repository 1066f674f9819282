"""The gateway config of the IoT adapter's end-to-end test (tests/e2e/test_iot_adapter.py) and benchmark
(perf/bench_iot.py): broker `plant` and one `kind: iot` route."""

from __future__ import annotations


def iot_gateway(name: str, broker: str, commands: str, timeout: str, path: str = "/v1/devices/command",
                backends: str = "", target: str = "") -> str:
    """YAML: broker `plant` at `broker` (host:port), the iot route `path` (to backend `target` when given,
    the LLM step) with `commands` the lines of its iot.commands (indented 10 spaces); `backends` is a
    spec.backends line (indented 2) when given."""
    return (f"\napiVersion: adapter.ai/v1\nkind: AdapterGateway\nmetadata: {{name: {name}}}\nspec:\n"
            f"  brokers: [{{name: plant, address: \"{broker}\"}}]\n{backends}  routes:\n    - path: {path}\n"
            f"      kind: iot\n" + (f"      target: {target}\n" if target else "")
            + f"      iot:\n        timeout: {timeout}\n        commands:\n{commands}")
