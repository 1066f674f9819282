"""vLLM's `priority` passes through an openai route to the backend, streamed or not (extproc/stages/openai_api.py).

Asserted at the backend: the simulator reports, per request received, the priority its engine
queued it with (`GET /simulator/requests`, backends/simulator_openai.py). A streamed request is
the case the processor rewrites (it adds `stream_options.include_usage`), so the body the backend
gets is the processor's, not the client's.
"""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: priority}
spec:
  modelRef: qwen2.5-finance
  backends: [{name: llm, endpoints: ["llm.invalid:8000"]}]
  routes:
    - {path: /v1/, match: prefix, kind: openai}
"""


def test_priority_reaches_the_backend_engine(stack_factory, tmp_path):
    cfg = tmp_path / "priority.yaml"
    cfg.write_text(CONFIG)
    st = stack_factory(cfg, workers=1, simulate=True)
    client = openai.OpenAI(base_url=f"{st.url}/v1", api_key="unused", max_retries=0, timeout=10)
    messages = [{"role": "user", "content": "hi"}]

    plain = client.chat.completions.create(model="qwen2.5-finance", messages=messages, max_tokens=2,
                                           extra_body={"priority": -5})
    assert plain.choices[0].message.content
    chunks = list(client.chat.completions.create(model="qwen2.5-finance", messages=messages, max_tokens=2,
                                                 stream=True, extra_body={"priority": 7}))
    assert chunks and all(c.usage is None for c in chunks)  # the usage chunk the processor asked for was removed
    client.completions.create(model="qwen2.5-finance", prompt="hi", max_tokens=2, extra_body={"priority": 3})
    client.embeddings.create(model="qwen2.5-finance", input="hi", extra_body={"priority": 11})
    client.chat.completions.create(model="qwen2.5-finance", messages=messages, max_tokens=2)  # none: vLLM's 0

    _, port = st.simulators["llm"]
    seen = httpx.get(f"http://127.0.0.1:{port}/simulator/requests", timeout=5).json()["requests"]
    got = [(r["path"], r["priority"]) for r in seen if r["path"].startswith("/v1/")]
    assert got == [("/v1/chat/completions", -5), ("/v1/chat/completions", 7), ("/v1/completions", 3),
                   ("/v1/embeddings", 11), ("/v1/chat/completions", 0)]
    assert {r["model"] for r in seen if r["path"].startswith("/v1/")} == {"qwen2.5-finance"}
