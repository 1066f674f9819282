"""Stages of the request pipeline, one per file; which ones a route runs is its kind's
(`extproc/kinds.py`, the table there)."""

from __future__ import annotations

from typing import Any

from extproc.pipeline import Pipeline


def build_pipeline(route: Any, qos: Any = None, admission: Any = None) -> Pipeline:
    """The route kind's stages; with `spec.qos` (`qos`: extproc.qos.engine.QosConfig) every inference
    route also runs `qos-admit` right after `admit` and `qos-engine` last (docs/qos.md); with
    `spec.qos.admission` (`admission`: extproc.qos.queue.AdmissionConfig) a route targeting a listed pool
    runs `qos-queue` right before each of its `dispatch` stages, in the same phase."""
    from extproc.kinds import kind_specs

    spec = kind_specs().get(route.kind)
    if spec is None:
        raise ValueError(f"no pipeline for route kind {route.kind!r}")
    stages = spec.stages(route)
    # websocket routes: a socket's life is no request latency for the SLO windows and breakers, it has no body
    # for qos-engine (a body phase would make Envoy buffer the frames) and must not hold a queue slot for its life
    if qos is not None and route.kind not in ("health", "websocket"):
        from extproc.stages.qos_admit import QosAdmit
        from extproc.stages.qos_engine import QosEngine

        at = next((i + 1 for i, s in enumerate(stages) if getattr(s, "name", None) == "admit"), 0)
        stages = [*stages[:at], QosAdmit(qos), *stages[at:], QosEngine(qos)]
        if admission is not None and any(b.name in admission.pools for b in route.backends):
            from extproc.stages.dispatch import DispatchAtBody, DispatchAtHeaders
            from extproc.stages.qos_queue import QosQueueAtBody, QosQueueAtHeaders

            queued = []
            for s in stages:
                if isinstance(s, DispatchAtHeaders):
                    queued.append(QosQueueAtHeaders(admission, qos.default, s.only_without_body))
                elif isinstance(s, DispatchAtBody):
                    queued.append(QosQueueAtBody(admission, qos.default))
                queued.append(s)
            stages = queued
    return Pipeline(stages)
