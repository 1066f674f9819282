"""Scorer `kv-cache-utilization-scorer`: more free KV cache scores higher (GIE's kv-cache-utilization-scorer).

What: reads each candidate's KV-cache use in [0, 1] (vLLM `vllm:kv_cache_usage_perc`, or the older
`vllm:gpu_cache_usage_perc`; SGLang `sglang:token_usage`; TensorRT-LLM's block fraction) from the
worker's engine-metrics scraper (`ctx.runtime.signals.sample(e)`) and scores the free share, as
the Gateway API Inference Extension does (pkg/epp/scheduling/framework/plugins/
kvcacheutilizationscorer/kvcache_utilization.go: `1 - KVCacheUsagePercent`). Bounded: the
framework only clamps (so an endpoint at 90% scores 0.1 whatever the others do, unlike a min-max
scale, which would make 89% vs 90% a 0-to-1 difference). It reads the last sample whatever its age.
Formula: score(e) = 1 - kv_usage(e); a candidate without a sample, or whose engine exports no KV
gauge (ONNX Runtime, Triton without TensorRT-LLM), is left out (0 after normalisation).
Parameters: none.
Data consumed: engine metrics (KV-cache use). Cost: one dict lookup per candidate.
"""

from __future__ import annotations

from typing import Any, ClassVar

from extproc.scheduling import Parameters, Plugin
from extproc.scheduling.signals import ENGINE_METRICS


class KVCacheUtilizationScorerParameters(Parameters):
    pass


class KVCacheUtilizationScorer(Plugin):
    type: ClassVar[str] = "kv-cache-utilization-scorer"
    slot: ClassVar[str] = "scorer"
    bounded: ClassVar[bool] = True
    consumes: ClassVar[tuple[str, ...]] = (ENGINE_METRICS,)
    Parameters: ClassVar[type] = KVCacheUtilizationScorerParameters

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        sample = self.runtime.signals.sample
        out: dict[str, float] = {}
        for e in candidates:
            s = sample(e)
            if s is not None and s.kv_usage is not None:
                out[e] = 1.0 - s.kv_usage
        return out
