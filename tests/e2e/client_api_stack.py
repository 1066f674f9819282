"""The stack both client-API end-to-end modules run: Envoy, the processor, an OpenAI API simulator
(`sim-model`, 40 tokens/s), the tool-calling chat server (`tool-model`, tests/e2e/chat_tools_service.py)
and a backend nobody listens on (`down-model`), behind `/v1/messages` and `/v1/responses`."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager

import httpx

from extproc.stack import free_port, wait_http
from tests.conftest import REPO

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: client-apis-e2e}}
spec:
  backends:
    - {{name: sim, kind: vllm, endpoints: ["sim:8000"], models: [sim-model]}}
    - {{name: tools, kind: openai, endpoints: ["127.0.0.1:{tools}"], models: [tool-model]}}
    - {{name: down, kind: openai, endpoints: ["127.0.0.1:{down}"], models: [down-model]}}
  routes:
    - {{path: /v1/messages, kind: anthropic-messages, targets: [sim, tools, down]}}
    - {{path: /v1/responses, kind: openai-responses, targets: [sim, tools, down]}}
"""


@contextmanager
def client_api_stack(tmp_path):
    from tests.e2e.conftest import make_stack

    tools, down = free_port(), free_port()
    service = subprocess.Popen([sys.executable, str(REPO / "tests" / "e2e" / "chat_tools_service.py"), str(tools)])
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(CONFIG.format(tools=tools, down=down))
    st = make_stack(cfg, workers=1, simulate=frozenset({"sim"}), simulator_args=("--decode-tokens-per-s", "40"))
    try:
        wait_http(f"http://127.0.0.1:{tools}/health", 20, service, "chat tools service")
        st.start()
        st.tools_url = f"http://127.0.0.1:{tools}"
        yield st
    finally:
        st.stop()
        service.terminate()
        service.wait(5)


def last_backend_request(stack, containing: str) -> dict:
    """The last chat request the tool-calling server received whose JSON has `containing` (what the
    gateway made of the client's request; the marker keeps other requests, such as a gateway's
    start-up probes of its backends, out)."""
    sent = [r for r in httpx.get(f"{stack.tools_url}/requests", timeout=5).json() if containing in json.dumps(r)]
    assert sent, f"no request with {containing!r} reached the backend"
    return sent[-1]


def backend_decoded(stack) -> float:
    """The simulator's own count of the tokens it has decoded so far."""
    from tests.promtext import scrape

    return scrape(f"http://127.0.0.1:{stack.simulators['sim'][1]}/metrics").total("vllm:generation_tokens_total")
