"""Benchmark: the processor's own handler time per ext_proc stream, in process (a benchmark, never a test).

What: replays ProcessingRequest sequences recorded from Envoy 1.40 (tests/data/recorded: the
passthrough route, one message; the llm route, four) through `ExtProcService.Process` directly,
without gRPC or Envoy, `--streams` times after a warm-up, and prints CPU microseconds per stream
(process time). It isolates what our Python code (codec, pipeline, stages, lifecycle, metric
updates) costs from the grpc.aio machinery that dominates a real stream (perf/bench_overhead.py).
Before/after: `REPO=/path/to/older/checkout .venv/bin/python perf/bench_handler.py` runs that
checkout's extproc on the same recordings. Prints only; nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

REPO = os.environ.get("REPO") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.chdir(REPO)
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="bench-handler-"))  # as in a worker

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from google.protobuf import text_format  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from extproc.config.loader import load_file  # noqa: E402
from extproc.metrics import ProcessorMetrics  # noqa: E402
from extproc.stream import ConfigRef, ExtProcService  # noqa: E402

RECORDED = os.path.join("tests", "data", "recorded")
ROUTES = {"passthrough": ("v1-chat-completions", "v1-chat-completions-rec-passthrough.txtpb"),
          "llm": ("v1-analyze", "v1-analyze-rec-llm-ok.txtpb")}


class _Md:
    def __init__(self, key: str, value: str):
        self.key, self.value = key, value


class _Context:
    def __init__(self, route: str):
        self.md = [_Md("x-adapter-route", route), _Md("x-request-id", "rid")]

    def invocation_metadata(self):
        return self.md


def recorded(name: str) -> list:
    with open(os.path.join(RECORDED, name)) as f:
        return [text_format.Parse(c, pb.ProcessingRequest()) for c in f.read().split("# message\n")[1:]]


async def run(svc: ExtProcService, route: str, reqs: list, n: int) -> float:
    async def one() -> None:
        async def source():
            for r in reqs:
                yield r
        async for _ in svc.Process(source(), _Context(route)):
            pass

    for _ in range(200):
        await one()
    t = time.process_time()
    for _ in range(n):
        await one()
    return (time.process_time() - t) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=5000)
    args = ap.parse_args()
    svc = ExtProcService(ConfigRef(load_file(os.path.join(RECORDED, "config.yaml"))),
                         ProcessorMetrics(CollectorRegistry()))
    for name, (route, file) in ROUTES.items():
        us = asyncio.run(run(svc, route, recorded(file), args.streams))
        print(f"{REPO}: {name:11s} {us:6.1f} us of processor CPU per stream (handler only, in process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
