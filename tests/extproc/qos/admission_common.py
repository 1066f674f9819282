"""What the admission tests (test_queue.py, test_shedding.py) share: three priority classes, a request
state as the queue sees it, and a gateway config whose one pool `llm` gets a `spec.qos.admission` entry
written by the test, loaded from the file name `q.yaml`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from extproc.config.loader import ConfigError, load_text
from extproc.qos.priority import PriorityClass

P0, P1, P2 = (PriorityClass(n, i, i == 0, i, i + 1) for i, n in enumerate(("P0", "P1", "P2")))

CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: q}}
spec:
  tenants: [{{id: a}}]
  backends: [{{name: llm, endpoints: ["127.0.0.1:9"]}}]
  routes: [{{path: /v1/, match: prefix, kind: openai, name: api, targets: [llm]}}]
  qos:
    admission:
{admission}
"""


def req(tenant="t", stream=False):
    return SimpleNamespace(attrs={}, tenant=tenant, started=0.0, route=None, first_body=None,
                           request=SimpleNamespace(stream=stream))


def load_admission(entry: str):
    """The snapshot of CONFIG with `entry` (YAML lines, indented 6) as its admission list."""
    return load_text(CONFIG.format(admission=entry), "q.yaml")


def refusal(entry: str) -> str:
    """The load error of CONFIG with `entry`: it must be refused."""
    with pytest.raises(ConfigError) as e:
        load_admission(entry)
    return str(e.value)
