"""The stage pipeline: ordered stages with phase-named hooks over one `RequestState`.

What: a `Stage` is any object with a `name` and one or more hooks named after ext_proc phases
(`on_request_headers`, `on_request_body`, `on_response_headers`, `on_response_body`, ...). A
`Pipeline` binds the hooks of its stages once, per phase, in order, and runs them for each message:
`Continue`/`None` passes on, `Mutate`s are merged, the first `Reject` ends the request.
Why: mitmproxy's addon chain, but checked at build time: a hook name that is not a phase (a typo
such as `on_request_header`) is an error when the config loads, not a hook that silently never
runs. The set of phases a pipeline uses is what the Envoy config asks for, so no route pays for a
phase it does not use.
Cost: per message, one dict lookup plus one call per hook; async hooks are awaited only if they
are coroutine functions (decided at build time).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Iterable

import orjson

from extproc.types import CONTINUE, HttpMessage, Mutate, Phase, Reject, RequestState, Verdict

log = logging.getLogger(__name__)

_HOOKS = {f"on_{p.value}": p for p in Phase}


class PipelineError(ValueError):
    """A stage is malformed (for example a misspelled hook name)."""


def error_body(status: int, code: str, message: str, **extra: Any) -> bytes:
    """The JSON error body every processor-made error uses."""
    err: dict[str, Any] = {"status": status, "code": code, "message": message}
    err.update({k: v for k, v in extra.items() if v is not None})
    return orjson.dumps({"error": err})


def reject(status: int, code: str, message: str, **extra: Any) -> Reject:
    return Reject(status, error_body(status, code, message, **extra), code)


class Pipeline:
    """Stages bound per phase. Immutable after construction; shared by all streams of a route."""

    __slots__ = ("stages", "_hooks", "streamed")

    def __init__(self, stages: Iterable[Any]):
        self.stages = tuple(stages)
        hooks: dict[Phase, list[tuple[str, Callable, bool]]] = {}
        for stage in self.stages:
            name = getattr(stage, "name", type(stage).__name__)
            for attr in dir(stage):
                if not attr.startswith("on_"):
                    continue
                phase = _HOOKS.get(attr)
                if phase is None:
                    raise PipelineError(
                        f"stage {name!r} has hook {attr!r}, which is not a phase "
                        f"(known: {', '.join(sorted(_HOOKS))})"
                    )
                fn = getattr(stage, attr)
                hooks.setdefault(phase, []).append((name, fn, inspect.iscoroutinefunction(fn)))
        self._hooks = {p: tuple(h) for p, h in hooks.items()}
        # Body phases some stage wants chunk by chunk (`streams = (Phase.RESPONSE_BODY,)` on the
        # stage class) instead of buffered whole: Envoy's STREAMED mode, for SSE.
        self.streamed = frozenset(p for stage in self.stages for p in getattr(stage, "streams", ()))

    @property
    def phases(self) -> frozenset[Phase]:
        """Phases at least one stage handles: the processing mode Envoy is configured with."""
        return frozenset(self._hooks)

    async def run(self, state: RequestState, msg: HttpMessage) -> Verdict:
        hooks = self._hooks.get(msg.phase)
        if not hooks:
            return CONTINUE
        result: Verdict = CONTINUE
        for name, fn, is_async in hooks:
            try:
                verdict = await fn(state, msg) if is_async else fn(state, msg)
            except Exception:  # a stage bug must not take the worker down; the client gets a 500
                log.exception("stage %s failed in %s", name, msg.phase.value)
                return reject(500, "stage_error", f"internal error in stage {name}", request_id=state.request_id)
            if verdict is None or verdict is CONTINUE:
                continue
            if isinstance(verdict, Reject):
                return verdict
            result = verdict if isinstance(result, type(CONTINUE)) else result.merge(verdict)  # type: ignore[union-attr]
        return result


__all__ = ["Pipeline", "PipelineError", "reject", "error_body", "Mutate"]
