"""The stage pipeline: ordered stages with phase-named hooks over one `RequestState`.

What: a `Stage` is any object with a `name` and one or more hooks named after ext_proc phases
(`on_request_headers`, `on_request_body`, `on_response_headers`, `on_response_body`, ...) and,
optionally, the lifecycle hooks `on_start(state)` (the stream opened) and `on_done(state, outcome)`
(the request ended: fired exactly once by `extproc/lifecycle.py`, whatever the ending). A
`Pipeline` binds the hooks of its stages once, per phase, in order, and runs them for each message:
`Continue`/`None` passes on, `Mutate`s are merged, the first `Reject` or `Respond` ends the request.
Why: mitmproxy's addon chain, but checked at build time: a hook name that is not a phase or a
lifecycle hook (a typo such as `on_request_header`) is an error when the config loads, not a hook
that silently never runs. The set of phases a pipeline uses is what the Envoy config asks for, so
no route pays for a phase it does not use; lifecycle hooks cost no phase (they are fed by the
stream's end and Envoy's access log).
Cost: per message, one dict lookup plus one call per hook; async hooks are awaited only if they
are coroutine functions (decided at build time).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Iterable

from extproc.errors import reject
from extproc.types import CONTINUE, HttpMessage, Mutate, Outcome, Phase, Reject, RequestState, Respond, Verdict

log = logging.getLogger(__name__)

_HOOKS = {f"on_{p.value}": p for p in Phase}
LIFECYCLE_HOOKS = ("on_start", "on_done")


class PipelineError(ValueError):
    """A stage is malformed (for example a misspelled hook name)."""


class Pipeline:
    """Stages bound per phase. Immutable after construction; shared by all streams of a route."""

    __slots__ = ("stages", "_hooks", "streamed", "_starts", "_dones", "last", "reads_response")

    def __init__(self, stages: Iterable[Any]):
        self.stages = tuple(stages)
        hooks: dict[Phase, list[tuple[str, Callable, bool]]] = {}
        starts: list[tuple[str, Callable]] = []
        dones: list[tuple[str, Callable]] = []
        for stage in self.stages:
            name = getattr(stage, "name", type(stage).__name__)
            for attr in dir(stage):
                if not attr.startswith("on_"):
                    continue
                if attr in LIFECYCLE_HOOKS:
                    (starts if attr == "on_start" else dones).append((name, getattr(stage, attr)))
                    continue
                phase = _HOOKS.get(attr)
                if phase is None:
                    raise PipelineError(
                        f"stage {name!r} has hook {attr!r}, which is not a phase or lifecycle hook "
                        f"(known: {', '.join(sorted([*_HOOKS, *LIFECYCLE_HOOKS]))})"
                    )
                fn = getattr(stage, attr)
                hooks.setdefault(phase, []).append((name, fn, inspect.iscoroutinefunction(fn)))
        self._hooks = {p: tuple(h) for p, h in hooks.items()}
        self._starts = tuple(starts)
        self._dones = tuple(dones)
        # Body phases some stage wants chunk by chunk (`streams = (Phase.RESPONSE_BODY,)` on the
        # stage class) instead of buffered whole: Envoy's STREAMED mode, for SSE.
        self.streamed = frozenset(p for stage in self.stages for p in getattr(stage, "streams", ()))
        self.last = self.last_phase()
        # the stream sees the response (status, served endpoint, end) when some stage reads it
        self.reads_response = bool(self._hooks.keys() & {Phase.RESPONSE_HEADERS, Phase.RESPONSE_BODY,
                                                        Phase.RESPONSE_TRAILERS})

    @property
    def phases(self) -> frozenset[Phase]:
        """Phases at least one stage handles: the processing mode Envoy is configured with."""
        return frozenset(self._hooks)

    def last_phase(self) -> Phase | None:
        """The last phase the pipeline reads: once its last message is seen, the processor has seen
        all it asked for (an Envoy reset after that is Envoy's normal end of the side stream)."""
        for p in reversed(tuple(Phase)):
            if p in self._hooks:
                return p
        return None

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
                return reject(500, "stage_error", f"internal error in stage {name}")
            if verdict is None or verdict is CONTINUE:
                continue
            if isinstance(verdict, (Reject, Respond)):
                return verdict
            result = verdict if result is CONTINUE else result.merge(verdict)  # type: ignore[union-attr]
        return result

    async def run_traced(self, state: RequestState, msg: HttpMessage, trace: Any, ctx: Any) -> Verdict:
        """`run` with a span per stage hook under the phase span's context `ctx` (extproc/tracing.py:
        only sampled requests of a config with `spec.tracing` come here; `run` stays span-free)."""
        hooks = self._hooks.get(msg.phase)
        if not hooks:
            return CONTINUE
        result: Verdict = CONTINUE
        phase = msg.phase
        for name, fn, is_async in hooks:
            span = trace.stage_start(name, phase, ctx)
            try:
                verdict = await fn(state, msg) if is_async else fn(state, msg)
            except Exception as e:  # as in run: the client gets a 500
                trace.stage_end(span, error=e)
                log.exception("stage %s failed in %s", name, msg.phase.value)
                return reject(500, "stage_error", f"internal error in stage {name}")
            except BaseException as e:  # cancelled: the span ends, the cancellation goes on
                trace.stage_end(span, error=e)
                raise
            trace.stage_end(span, verdict)
            if verdict is None or verdict is CONTINUE:
                continue
            if isinstance(verdict, (Reject, Respond)):
                return verdict
            result = verdict if result is CONTINUE else result.merge(verdict)  # type: ignore[union-attr]
        return result

    def start(self, state: RequestState) -> None:
        for name, fn in self._starts:
            try:
                fn(state)
            except Exception:
                log.exception("stage %s failed in on_start", name)

    def done(self, state: RequestState, outcome: Outcome) -> None:
        for name, fn in self._dones:
            try:
                fn(state, outcome)
            except Exception:  # one observer's bug must not hide the request's end from the others
                log.exception("stage %s failed in on_done", name)


__all__ = ["Pipeline", "PipelineError", "reject", "Mutate", "LIFECYCLE_HOOKS"]
