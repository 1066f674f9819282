"""Time to first token through the gateway against direct to the backend, side by side in one run.

What: one OpenAI API *simulator* (decode 50 tokens/s, so generation is slow and the first token is
what matters) and the gateway's `openai` route in front of it (request body buffered, response
STREAMED through the processor). For N sequential streamed chat requests each way, interleaved,
it measures the time from sending the request to receiving the first content chunk (TTFT) and to
the end of the stream, and reports p50/p90/p99 and the added TTFT (gateway - direct).
Why: streaming must not be buffered, and the gateway's share of TTFT is the number operators see.
The backend is a simulator, so this measures the gateway's overhead, not a model.
Usage: .venv/bin/python perf/bench_streaming.py [--requests 100] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import benchenv  # noqa: E402  (perf/ is this script\'s folder, on sys.path)

from extproc.stack import Stack, free_port, free_port_block  # noqa: E402

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: bench-streaming}
spec:
  backends: [{name: llm, kind: vllm, endpoints: ["llm.invalid:8000"], models: [bench-model]}]
  routes: [{path: /v1/, match: prefix, kind: openai, targets: [llm]}]
"""


def one(client: httpx.Client, url: str, tokens: int) -> tuple[float, float]:
    body = {"model": "bench-model", "messages": [{"role": "user", "content": "ttft"}], "max_tokens": tokens,
            "stream": True}
    started = time.perf_counter()
    first = None
    with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - started
    return first or float("nan"), time.perf_counter() - started


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "bench.yaml"
        cfg.write_text(CONFIG)
        stack = Stack(str(cfg), simulate=True, listen_port=free_port(), admin_port=free_port(),
                      processor_base_port=free_port_block(2), processor_admin_port=free_port(), workers=2,
                      simulator_args=("--decode-tokens-per-s", "50"))
        stack.start()
        try:
            port = stack.simulators["llm"][1]
            direct_url = f"http://127.0.0.1:{port}/v1/chat/completions"
            gw_url = f"{stack.url}/v1/chat/completions"
            results: dict[str, list[tuple[float, float]]] = {"direct": [], "gateway": []}
            with httpx.Client(timeout=30) as client:
                for _ in range(5):  # warm-up: connections, caches
                    one(client, direct_url, args.tokens)
                    one(client, gw_url, args.tokens)
                for _ in range(args.requests):
                    results["direct"].append(one(client, direct_url, args.tokens))
                    results["gateway"].append(one(client, gw_url, args.tokens))
        finally:
            stack.stop()
    rows = []
    for name in ("direct", "gateway"):
        ttft = [r[0] for r in results[name]]
        total = [r[1] for r in results[name]]
        rows.append((name, pct(ttft, 50), pct(ttft, 90), pct(ttft, 99), pct(total, 50)))
    added = rows[1][1] - rows[0][1]
    table = ["| path | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | stream p50 ms |", "|---|---:|---:|---:|---:|"]
    table += [f"| {n} | {a:.2f} | {b:.2f} | {c:.2f} | {d:.1f} |" for n, a, b, c, d in rows]
    print("\n".join(table))
    print(f"added TTFT p50 through the gateway: {added:+.2f} ms (target: under 1 ms)")
    if not args.no_write:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        section = [
            f"\n## {now}: bench_streaming (time to first token, gateway vs direct)\n",
            f"- Machine: {benchenv.cpu()}; kernel {platform.release()}; Python {platform.python_version()}",
            f"- Code: git {benchenv.git_revision()}; processor workers: 2; backend: OpenAI API simulator at 50 tokens/s (a simulator, "
            "not a model)",
            f"- Command: `.venv/bin/python perf/bench_streaming.py --requests {args.requests} --tokens {args.tokens}` "
            f"({args.requests} sequential streamed chat requests each way, interleaved, after 5 warm-ups)",
            "",
            *table,
            "",
            f"Added TTFT p50 through the gateway: {added:+.2f} ms (target: under 1 ms). The gateway path costs "
            "two ext_proc round trips before the first byte (request headers, buffered request body) plus one "
            "per response chunk (headers, then each streamed chunk), all on the same 2 cores as the client "
            "and the simulator.",
        ]
        with open(REPO / "perf" / "RESULTS.md", "a") as f:
            f.write("\n".join(section) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
