"""Scorer `queue-scorer`: fewer requests waiting in the engine's queue scores higher (GIE's queue-scorer).

What: reads each candidate's `queue` (requests waiting to be scheduled: vLLM
`vllm:num_requests_waiting`, SGLang `sglang:num_queue_reqs`, Triton pending requests, ...) from
the worker's engine-metrics scraper (`ctx.runtime.signals.sample(e)`) and scales it between the
shortest and the longest queue among the candidates, as the Gateway API Inference Extension's
`queue-scorer` does (pkg/epp/scheduling/framework/plugins/queuescorer/queue.go, `Score`: min and
max of WaitingQueueSize over the pods; score (max - q) / (max - min); all equal: 1.0, "a neutral
score"). Bounded (`bounded = True`): its output is already in [0, 1], the framework only clamps.
It reads the last sample whatever its age: pair it with `saturation-filter` to drop stale ones.
Formula: score(e) = (max_c q(c) - q(e)) / (max_c q(c) - min_c q(c)) over the candidates c with a
sample; 1.0 for all of them when every queue is equal; a candidate without a sample, or whose
engine exports no queue, is left out (the framework gives it 0). (GIE counts a pod without
metrics as queue 0, i.e. as idle; here it is not trusted.)
Parameters: none.
Data consumed: engine metrics (queue). Cost: one dict lookup per candidate plus a min/max.
"""

from __future__ import annotations

from typing import Any, ClassVar

from extproc.scheduling import Parameters, Plugin
from extproc.scheduling.signals import ENGINE_METRICS


class QueueScorerParameters(Parameters):
    pass


class QueueScorer(Plugin):
    type: ClassVar[str] = "queue-scorer"
    slot: ClassVar[str] = "scorer"
    bounded: ClassVar[bool] = True
    consumes: ClassVar[tuple[str, ...]] = (ENGINE_METRICS,)
    Parameters: ClassVar[type] = QueueScorerParameters

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        sample = self.runtime.signals.sample
        queues: dict[str, int] = {}
        for e in candidates:
            s = sample(e)
            if s is not None and s.queue is not None:
                queues[e] = s.queue
        if not queues:
            return {}
        lo, hi = min(queues.values()), max(queues.values())
        if hi == lo:
            return dict.fromkeys(queues, 1.0)
        span = hi - lo
        return {e: (hi - q) / span for e, q in queues.items()}
