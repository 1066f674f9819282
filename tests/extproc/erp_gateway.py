"""The gateway config of the `kind: erp` route tests (tests/extproc/semantic/test_bpmn.py,
tests/extproc/stages/test_erp_action.py): backend `llm` (openai, model `m`) and erp routes over the
example order-to-cash process, copied beside the config as o2c.bpmn."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "erp" / "order-to-cash.bpmn"

HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: erp}
spec:
  backends: [{name: llm, kind: openai, endpoints: ["127.0.0.1:9001"], models: [m]}]
  routes:
"""


def erp_route(path: str, service: str, operations: str, extra: str = "", timeout: str = "300ms") -> str:
    """One erp route (YAML, an item of spec.routes) to target llm; `operations` are the lines of its
    erp.operations (indented 10 spaces), `extra` the route's other lines (indented 6)."""
    return (f"    - path: {path}\n      kind: erp\n      target: llm\n{extra}      erp:\n        process: o2c.bpmn\n"
            f"        service: {service}\n        timeout: {timeout}\n        operations:\n{operations}\n")


def write_erp_gateway(folder: Path, *routes: str) -> Path:
    """The example process as `folder`/o2c.bpmn and the gateway with `routes` as `folder`/g.yaml (returned)."""
    shutil.copy(EXAMPLE, folder / "o2c.bpmn")
    path = folder / "g.yaml"
    path.write_text(HEAD + "".join(routes))
    return path
