"""Scorer `lora-affinity-scorer`: endpoints with the request's LoRA adapter score higher; optionally loads it on demand.

What: the Gateway API Inference Extension's `lora-affinity-scorer` (pkg/epp/scheduling/framework/
plugins/loraaffinityscorer/lora_affinity.go) over vLLM's `vllm:lora_requests_info{running_lora_adapters,
waiting_lora_adapters, max_lora}` (SGLang exports no adapter names: its endpoints score only by
what this plugin loaded there), read from the worker's scraper (`ctx.runtime.signals`), plus what
this plugin itself loaded. The adapter is the request's `lora` when the parser set it, else its
`model` unless some candidate's engine lists that name as a base model (`model_name` of its metrics),
so a base-model request scores 1.0 everywhere (neutral). vLLM lists an adapter only while
requests for it run or wait; an adapter loaded and idle is invisible in the metrics, so the
plugin remembers its own successful loads per endpoint (per worker; an engine restart that drops
them is not noticed until a request for it fails there: `loaded` entries are not aged out).
Scores (GIE's values, plus `loading`, which GIE has not):
  1.0  loaded: the adapter runs there (metrics) or this plugin loaded it there;
  0.9  loading: this plugin's load of it there is in flight (ranked above a free slot so a burst
       of requests for a cold adapter does not start a load on every endpoint);
  0.8  a free slot: len(running ∪ waiting adapters) < max_lora (GIE's "capacity to load one more");
  0.6  waiting: requests for it wait there (GIE's "already in the queue");
  0.0  none of these (full, or the engine exports no LoRA information).
Bounded: the framework only clamps.
On-demand loading (`loadOnDemand: true`): after the decision (`picked`), when the picked endpoint
does not have the adapter (not loaded, not loading) and a path is known for it (endpoint label
`lora/<adapter>`, else `loraPaths[adapter]`), the worker POSTs vLLM's `/v1/load_lora_adapter`
`{"lora_name", "lora_path"}` to that endpoint in an asyncio task, off the request path. 200, or
vLLM's 400 "has already been loaded" (another worker was first), marks it loaded there; anything
else is logged and the endpoint is not asked again for that adapter for `retryAfter` seconds.
Choice: the request is not held for the load. It goes where the profile picked; when some
candidate has the adapter the weights send it there (1.0 against at most 0.8 elsewhere), and the
load on a lacking pick is for the requests that follow. Only a cold adapter (no candidate has it)
makes a request go to an endpoint without it: vLLM (without a LoRA resolver) and the simulator
answer 404 for it until the load completes, about `--lora-load-ms`; later requests find it there
(1.0). Holding the request instead would need the dispatch decision to await (it is one
synchronous call in the request-body phase, `extproc/stages/dispatch.py`), which this change
leaves as it is.
Formula: above, per candidate. Parameters: `loadOnDemand` (false), `loraPaths` ({adapter: path}),
`retryAfter` (seconds, 10), `loadTimeout` (seconds, 30).
Data consumed: engine metrics (LoRA adapters running / waiting, max_lora, base models), the
request's model / lora, endpoint labels, this plugin's own loads. Cost: a few set lookups per
candidate; a load is one HTTP POST per (endpoint, adapter), off the request path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin
from extproc.scheduling.signals import ENGINE_METRICS

log = logging.getLogger(__name__)

LOADED, LOADING, FREE_SLOT, WAITING, NONE = 1.0, 0.9, 0.8, 0.6, 0.0
LABEL_PREFIX = "lora/"


class LoraAffinityScorerParameters(Parameters):
    load_on_demand: bool = Field(default=False, alias="loadOnDemand")
    lora_paths: dict[str, str] = Field(default_factory=dict, alias="loraPaths")
    retry_after: float = Field(default=10.0, alias="retryAfter", ge=0)
    load_timeout: float = Field(default=30.0, alias="loadTimeout", gt=0)


class LoraAffinityScorer(Plugin):
    type: ClassVar[str] = "lora-affinity-scorer"
    slot: ClassVar[str] = "scorer"
    bounded: ClassVar[bool] = True
    consumes: ClassVar[tuple[str, ...]] = (ENGINE_METRICS,)
    Parameters: ClassVar[type] = LoraAffinityScorerParameters

    def __init__(self, name: str, params: LoraAffinityScorerParameters, runtime: Any):
        super().__init__(name, params, runtime)
        self.loaded: dict[str, set[str]] = {}  # endpoint -> adapters this plugin loaded there
        self.loading: dict[tuple[str, str], asyncio.Task] = {}  # (endpoint, adapter) -> its load
        self.failed_until: dict[tuple[str, str], float] = {}  # (endpoint, adapter) -> monotonic time
        self.results: list[tuple[str, str, int | str]] = []  # (endpoint, adapter, status or error), last 64
        self._client: Any = None

    # --- scoring -----------------------------------------------------------------------------------

    def adapter(self, ctx: Any, candidates: tuple[str, ...]) -> str | None:
        req = ctx.request
        if req is None:
            return None
        if req.lora:
            return req.lora
        model = req.model
        if not model:
            return None
        sample = self.runtime.signals.sample
        for e in candidates:
            s = sample(e)
            if s is not None and model in s.models:
                return None  # a base model
        return model

    def state(self, endpoint: str, adapter: str) -> float:
        if adapter in self.loaded.get(endpoint, ()):
            return LOADED
        s = self.runtime.signals.sample(endpoint)
        running = s.lora_running if s is not None else None
        if running is not None and adapter in running:
            return LOADED
        if (endpoint, adapter) in self.loading:
            return LOADING
        if s is None or running is None:
            return NONE
        waiting = s.lora_waiting or ()
        if s.max_lora is not None and len(set(running) | set(waiting)) < s.max_lora:
            return FREE_SLOT
        return WAITING if adapter in waiting else NONE

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        adapter = self.adapter(ctx, candidates)
        if adapter is None:
            return dict.fromkeys(candidates, 1.0)
        ctx.cycle[(self.name, "adapter")] = adapter
        return {e: self.state(e, adapter) for e in candidates}

    # --- on-demand loading ---------------------------------------------------------------------------

    def path(self, ctx: Any, endpoint: str, adapter: str) -> str | None:
        labels = ctx.labels.get(endpoint) or {}
        return labels.get(LABEL_PREFIX + adapter) or self.params.lora_paths.get(adapter)

    def picked(self, ctx: Any, endpoint: str) -> None:
        if not self.params.load_on_demand:
            return
        adapter = ctx.cycle.get((self.name, "adapter"))
        if adapter is None or self.state(endpoint, adapter) in (LOADED, LOADING):
            return
        key = (endpoint, adapter)
        if self.failed_until.get(key, 0.0) > time.monotonic():
            return
        path = self.path(ctx, endpoint, adapter)
        if path is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a decision made outside the worker): nothing to run the load on
            return
        self.loading[key] = loop.create_task(self._load(endpoint, adapter, path), name=f"load {adapter} on {endpoint}")

    async def _load(self, endpoint: str, adapter: str, path: str) -> None:
        import httpx

        key = (endpoint, adapter)
        status: int | str
        try:
            if self._client is None:
                self._client = httpx.AsyncClient(timeout=self.params.load_timeout, trust_env=False)
            resp = await self._client.post(f"http://{endpoint}/v1/load_lora_adapter",  # the timeout of now:
                                           json={"lora_name": adapter, "lora_path": path},  # a reload may change it
                                           timeout=self.params.load_timeout)
            status = resp.status_code
            ok = status == 200 or (status == 400 and "already been loaded" in resp.text)
            if not ok:
                log.warning("loading LoRA adapter %r (%s) on %s: HTTP %d %s", adapter, path, endpoint, status,
                            resp.text[:200])
        except Exception as exc:  # noqa: BLE001 - off the request path: logged, retried after retryAfter
            status, ok = f"{type(exc).__name__}: {exc}", False
            log.warning("loading LoRA adapter %r (%s) on %s failed: %s", adapter, path, endpoint, status)
        finally:
            self.loading.pop(key, None)
        if ok:
            self.loaded.setdefault(endpoint, set()).add(adapter)
            self.failed_until.pop(key, None)
        else:
            self.failed_until[key] = time.monotonic() + self.params.retry_after
        self.results = [*self.results[-63:], (endpoint, adapter, status)]

    def close(self) -> None:
        for task in self.loading.values():
            task.cancel()
        client, self._client = self._client, None
        if client is not None:
            try:
                asyncio.get_running_loop().create_task(client.aclose())
            except RuntimeError:
                pass
