"""Soak (issue 12 item 6; not in the suite): mixed traffic for `--minutes` (default 30) with reloads
and a worker kill; memory per process at start and end; every failure classified.

What: the reliability topology of tests/e2e/test_reliability.py (built by perf/bench_reliability.py's
`reliability_stack`: two OpenAI API simulators, two echo servers, two processor workers, Envoy 1.40)
under tests/e2e/loadgen.py's load on all its routes (llm over h2c and HTTP/1.1, openai with the
processor's endpoint pick, passthrough in both failure modes; 8 HTTP/2 connections x 4 streams),
plus a reload every `--reload-every` seconds cycling through test_reliability's kinds of change
(routes, endpoints, backends, plugin parameters, timeouts; not the listener), and one `kill -9`
of worker 0 halfway through (the supervisor restarts it).
Memory: RSS (VmRSS) of Envoy, the supervisor (it runs inside this script's process, with the load
generator: that number is both), each worker and each backend, sampled every 10 s; "start" is the
first sample after a 30 s warm-up (10 % of the run if shorter), "end" the last. A restarted worker
is a new process: its start is its first sample after the restart.
Errors: a failure is *expected* only if it is one of the kill's (a 503 `connection_termination` or
gRPC error 13, httpx's LocalProtocolError for such a 503 sent while the body was still being
written, or RemoteProtocolError for an openai stream cut mid-response, within 3 s after the kill, at most the 32 streams in flight); everything else is
unexpected, and the exit status is 1 if there is any, or if a reload was refused.
Writes perf/results/soak.json (`--out PATH` another file) and appends a section to perf/RESULTS.md
(machine, date, revision);
`--note TEXT` is added to that section (e.g. that the machine was shared).
Run: `.venv/bin/python perf/soak.py [--minutes 30] [--reload-every 30] [--note TEXT] [--out PATH] [--no-write]`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import benchenv  # noqa: E402  (perf/ is this script's folder, on sys.path)

sys.path.insert(0, str(benchenv.REPO))

import httpx  # noqa: E402

import bench_reliability as br  # noqa: E402  (its Procs and reliability_stack)
from tests.e2e import test_reliability as rel  # noqa: E402
from tests.e2e.loadgen import Load  # noqa: E402

REPO = benchenv.REPO
OUT = REPO / "perf" / "results" / "soak.json"
KILL_WINDOW = 3.0  # seconds after the kill in which its failures are expected
KILL_BOUND = 32  # streams in flight (8 connections x 4)


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def processes(st, sims, echoes) -> dict[str, int]:
    out = {"envoy": st.envoy_pid, "supervisor+loadgen": os.getpid()}
    for i, w in enumerate(st.supervisor.workers):
        out[f"worker{i}"] = w.pid
    out.update({f"simulator{i}": s.proc.pid for i, s in enumerate(sims)})
    out.update({f"echo{i}": e.proc.pid for i, e in enumerate(echoes)})
    return out


class TimedLoad(Load):
    """loadgen.Load that also keeps when each failure happened (to place it against the kill)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.failures: list[tuple[float, str, int, str]] = []

    def _record(self, req, status, code, text):
        super()._record(req, status, code, text)
        if not 200 <= status < 300:
            with self._lock:
                self.failures.append((time.monotonic(), req.path, status, code))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--reload-every", type=float, default=30.0, help="seconds between reloads")
    ap.add_argument("--note", default="", help="added to the RESULTS.md section")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT, help=f"the JSON written (default {OUT.relative_to(REPO)})")
    args = ap.parse_args(argv)
    br.rel = rel
    seconds = args.minutes * 60
    warmup = min(30.0, seconds / 10)
    started = dt.datetime.now(dt.timezone.utc)
    procs = br.Procs()
    samples: list[dict] = []
    reloads = refused = 0
    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        try:
            st, sims, echoes, cfg, base = br.reliability_stack(Path(d), procs, llm=2)
            spare = rel.Simulator()  # the endpoint the reloads add and remove (base has both sims)
            procs.append(spare.proc)
            changes = rel.reload_changes(10_000, base, spare.id, echoes[1].id,
                                         tuple(k for k in rel.CHANGES if k != "listener changed"))
            t0 = time.monotonic()
            kill_at, killed = t0 + seconds / 2, None
            next_reload, next_sample = t0 + args.reload_every, t0
            with TimedLoad(st.url, rel.STEADY) as load:
                while (now := time.monotonic()) < t0 + seconds:
                    if now >= next_sample:
                        pids = processes(st, sims, echoes)
                        samples.append({"t": round(now - t0, 1), "pids": pids,
                                        "rss_kib": {k: rss_kib(p) for k, p in pids.items()}})
                        next_sample += 10
                    if killed is None and now >= kill_at:
                        os.kill(st.supervisor.workers[0].pid, signal.SIGKILL)
                        killed = time.monotonic()
                        print(f"{now - t0:.0f}s: worker 0 killed", flush=True)
                    if now >= next_reload:
                        _kind, t = changes[reloads % len(changes)]
                        rel.write_config(cfg, t)
                        result = st.reload()
                        reloads += 1
                        refused += not result.accepted or bool(result.errors)
                        next_reload += args.reload_every
                    time.sleep(0.2)
            report = load.report
            restarts = httpx.get(f"{st.processor_admin_url}/config", timeout=5).json()["workers"][0]["restarts"]
            alive = st.envoy.poll() is None
        finally:
            procs.stop()
    # a 503 of the kill; httpx's LocalProtocolError: Envoy answered that 503 and reset the stream while
    # httpx was still sending the body (tests/e2e/loadgen.py); RemoteProtocolError: an openai stream
    # the dead worker had begun, cut mid-response (docs/operations.md, Failure behaviour)
    expected = [f for f in load.failures if killed is not None and killed <= f[0] <= killed + KILL_WINDOW
                and ("connection_termination" in f[3] or "gRPC_error_13" in f[3]
                     or f[3] in ("LocalProtocolError", "RemoteProtocolError"))]
    expected = expected[:KILL_BOUND]
    unexpected = len(load.failures) - len(expected)
    memory = memory_table(samples, warmup)
    doc = {"started": started.isoformat(timespec="seconds"), "minutes": args.minutes, "machine": benchenv.cpu(),
           "revision": benchenv.git_revision(), "requests": report.sent, "failed": report.failed,
           "expected_failures_at_kill": len(expected), "unexpected_failures": unexpected,
           "failures_by_code": [[list(k), v] for k, v in report.by_code.most_common()],
           "reloads": reloads, "reloads_refused": refused, "worker0_restarts": restarts, "envoy_alive": alive,
           "failures": [{"t_after_kill_s": round(f[0] - killed, 3) if killed else None, "path": f[1],
                         "status": f[2], "code": f[3]} for f in load.failures],
           "memory_kib": memory, "samples": samples, "note": args.note}
    print(f"{report.summary()}\nexpected (the kill's): {len(expected)}, unexpected: {unexpected}; "
          f"reloads {reloads} ({refused} refused); worker 0 restarts {restarts}")
    for name, m in memory.items():
        print(f"  {name:20s} {m['start']:>8} KiB -> {m['end']:>8} KiB (max {m['max']})")
    if not args.no_write:
        out = args.out.absolute()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        write_results(doc, args)
    return 0 if unexpected == 0 and refused == 0 and alive else 1


def memory_table(samples: list[dict], warmup: float) -> dict[str, dict]:
    """Per process name: RSS at start (first sample after the warm-up, or after the process began),
    end (last sample) and max, for the pid it has at the end."""
    out = {}
    if not samples:
        return out
    last = samples[-1]
    for name, pid in last["pids"].items():
        mine = [s["rss_kib"][name] for s in samples if s["pids"].get(name) == pid and s["rss_kib"].get(name)]
        first_t = next(s["t"] for s in samples if s["pids"].get(name) == pid)
        after = [s["rss_kib"][name] for s in samples if s["pids"].get(name) == pid and s["t"] >= first_t + warmup
                 and s["rss_kib"].get(name)]
        start = (after or mine or [None])[0]
        out[name] = {"start": start, "end": mine[-1] if mine else None, "max": max(mine) if mine else None,
                     "restarted": first_t > 0}
    return out


def _shown(path: Path) -> str:
    try:
        return str(path.absolute().relative_to(REPO))
    except ValueError:
        return str(path)


def write_results(doc: dict, args: argparse.Namespace) -> None:
    argv = [a for a in sys.argv[1:] if a != "--no-write"]
    if "--note" in argv:  # the note is quoted in the text itself
        i = argv.index("--note")
        argv[i + 1:i + 2] = ["'...'"]
    cmd = "`.venv/bin/python perf/soak.py" + "".join(f" {a}" for a in argv) + "`"
    lines = [f"\n## {doc['started'][:16].replace('T', ' ')} UTC: soak, {args.minutes:g} minutes ({doc['revision']})\n",
             f"- machine: {doc['machine']}; command: {cmd}; traffic: tests/e2e/loadgen.py on the reliability "
             "routes (llm h2c and HTTP/1.1, openai with endpoint picks, passthrough closed and open), 8 HTTP/2 "
             f"connections x 4 streams; a reload every {args.reload_every:g} s; worker 0 SIGKILLed halfway."
             + (f" {doc['note']}" if doc["note"] else ""),
             f"- {doc['requests']} requests, {doc['failed']} failed: {doc['expected_failures_at_kill']} at the kill "
             f"(expected), {doc['unexpected_failures']} unexpected; {doc['reloads']} reloads "
             f"({doc['reloads_refused']} refused); worker 0 restarted {doc['worker0_restarts']}x; Envoy "
             f"{'up' if doc['envoy_alive'] else 'DOWN'} at the end. {_shown(args.out)} has the samples.\n",
             "| process | RSS start (KiB) | RSS end (KiB) | max | change |", "|---|---:|---:|---:|---:|"]
    for name, m in doc["memory_kib"].items():
        change = f"{100 * (m['end'] - m['start']) / m['start']:+.1f} %" if m["start"] and m["end"] else "–"
        label = name + (" (restarted: since its start)" if m["restarted"] else "")
        lines.append(f"| {label} | {m['start']} | {m['end']} | {m['max']} | {change} |")
    benchenv.append_results("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
