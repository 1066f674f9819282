"""Protocol negotiation: learn each OpenAI-compatible backend's dialect by asking it (backends/dialects.py).

What, per endpoint of a backend of kind `openai` or `vllm` (unless its config says `negotiate: false`):
1. `GET /v1/models`: which server it is (`owned_by`: vllm, sglang, llamacpp, ollama; llama-cpp-python
   says "me") and a model name to probe with;
2. structured output: a chat request of at most 8 tokens asking for `{"ok": <boolean>}` in each
   encoding of `dialects.PROBE_ORDER` until one is *enforced*: the server answers 2xx and the answer
   starts with `{` (a server that accepts and ignores a field answers prose: that is not support);
   none enforced -> `prompt` (routes with an output schema then ask in the prompt, or refuse);
3. usage in streams: a streamed 1-token chat with `stream_options.include_usage`: a usage chunk ->
   `yes`, none -> `no`, an error -> `refused`;
4. priority: a 1-token chat with `priority: 0`: an error -> `refused`, else `honoured` on vLLM and
   SGLang, `ignored` elsewhere; LoRA: `POST /v1/load_lora_adapter` with no adapter: 404/405 -> `none`,
   any other answer (vLLM's 400 for the missing name) -> `runtime`.
The endpoints' results are joined into the backend's dialect (a capability counts when every answering
endpoint has it), then the parts the config fixes are put over it (`DialectConfig.apply`).
When: each worker negotiates its snapshot's backends at start-up (in the background), a backend it
meets for the first time on a request before that finished (the request waits, bounded), and again on
every `GET /health/adapter?probe=protocol-negotiation` it answers, which reports the result; a
backend none of whose endpoints answered is tried again (in the background) when a request needs it
`RETRY_DOWN` seconds later.
State: a `Negotiator` per worker, in `Runtime.cache("negotiation")` (worker lifetime): what each
endpoint answered, by address and protocol (an endpoint is probed once, except by health checks:
a reload that adds endpoints, or another backend on the same server, probes only what is new), and
each backend's joined dialect, by name, endpoints and dialect config. Each worker negotiates on its own.
Cost: about 8 small requests per endpoint (7 of at most 8 generated tokens), off the request path;
a request waits only for a backend never negotiated yet, at most `REQUEST_WAIT` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import httpx
import orjson

from backends.dialects import PRESETS, PROBE_ORDER, Dialect, DialectConfig, structured_fields

log = logging.getLogger(__name__)
NEGOTIATING_KINDS = frozenset({"openai", "vllm"})
PROBE_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
PROBE_MESSAGES = ({"role": "user", "content": "Is this service up? Answer in JSON."},)
# every probe says what it is (servers' logs; our simulator leaves probes out of its request record)
PROBE_HEADERS = {"x-adapter-probe": "protocol-negotiation", "user-agent": "adapter-gateway-negotiation"}
STARTUP_TIMEOUT = 10.0  # per endpoint, at start-up and on a first request's behalf
REQUEST_WAIT = 0.5  # how long a request waits for its backend's first negotiation
RETRY_DOWN = 10.0  # a backend none of whose endpoints answered is negotiated again after this long
ENGINES = MappingProxyType({"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "ollama": "ollama",
                           "library": "ollama", "me": "llama-cpp-python", "openai": "openai", "system": "openai"})
ORDER = MappingProxyType({"stream_usage": ("yes", "no", "refused"), "priority": ("honoured", "ignored", "refused"),
                         "lora": ("runtime", "none")})


def dialect_config(backend: Any) -> DialectConfig:
    return getattr(backend, "dialect", None) or DialectConfig()


def negotiates(backend: Any) -> bool:
    return backend.kind in NEGOTIATING_KINDS and dialect_config(backend).negotiate


@dataclass(frozen=True, slots=True)
class Negotiated:
    dialect: Dialect  # the config's fixed parts applied
    source: str  # "probe", "config" (negotiate: false) or "default" (no endpoint answered)
    endpoints: tuple[dict, ...]
    at: float  # wall clock

    def report(self, config: DialectConfig) -> dict[str, Any]:
        out: dict[str, Any] = {**self.dialect.as_dict(), "source": self.source}
        if config.fixed():
            out["fixed_by_config"] = list(config.fixed())
        out["negotiated_at"] = round(self.at, 3)
        return out


async def _chat(client: httpx.AsyncClient, model: str | None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"messages": PROBE_MESSAGES, "max_tokens": 1, "temperature": 0, "seed": 0, **extra}
    if model:
        body["model"] = model
    return await client.post("/v1/chat/completions", content=orjson.dumps(body),
                             headers={"content-type": "application/json"})


def _content(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["choices"][0]["message"]["content"] or "")
    except (ValueError, KeyError, IndexError, TypeError):
        return ""


async def _structured(client: httpx.AsyncClient, model: str | None, tried: dict[str, str]) -> str:
    for encoding in PROBE_ORDER:
        r = await _chat(client, model, max_tokens=8, **structured_fields(encoding, "probe", PROBE_SCHEMA))
        if r.status_code >= 300:
            tried[encoding] = f"refused (HTTP {r.status_code})"
            continue
        if _content(r).lstrip().startswith("{"):
            tried[encoding] = "enforced"
            return encoding
        tried[encoding] = "ignored (the answer is not JSON)"
    return "prompt"


async def _stream_usage(client: httpx.AsyncClient, model: str | None) -> str:
    body: dict[str, Any] = {"messages": PROBE_MESSAGES, "max_tokens": 1, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    async with client.stream("POST", "/v1/chat/completions", content=orjson.dumps(body),
                             headers={"content-type": "application/json"}) as r:
        if r.status_code >= 300:
            await r.aread()
            return "refused"
        data = await r.aread()
    for line in data.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                if orjson.loads(line[6:]).get("usage"):
                    return "yes"
            except (orjson.JSONDecodeError, AttributeError):
                continue
    return "no"


async def _priority(client: httpx.AsyncClient, model: str | None, engine: str) -> str:
    r = await _chat(client, model, priority=0)
    if r.status_code >= 300:
        return "refused"
    return "honoured" if engine in ("vllm", "sglang") else "ignored"


async def _lora(client: httpx.AsyncClient) -> str:
    r = await client.post("/v1/load_lora_adapter", content=b"{}", headers={"content-type": "application/json"})
    return "none" if r.status_code in (404, 405) else "runtime"


async def negotiate_endpoint(host: str, port: int, protocol: str, timeout: float,
                             model_hint: str | None = None) -> dict[str, Any]:
    """What one endpoint accepts: {"address", "status", "engine", "structured", "tried", ...}.
    `model_hint` (the backend's first configured model) is probed with when `/v1/models` names none."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    out: dict[str, Any] = {"address": address}
    started = time.perf_counter()
    try:
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=timeout, headers=PROBE_HEADERS,
                                     http1=protocol != "grpc", http2=protocol == "grpc") as client:
            async with asyncio.timeout(timeout):
                models = await client.get("/v1/models")
                engine, model = "openai", model_hint
                if models.status_code < 300:
                    try:
                        data = models.json().get("data") or []
                        first = data[0] if data and isinstance(data[0], dict) else {}
                    except (ValueError, AttributeError):
                        first = {}
                    model = first.get("id") if isinstance(first.get("id"), str) else model_hint
                    engine = ENGINES.get(str(first.get("owned_by", "")).lower(), "openai")
                tried: dict[str, str] = {}
                structured = await _structured(client, model, tried)
                # one after the other: some servers cut a stream short when the next request comes
                # (llama-cpp-python's `interrupt_requests`, on by default)
                usage = await _stream_usage(client, model)
                priority = await _priority(client, model, engine)
                lora = await _lora(client)
        out.update(status="ok", engine=engine, structured=structured, stream_usage=usage, priority=priority,
                   lora=lora, tried=tried)
    except TimeoutError:
        out.update(status="down", error=f"negotiation did not finish within {timeout:g}s")
    except (httpx.HTTPError, OSError) as e:
        out.update(status="down", error=f"{type(e).__name__}: {e}"[:200] or type(e).__name__)
    out["latency_ms"] = round((time.perf_counter() - started) * 1000, 2)
    return out


def join(results: list[dict[str, Any]], base: Dialect) -> Dialect | None:
    """The backend's dialect from its endpoints' results: what every answering endpoint can do."""
    ok = [r for r in results if r.get("status") == "ok"]
    if not ok:
        return None
    structured = {r["structured"] for r in ok}
    parts: dict[str, str] = {"structured": ok[0]["structured"] if len(structured) == 1 else "prompt",
                             "engine": ok[0]["engine"] if len({r["engine"] for r in ok}) == 1 else "mixed"}
    for key, order in ORDER.items():  # the weakest capability among the endpoints
        parts[key] = max((r[key] for r in ok), key=order.index)
    return replace(base, **parts)


class Negotiator:
    """One worker's negotiated dialects (see the module docstring)."""

    def __init__(self) -> None:
        self._results: dict[tuple, Negotiated] = {}
        self._tasks: dict[tuple, asyncio.Task] = {}
        # (host, port, protocol) -> (when, monotonic; what it answered)
        self._endpoints: dict[tuple[str, int, str], tuple[float, dict]] = {}
        self._locks: dict[tuple[str, int, str], asyncio.Lock] = {}

    @staticmethod
    def _key(backend: Any) -> tuple:
        return (backend.name, backend.endpoints, backend.protocol, dialect_config(backend))

    def dialect(self, backend: Any) -> Dialect:
        """The dialect to encode for now: negotiated, else the config's (preset by kind)."""
        got = self._results.get(self._key(backend))
        return got.dialect if got is not None else dialect_config(backend).base(backend.kind)

    def known(self, backend: Any) -> bool:
        """Negotiated (or not to be). A backend nobody answered for is tried again in the background
        every `RETRY_DOWN` seconds while requests come (call inside the running loop)."""
        if not negotiates(backend):
            return True
        got = self._results.get(self._key(backend))
        if got is None:
            return False
        if got.source == "default" and time.time() - got.at > RETRY_DOWN:
            self._task(backend, STARTUP_TIMEOUT)
        return True

    def start(self, backends: Any, timeout: float = STARTUP_TIMEOUT) -> None:
        """Negotiate, in the background, every backend not negotiated yet (inside a running loop)."""
        for b in backends:
            if negotiates(b):
                self._task(b, timeout)

    def _task(self, backend: Any, timeout: float, fresh: bool = False) -> asyncio.Task:
        key = self._key(backend)
        task = self._tasks.get(key)
        if task is None or task.done():
            task = self._tasks[key] = asyncio.get_running_loop().create_task(
                self._run(backend, key, timeout, fresh))
        return task

    async def _run(self, backend: Any, key: tuple, timeout: float, fresh: bool) -> Negotiated:
        config = dialect_config(backend)
        base = config.base(backend.kind)
        hint = backend.models[0] if backend.models else None
        results = list(await asyncio.gather(*(self._endpoint(h, p, backend.protocol, timeout, fresh, hint)
                                              for h, p in backend.endpoints)))
        joined = join(results, base)
        previous = self._results.get(key)
        if joined is None:  # nobody answered: keep what was learned before, else the config's
            got = replace(previous, endpoints=tuple(results), at=time.time()) if previous is not None else \
                Negotiated(base, "default", tuple(results), time.time())
        else:
            got = Negotiated(config.apply(joined), "probe", tuple(results), time.time())
        if previous is None or previous.dialect != got.dialect:
            log.info("backend %s: dialect %s (%s)", backend.name, got.dialect.as_dict(), got.source)
        self._results[key] = got
        for cache in (self._results, self._endpoints):
            while len(cache) > 1024:  # backends and endpoints of old snapshots
                cache.pop(next(iter(cache)))
        self._tasks.pop(key, None)
        return got

    async def _endpoint(self, host: str, port: int, protocol: str, timeout: float, fresh: bool,
                        model_hint: str | None = None) -> dict[str, Any]:
        """What one endpoint answered: learned once per endpoint (a backend that gains an endpoint, or
        another backend on the same server, probes only what is new), again when `fresh` (health checks)
        or when it did not answer. One probe of an endpoint at a time: a request cuts a running stream
        short on some servers, and probes should not pile up."""
        ep = (host, port, protocol)
        started = time.monotonic()
        if self._usable(ep, fresh, started):
            return self._endpoints[ep][1]
        lock = self._locks.get(ep)
        if lock is None:
            lock = self._locks[ep] = asyncio.Lock()
        async with lock:
            if self._usable(ep, fresh, started):  # learned while we waited (another backend, same server)
                return self._endpoints[ep][1]
            result = await negotiate_endpoint(host, port, protocol, timeout, model_hint)
            self._endpoints[ep] = (time.monotonic(), result)
            return result

    def _usable(self, ep: tuple, fresh: bool, since: float) -> bool:
        known = self._endpoints.get(ep)
        if known is None:
            return False
        return known[0] >= since if fresh else known[1].get("status") == "ok"

    async def ready(self, backend: Any, wait: float = REQUEST_WAIT) -> Dialect:
        """The dialect for a request: waits (at most `wait`) for a first negotiation of `backend`."""
        if not self.known(backend):
            task = self._task(backend, STARTUP_TIMEOUT)
            try:
                await asyncio.wait_for(asyncio.shield(task), wait)
            except TimeoutError:
                pass
        return self.dialect(backend)

    async def negotiate(self, backend: Any, timeout: float) -> dict[str, Any]:
        """Negotiate again (bounded by `timeout`; an unfinished one goes on in the background) and
        report: the dialect in use, its source, and each endpoint's answers."""
        config = dialect_config(backend)
        if not negotiates(backend):
            source = "config" if backend.kind in NEGOTIATING_KINDS else "not applicable"
            return {**config.base(backend.kind).as_dict(), "source": source} if source == "config" else \
                {"source": source}
        task = self._task(backend, STARTUP_TIMEOUT, fresh=True)  # the wait is bounded, not the negotiation
        try:
            got = await asyncio.wait_for(asyncio.shield(task), timeout + 0.05)
        except TimeoutError:
            got = self._results.get(self._key(backend))
            if got is None:
                return {**config.base(backend.kind).as_dict(), "source": "default",
                        "note": "negotiation still running"}
            return {**got.report(config), "note": "negotiation still running; this is the previous result",
                    "endpoints": list(got.endpoints)}
        return {**got.report(config), "endpoints": list(got.endpoints)}


# --- what the request path uses (encode-request, decode-response, openai-usage) -----------------------

DIALECT_ATTR = "dialect"  # state.attrs: the Dialect the request was encoded in
REPAIRED_ATTR = "dialect.repaired"  # state.attrs: the repaired backend answer decode-response reads
REPAIR_MARGIN = 0.2  # seconds of Envoy's message timeout left for the reply after a repair call


def negotiates_kind(backend: Any) -> bool:
    return backend is not None and backend.kind in NEGOTIATING_KINDS


def dialect_of(state: Any, backend: Any) -> Dialect:
    """The dialect to encode `state`'s request in for `backend` (no wait: see `dialects_known`)."""
    if state.runtime is None:
        return dialect_config(backend).base(backend.kind)
    return negotiator(state.runtime).dialect(backend)


async def dialects_known(state: Any) -> None:
    """Wait (bounded: `REQUEST_WAIT`, and a quarter of `spec.processor.messageTimeout`) until the route's
    OpenAI-compatible targets are negotiated."""
    if state.runtime is None or state.route is None:
        return
    n = negotiator(state.runtime)
    # never long enough for Envoy's per-message timeout to fire first: at most a quarter of it
    timeout = getattr(getattr(getattr(state, "snapshot", None), "processor", None), "message_timeout", None)
    wait = min(REQUEST_WAIT, timeout / 4) if isinstance(timeout, (int, float)) and timeout > 0 else REQUEST_WAIT
    waits = [n.ready(b, wait) for b in state.route.backends or (state.route.backend,)
             if b is not None and not n.known(b)]
    if waits:
        await asyncio.gather(*waits)


def refuse_structured(state: Any, backend: Any) -> Any:
    from extproc.errors import reject

    return reject(501, "structured_output_unsupported",
                  f"backend {backend.name} cannot constrain its output to this route's JSON schema (its dialect "
                  f"is `prompt`: see /health/adapter?probe=protocol-negotiation); the route's policy "
                  f"structuredFallback is `refuse`", backend=backend.name)


async def repair_answer(state: Any, route: Any, body: bytes) -> None:
    """In the `prompt` dialect: when the backend's answer does not match the route's schema, ask the
    endpoint that served once more, with the answer and the validation error, and keep that answer
    for decode-response (`REPAIRED_ATTR`). Bounded by Envoy's message timeout less a margin; on any
    failure the first answer stands (decode-response then reports it as `model_output_invalid`)."""
    from backends.base import BackendError
    from extproc.stages.decode_response import SANITISE_ATTR

    dialect = state.attrs.get(DIALECT_ATTR)
    if dialect is None or dialect.structured != "prompt" or route.response_schema is None \
            or SANITISE_ATTR in state.attrs or (state.response_status or 200) >= 300 or not state.backend_request:
        return
    backend = state.target if state.target is not None else route.backend
    adapter = backend.adapter
    try:
        adapter.decode(route, 200, body, structured="prompt")
        return  # it matches: nothing to repair
    except BackendError as e:
        if e.code != "model_output_invalid":
            return
        error = e.message
    try:
        first = orjson.loads(state.backend_request)
        answer = orjson.loads(body)["choices"][0]["message"]["content"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return
    from backends.dialects import REPAIR

    first["messages"] = [*first.get("messages", []), {"role": "assistant", "content": str(answer)},
                         {"role": "user", "content": REPAIR.format(error=error.split(": ", 1)[-1])}]
    address = state.served or state.endpoint
    if not address:
        return
    processor = getattr(state.snapshot, "processor", None)
    budget = max(0.05, (getattr(processor, "message_timeout", 1.0) or 1.0) - REPAIR_MARGIN)
    protocol = getattr(backend, "protocol", "http")
    try:
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=budget,
                                     http1=protocol != "grpc", http2=protocol == "grpc") as client:
            async with asyncio.timeout(budget):
                r = await client.post(adapter.chat_path, content=orjson.dumps(first),
                                      headers={"content-type": "application/json"})
    except (TimeoutError, httpx.HTTPError, OSError) as e:
        log.info("route %s: repair retry to %s failed: %s", route.name, address, type(e).__name__)
        state.attrs["dialect.repair"] = "failed"
        return
    state.attrs["dialect.repair"] = "sent"
    if r.status_code < 300:
        state.attrs[REPAIRED_ATTR] = r.content


def route_notes(snapshot: Any, n: Negotiator) -> tuple[dict[str, str], list[str]]:
    """Per route with an output schema on an OpenAI-compatible backend: how its structured output is
    asked for now, and the routes that refuse because their backend cannot constrain output."""
    notes: dict[str, str] = {}
    refused: list[str] = []
    for route in snapshot.routes.values():
        if route.response_schema is None:
            continue
        for b in route.backends or (route.backend,):
            if not negotiates_kind(b):
                continue
            structured = n.dialect(b).structured
            if structured != "prompt":
                notes[route.name] = f"{structured} (enforced by backend {b.name})"
            elif route.structured_fallback == "refuse":
                notes[route.name] = f"refused: backend {b.name} cannot constrain output (structuredFallback: refuse)"
                refused.append(f"route {route.name}")
            else:
                notes[route.name] = (f"fallback: backend {b.name} cannot constrain output; the schema is asked for "
                                     "in the prompt, the answer validated, one repair retry")
    return notes, refused


def negotiator(runtime: Any) -> Negotiator:
    """The worker's negotiator (a fresh one without a runtime: unit tests of stages)."""
    if runtime is None:
        return Negotiator()
    cache = runtime.cache("negotiation")
    n = cache.get("negotiator")
    if n is None:
        n = cache["negotiator"] = Negotiator()
    return n


__all__ = ["route_notes", "repair_answer", "refuse_structured", "dialects_known", "dialect_of", "negotiates_kind",
           "DIALECT_ATTR", "REPAIRED_ATTR", "Negotiator", "Negotiated", "negotiator", "negotiate_endpoint", "join",
           "negotiates", "dialect_config", "PRESETS"]
