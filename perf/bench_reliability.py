"""Benchmark: failed requests through worker crashes, backend connection churn and reloads (not a test).

What: the scenarios of tests/e2e/test_reliability.py at full size, each on a fresh stack (real
Envoy, two processor workers, simulators), load from tests/e2e/loadgen.py (8 HTTP/2 connections x 4
streams, like `h2load -c 8 -m 4`):
  issue      the issue's reproduction: examples/finance-llm-adapter.yaml with `--simulate` (our ONNX
             Runtime server, the OpenAI API simulator), `POST /v1/fraud-score` for `--seconds`,
             `kill -9` of worker 0 a quarter of the way in;
  worker     the same kill on the reliability topology (llm, openai with endpoint picks,
             passthrough closed and open), once per variant of the processor's failure settings:
             shipped (stream retry policy + outlier ejection), retry only, outlier only, neither
             (what each contributes; `--variants` to choose);
  endpoint   one of the LLM backend's two simulators SIGKILLed a quarter of the way in; then, on a
             fresh stack, one stopped with SIGTERM (hypercorn's graceful stop: GOAWAY);
  churn      `--seconds` of load on the LLM routes (h2c: connections retired at max requests), then
             3 bursts each followed by 5.2 s idle (the backends' keep-alive is 5 s);
  reloads    `--reloads` reloads under HTTP/2 load cycling through every kind of change but the
             listener (routes added, changed, removed; backends and endpoints added and removed;
             plugin parameters; timeouts), then a fifth as many listener changes (Envoy drains the
             client connections) under HTTP/1.1 load and h2load.
Reports requests, failures by route, status and Envoy's response code details and flags (the
`code` and `flags` of Envoy's JSON error: this script adds `%RESPONSE_FLAGS%` to it), and the
Envoy counters that show which mechanism acted (retries, ejections, connections retired).
Prints a table and, unless --no-write, appends a dated section to perf/RESULTS.md.
With `--before REV` the issue's reproduction also runs on revision REV (a temporary `git worktree`:
its code, this tree's load generator), for before/after numbers. h2load is used for the issue's
reproduction and the listener reloads when installed (`make setup`), as in the issue.
Run: `.venv/bin/python perf/bench_reliability.py [--seconds 12] [--reloads 100] [--scenarios issue,worker,...]
[--variants shipped,neither] [--before 8e23138] [--no-write]`. Everything it starts is stopped by its handle on exit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
# --before runs the issue's reproduction in a worktree of another revision: its code, our load tools
TREE = Path(os.environ.get("BENCH_RELIABILITY_TREE") or REPO)
sys.path.insert(0, str(TREE))

import benchenv  # noqa: E402  (perf/ is this script's folder, on sys.path)

import httpx  # noqa: E402

from extproc import envoy_render, xds  # noqa: E402
from extproc.stack import stop_process  # noqa: E402
from tests.e2e.conftest import make_stack  # noqa: E402
from tests.e2e.loadgen import H2LOAD, H2load, Load, Report, Req  # noqa: E402

RESULTS = REPO / "perf" / "RESULTS.md"
FRAUD = Req("POST", "/v1/fraud-score", b'{"features": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]}')
SCENARIOS = ("issue", "worker", "endpoint", "churn", "reloads")
VARIANTS = ("shipped", "retry-only", "outlier-only", "neither")
COUNTERS = ("cluster.adapter_processor.upstream_rq_retry", "cluster.adapter_processor.upstream_rq_retry_success",
            "cluster.adapter_processor.outlier_detection.ejections_enforced_total",
            "cluster.adapter_processor.health_check.failure", "cluster.llm.upstream_rq_retry",
            "cluster.llm.upstream_rq_retry_success", "cluster.llm.outlier_detection.ejections_enforced_total",
            "cluster.llm.upstream_rq_retry_overflow", "cluster.adapter_processor.upstream_rq_retry_overflow", "cluster.llm.upstream_cx_max_requests",
            "cluster.llm.upstream_cx_idle_timeout", "cluster.llm.upstream_cx_destroy_remote_with_active_rq",
            "cluster.echo.upstream_cx_idle_timeout", "cluster.ort.upstream_cx_idle_timeout",
            "cluster.llm-h1.upstream_cx_idle_timeout", "cluster.llm-h1.upstream_rq_retry")


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The processor's failure settings as shipped, or with the stream retry policy and/or the
    outlier ejection taken out (monkeypatched renderer functions; restored on exit). Envoy's JSON
    errors also carry `flags` (%RESPONSE_FLAGS%) for the report."""
    saved: dict[tuple[Any, str], Any] = {}

    def patch(mod: Any, attr: str, value: Any) -> None:
        saved[(mod, attr)] = getattr(mod, attr)
        setattr(mod, attr, value)

    plain_reply = envoy_render._local_reply_config

    def reply_with_flags() -> dict[str, Any]:
        doc = plain_reply()
        doc["body_format"]["json_format"]["error"]["flags"] = "%RESPONSE_FLAGS%"
        return doc

    patch(envoy_render, "_local_reply_config", reply_with_flags)
    if name in ("outlier-only", "neither"):
        patch(envoy_render, "processor_retry_policy", lambda: {"num_retries": 0})
    if name in ("retry-only", "neither"):
        plain_cluster = envoy_render.processor_cluster

        def without_outlier(snap: Any, workers: int) -> dict[str, Any]:
            c = plain_cluster(snap, workers)
            c.pop("outlier_detection", None)
            return c

        patch(xds, "processor_cluster", without_outlier)
        patch(envoy_render, "processor_cluster", without_outlier)
    try:
        yield
    finally:
        for (mod, attr), value in saved.items():
            setattr(mod, attr, value)


class Procs(list):
    """Processes started here, and stacks (stopped first)."""

    def __init__(self) -> None:
        super().__init__()
        self.stacks: list[Any] = []

    def stop(self) -> None:
        for st in reversed(self.stacks):
            st.stop()
        self.stacks.clear()
        for p in reversed(self):
            stop_process(p)
        self.clear()


rel: Any = None  # tests.e2e.test_reliability, imported when a scenario needs it (not in --child-issue)


def stats_of(st: Any) -> dict[str, float]:
    s = rel.envoy_stats(st)
    return {k: s.get(k, 0) for k in COUNTERS if k in s}


def issue_run(seconds: float) -> tuple[Report, dict[str, float], str]:
    """The issue's reproduction: `make run`'s config with simulated backends, two workers,
    h2load -c 8 -m 4 (tests/e2e/loadgen.Load of the same shape without h2load) on /v1/fraud-score,
    kill -9 of worker 0 a quarter of the way in. Uses only what every revision's stack has."""
    import os as _os

    st = make_stack(str(TREE / "examples" / "finance-llm-adapter.yaml"), workers=2, simulate=True).start()
    try:
        pid = st.supervisor.workers[0].pid
        if H2LOAD is not None:
            load = H2load(st.url, FRAUD, seconds).start()
            time.sleep(seconds / 4)
            _os.kill(pid, signal.SIGKILL)
            report = load.wait()
            tool = "h2load -c 8 -m 4"
        else:
            with Load(st.url, [FRAUD]) as lg:
                time.sleep(seconds / 4)
                _os.kill(pid, signal.SIGKILL)
                time.sleep(seconds * 3 / 4)
            report, tool = lg.report, "loadgen 8x4"
        stats = {}
        try:
            raw = httpx.get(f"{st.admin_url}/stats", params={"format": "json"}, timeout=5).json()["stats"]
            stats = {x["name"]: x["value"] for x in raw if x.get("name") in COUNTERS}
        except httpx.HTTPError:
            pass
        return report, stats, f"finance-llm-adapter.yaml, POST /v1/fraud-score (tensor, ONNX Runtime), {tool}"
    finally:
        st.stop()


def issue_before(rev: str, seconds: float) -> tuple[Report, dict[str, float], str]:
    """issue_run in a `git worktree` of `rev` (its extproc, backends and examples; this tree's
    tests/e2e/loadgen.py copied in), as a child process; the worktree is removed after."""
    d = tempfile.mkdtemp(prefix="bench-reliability-before-")
    try:
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", d, rev], check=True)
        shutil.copy(REPO / "tests" / "e2e" / "loadgen.py", Path(d) / "tests" / "e2e" / "loadgen.py")
        from extproc.envoy_bin import find_envoy
        env = dict(os.environ, BENCH_RELIABILITY_TREE=d, PYTHONPATH=d, ADAPTER_ENVOY_BIN=find_envoy())
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child-issue", "--seconds", str(seconds)],
                             cwd=d, env=env, capture_output=True, text=True, timeout=seconds + 180)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not line:
            raise RuntimeError(f"before run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        doc = json.loads(line[-1])
        r = Report(sent=doc["sent"], by_status=collections.Counter({int(k): v for k, v in doc["by_status"].items()}),
                   by_code=collections.Counter({tuple(k): v for k, v in doc["by_code"]}), samples=doc["samples"],
                   seconds=doc["seconds"])
        rev_short = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True,
                                   text=True).stdout.strip()
        return r, doc["stats"], doc["what"] + f"; before: {rev_short}"
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", d], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


def reliability_stack(tmp: Path, procs: Procs, llm: int = 2) -> tuple[Any, list, list, Path, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    sims = [rel.Simulator() for _ in range(llm)]
    procs.extend(s.proc for s in sims)
    echoes = [rel.Echo() for _ in range(2)]
    procs.extend(e.proc for e in echoes)
    base = rel.Topology([s.id for s in sims[:1 if llm == 1 else 2]], [echoes[0].id])
    cfg = rel.write_config(tmp / "gw.yaml", base)
    st = make_stack(str(cfg), workers=2, run_dir=str(tmp / "run")).start()
    procs.stacks.append(st)
    for req in rel.STEADY:
        r = httpx.request(req.method, st.url + req.path, content=req.body, timeout=10)
        assert r.status_code == 200, (req.path, r.status_code, r.text)
    return st, sims, echoes, cfg, base


def scenario(name: str, args: argparse.Namespace, tmp: Path, procs: Procs) -> list[tuple[str, Report, dict, str]]:
    out = []
    global rel
    from tests.e2e import test_reliability as rel
    if name == "issue":
        if args.before:
            report, stats, what = issue_before(args.before, args.seconds)
            out.append(("issue: worker SIGKILL, before", report, stats, what))
        with variant("shipped"):
            report, stats, what = issue_run(args.seconds)
        out.append(("issue: worker SIGKILL", report, stats, what))
    elif name == "worker":
        for v in args.variants:
            with variant(v):
                st, *_ = reliability_stack(tmp / v, procs)
                report, _ = rel.worker_kill(st, args.seconds, args.seconds / 4)
                out.append((f"worker SIGKILL ({v})", report, stats_of(st), "4 routes: llm, openai+pick, passthrough closed, open"))
                procs.stop()
    elif name == "endpoint":
        with variant("shipped"):
            st, sims, *_ = reliability_stack(tmp / "endpoint", procs)
            report = rel.endpoint_kill(st, sims[0].proc, args.seconds, args.seconds / 4)
            out.append(("backend endpoint SIGKILL", report, stats_of(st), "llm backend: 2 simulators (h2c), one killed"))
            procs.stop()
            st, sims, *_ = reliability_stack(tmp / "endpoint-term", procs)
            report = rel.endpoint_kill(st, sims[0].proc, args.seconds, args.seconds / 4, sig=signal.SIGTERM)
            out.append(("backend endpoint SIGTERM", report, stats_of(st),
                        "llm backend: 2 simulators (h2c), one stopped gracefully (reset streams, GOAWAY)"))
            procs.stop()
    elif name == "churn":
        with variant("shipped"):
            st, *_ = reliability_stack(tmp / "churn", procs, llm=1)
            report = rel.connection_churn(st, args.seconds, 3, busy_requests=[rel.STEADY[0], rel.STEADY[1], rel.STEADY[4]])
            out.append(("connection churn", report, stats_of(st), f"{args.seconds:g} s load on h2c, then 3 x 5.2 s idle"))
            procs.stop()
    elif name == "reloads":
        with variant("shipped"):
            st, sims, echoes, cfg, base = reliability_stack(tmp / "reloads", procs)
            base = rel.Topology([sims[0].id], [echoes[0].id])
            rel.write_config(cfg, base)
            assert st.reload().accepted
            kinds = tuple(k for k in rel.CHANGES if k != "listener changed")
            changes = rel.reload_changes(args.reloads, base, sims[1].id, echoes[1].id, kinds)
            started = time.monotonic()
            report, problems, _ = rel.reloads(st, cfg, changes)
            what = f"{args.reloads} reloads in {time.monotonic() - started:.1f} s: {', '.join(kinds)}" + (
                f"; {len(problems)} not clean: {problems[:3]}" if problems else "")
            out.append(("reloads under load (HTTP/2)", report, stats_of(st), what))
            n = max(1, args.reloads // 5)
            changes = rel.reload_changes(n, base, sims[1].id, echoes[1].id, ("listener changed",))
            report, problems, h2 = rel.reloads(st, cfg, changes, http2=False,
                                               h2load=rel.STEADY[1] if H2LOAD is not None else None)
            what = f"{n} listener changes (connections drained)" + (
                f"; {len(problems)} not clean: {problems[:3]}" if problems else "")
            out.append(("listener reloads (HTTP/1.1 loadgen)", report, stats_of(st), what))
            if h2 is not None:
                out.append(("listener reloads (h2load -c 8 -m 4)", h2, {}, what + ", POST /v1/chat/completions"))
            procs.stop()
    return out


def fmt_failures(r: Report) -> str:
    if not r.by_code:
        return "–"
    return "; ".join(f"{p} {s} `{c}`: {n}" for (p, s, c), n in r.by_code.most_common(5))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--reloads", type=int, default=100)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--before", metavar="REV", help="also run the issue's reproduction on REV (a git worktree)")
    ap.add_argument("--no-write", action="store_true", help="do not append to perf/RESULTS.md")
    ap.add_argument("--child-issue", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_issue:  # issue_before's child, in the other revision's tree: one JSON line
        r, stats, what = issue_run(args.seconds)
        print(json.dumps({"sent": r.sent, "by_status": r.by_status, "by_code": [[list(k), v] for k, v in r.by_code.items()],
                          "samples": r.samples, "seconds": r.seconds, "stats": stats, "what": what}))
        return 0
    args.variants = [v for v in args.variants.split(",") if v]
    assert set(args.variants) <= set(VARIANTS), args.variants
    started = dt.datetime.now(dt.timezone.utc)
    rows = []
    procs = Procs()
    with tempfile.TemporaryDirectory(prefix="bench-reliability-") as d:
        try:
            for name in args.scenarios.split(","):
                for row in scenario(name, args, Path(d) / name, procs):
                    rows.append(row)
                    title, report, stats, what = row
                    print(f"{title}: {report.summary()}\n  {what}\n  {stats}", flush=True)
        finally:
            procs.stop()
    if not args.no_write:
        write(rows, args, started)
        print(f"\nappended to {RESULTS.relative_to(REPO)}")
    return 0


def write(rows: list, args: argparse.Namespace, started: dt.datetime) -> None:
    cmd = "`.venv/bin/python perf/bench_reliability.py" + "".join(
        f" {a}" for a in sys.argv[1:] if a != "--no-write") + "`"
    lines = [f"\n## {started:%Y-%m-%d %H:%M} UTC: bench_reliability ({benchenv.git_revision()})\n",
             f"- machine: {benchenv.cpu()}; command: {cmd}; load: tests/e2e/loadgen.py, 8 HTTP/2 connections x 4 "
             "streams (`h2load -c 8 -m 4`'s shape), two processor workers, Envoy 1.40.\n",
             "| scenario | what | requests | failed | failures (route status `code [flags]`: n) | Envoy counters |",
             "|---|---|---:|---:|---|---|"]
    for title, r, stats, what in rows:
        counters = ", ".join(f"{k.replace('cluster.', '')} {v:g}" for k, v in stats.items() if v)
        lines.append(f"| {title} | {what} | {r.sent} | {r.failed} | {fmt_failures(r)} | {counters or '–'} |")
    with RESULTS.open("a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
