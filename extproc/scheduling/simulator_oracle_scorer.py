"""Scorer `simulator-oracle-scorer`, BENCHMARK ONLY: each endpoint's predicted TTFT from the simulator's true state.

What: the `oracle` policy of perf/bench_routing.py: the limit of a router that knew every engine's
real prefix-cache contents and queue. Per decision and per candidate it asks that endpoint, which
must be our OpenAI simulator with `--latency-model vllm` (backends/simulator_openai.py), two
simulator-only questions: `POST /simulator/cached_prefix` with the request's messages (how many of
this prompt's tokens the engine would find cached right now) and `GET /simulator/state?hashes=0`
(running, waiting, free KV blocks, `speed`, `time_scale`,
`max_num_seqs`, the LoRA adapters running). vLLM has neither endpoint: this plugin cannot serve a
real fleet. Every endpoint gets its two requests at once (two kept-alive HTTP/1.1 connections per
endpoint, all requests written before any answer is read), and the worker's event loop is BLOCKED
meanwhile (a scorer is synchronous): a few milliseconds per decision on loopback.
Formula (the engine model of backends/simulator_engine.py, its default step costs unless given):
  uncached = prompt_tokens - cached_tokens(e)
  batch = min(running + waiting + 1, max_num_seqs)
  step = step_base + step_per_seq * batch
  slot_wait = max(0, running + waiting + 1 - max_num_seqs) * max_tokens * step / max_num_seqs
  kv_wait = max_tokens * step when the free KV blocks cannot hold the request's uncached footprint
  lora_wait = max_tokens * step when its adapter is not running there and `max_loras` are
  ttft(e) = (step + prefill_per_token * uncached + slot_wait + kv_wait + lora_wait) * time_scale / speed
  (requests wait in the simulator only for a slot, KV blocks or a LoRA slot: their prompts are not
  counted again; a first version added the waiting prompts' tokens and steered away from warm caches)
  score(e) = -ttft(e) (min-max normalised by the framework: the fastest predicted endpoint 1).
An endpoint that does not answer, or answers 404 (the adapter is not loaded there), is left out
(the framework gives it 0). It is a greedy oracle (each request to the endpoint of least predicted
TTFT now), not an optimal schedule.
Parameters: `timeoutS` (0.5), `stepBaseMs` (6.2), `stepPerSeqMs` (0.3), `prefillUsPerToken` (33):
the simulator's step model (set them when the fleet's simulators run other step costs).
Data consumed: the request's model and messages (or prompt), `max_tokens`; each simulator's
/simulator endpoints. Cost: 2 HTTP round trips per candidate per decision, concurrent (about 1 to
15 ms in all for 8 endpoints on this loaded 2-core machine: the simulators answer
between their engine steps); registered so the benchmark can name it, never for production.
"""

from __future__ import annotations

import http.client
import json
from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin


class SimulatorOracleParameters(Parameters):
    timeout_s: float = Field(default=0.5, gt=0, le=10, alias="timeoutS")
    step_base_ms: float = Field(default=6.2, ge=0, alias="stepBaseMs")
    step_per_seq_ms: float = Field(default=0.3, ge=0, alias="stepPerSeqMs")
    prefill_us_per_token: float = Field(default=33.0, ge=0, alias="prefillUsPerToken")


class SimulatorOracleScorer(Plugin):
    type: ClassVar[str] = "simulator-oracle-scorer"
    slot: ClassVar[str] = "scorer"
    Parameters: ClassVar[type] = SimulatorOracleParameters

    def __init__(self, name: str, params: SimulatorOracleParameters, runtime: Any):
        super().__init__(name, params, runtime)
        self._conns: dict[tuple[str, int], http.client.HTTPConnection] = {}

    def _conn(self, endpoint: str, i: int) -> http.client.HTTPConnection:
        c = self._conns.get((endpoint, i))
        if c is None:
            host, _, port = endpoint.rpartition(":")
            c = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=self.params.timeout_s)
            self._conns[(endpoint, i)] = c
        return c

    def _drop(self, endpoint: str, i: int) -> None:
        c = self._conns.pop((endpoint, i), None)
        if c is not None:
            c.close()

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        req = ctx.request
        if req is None:
            return {}
        query: dict[str, Any] = {"model": req.model}
        if req.messages:  # chat: the simulator hashes the messages' contents concatenated
            query["messages"] = list(req.messages)
        elif req.prompt is not None:
            query["prompt"] = req.prompt
        else:
            return {}
        body = json.dumps(query).encode()
        sent: list[tuple[str, int]] = []
        for e in candidates:  # write every question first: the simulators answer concurrently
            for i, (method, path, payload) in enumerate((("POST", "/simulator/cached_prefix", body),
                                                         ("GET", "/simulator/state?hashes=0", None))):
                try:
                    c = self._conn(e, i)
                    c.request(method, path, body=payload, headers={"content-type": "application/json"})
                    sent.append((e, i))
                except (OSError, http.client.HTTPException):
                    self._drop(e, i)
        answers: dict[tuple[str, int], Any] = {}
        for e, i in sent:
            try:
                r = self._conns[(e, i)].getresponse()
                data = r.read()
                if r.status == 200:
                    answers[(e, i)] = json.loads(data)
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                self._drop(e, i)
        p = self.params
        max_tokens = getattr(req, "max_tokens", None) or 16
        lora = getattr(req, "lora", None) or req.model
        scores: dict[str, float] = {}
        for e in candidates:
            cp, st = answers.get((e, 0)), answers.get((e, 1))
            if cp is None or st is None:
                continue
            engine = next(iter(st.get("engines", {}).values()), {})
            running, waiting = int(engine.get("num_running", 0)), int(engine.get("num_waiting", 0))
            seqs = max(int(st.get("max_num_seqs") or 1), 1)
            step = (p.step_base_ms + p.step_per_seq_ms * min(running + waiting + 1, seqs)) * 1e-3
            uncached = max(int(cp["prompt_tokens"]) - int(cp["cached_tokens"]), 0)
            t = step + p.prefill_us_per_token * 1e-6 * uncached
            t += max(0, running + waiting + 1 - seqs) * max_tokens * step / seqs
            block = int(cp.get("block_size") or 16)
            need = -(-(uncached + max_tokens) // block)
            if int(engine.get("free_blocks", 0)) - int(engine.get("reserved_blocks", 0)) < need:
                t += max_tokens * step
            loras = st.get("loras") or {}
            max_loras = loras.get("max_loras")
            running_loras = set(loras.get("running") or ())
            if (lora in (loras.get("loaded") or {}) and max_loras is not None and lora not in running_loras
                    and len(running_loras) >= max_loras):
                t += max_tokens * step
            scores[e] = -t * float(st.get("time_scale") or 1.0) / float(st.get("speed") or 1.0)
        return scores


__all__ = ["SimulatorOracleScorer"]
