"""Benchmark: operator promotions, rollbacks and adapter bundle loads under load, through the real Envoy (not a test).

What (issue 11 item 6's last goal: "100 promotions, rollbacks and bundle loads under load with 0 failed
requests"): one stack the e2e tests' way (`tests.e2e.conftest.make_stack`: the real Envoy, 2 processor
workers, and **OpenAI API simulators** `backends/simulator_openai.py` as the backends: simulators, not
models) on a config written here:
  route `chat`  (openai, POST /v1/chat/completions) under rollout `ro`, arms `stable` / `canary` on two
                simulators, keyed on the trusted header `x-user-id`, with a `plan:` (steps 10 -> 50 -> 100 %;
                minSamples and dwell out of reach and the judge on errors only, so nothing but the
                operator moves it: every weight change below is one of ours);
  route `summarize` (llm, POST /summarize) whose transform comes from the adapter bundle `summ`
                (`spec.bundles: [{name: summ}]`, loaded at run time; the file's own transform says `v: file`).
A closed-loop load (tests/e2e/loadgen.py's `Load`, here recording every request: `--clients` HTTP/1.1
connections, one request in flight each, default 12) runs for the whole run, each connection cycling
through: chat keyed non-streamed, chat keyed streamed (`stream: true`, SSE read to `[DONE]`), chat
keyless, summarize keyed. Meanwhile `--ops N` rounds (default 100) of, each waited for until live:
  promote   POST /canary/ro/promote   (10 -> 50 %)   the supervisor's admin endpoint `adapterctl canary` calls;
  rollback  POST /canary/ro/rollback  (50 -> 0 %)    answered after the republish: every worker acknowledged
  resume    POST /canary/ro/resume    (0 -> 10 %)    the generation and Envoy's xDS stats show it; then
            (a rolled-back plan must be resumed        GET /canary/ro must say `live` at the expected weight;
             before it can be promoted again)
  bundle    POST /bundles (a ZIP)                    `adapterctl bundle load`: verified, preloaded in the
            summ@1 (`v: b1`) and summ@2 (`v: b2`)     sandbox, published; its answer must be accepted with
            alternating, so each load changes          every worker on the new generation, and GET /bundles
            the mapping (summ@1 first: file -> b1)     must name it active for `summarize`
with `--pause` seconds (default 0.2) between ops.
Counted: requests sent, responses by status, failures (any non-2xx, a connection error, a streamed answer
without `[DONE]`), openai responses without `x-adapter-variant`, and responses inconsistent with the
state at the time they were sent: a keyed chat answer whose arm is not the one `canary.assign` gives its
key at any weight that was live (or being applied) between its send and its answer, a summarize answer
whose `v` is not a mapping live in that span. Ops attempted / succeeded, each op's wall time (p50, p95,
max). Envoy's processor-cluster retries and the processor's config_mismatch counter at the end.
Envoy's local replies carry %RESPONSE_FLAGS% (bench_reliability's patch) so a failure says why.

Run: `.venv/bin/python perf/bench_canary_ops.py [--ops 100] [--clients 12] [--pause 0.2] [--quick]
[--out FILE] [--no-write]`. `--quick`: 5 rounds. Writes perf/results/canary_ops.json (`--out` elsewhere)
and appends a section to perf/RESULTS.md; `--no-write`: neither, but an explicit `--out` is written.
Exit code 0 when every op applied and no request failed, else 1. Everything it starts (the stack: Envoy,
supervisor, workers, simulators) is stopped by its process handle on exit, Ctrl-C or SIGTERM.
Cost: about 4 s to start; a round is 3 republishes (a config compile, 2 worker acks, Envoy's xDS ack)
and a bundle load (a sandboxed preload of about 1.5 s plus a republish): 4 to 8 s per round on this
shared 2-core machine, so `--ops 100` takes 8 to 15 minutes; the load takes a large share of the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime as dt
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchenv  # noqa: E402  (perf/ is this script's folder, on sys.path)

import httpx  # noqa: E402

from canary.assign import arm_at, bucket  # noqa: E402
from tests.canary.adapter_bundles import make_bundle  # noqa: E402
from tests.e2e.conftest import make_stack  # noqa: E402
from tests.e2e.loadgen import Load, Req  # noqa: E402

RESULTS_JSON = REPO / "perf" / "results" / "canary_ops.json"
ROLLOUT, ARM = "ro", "canary"
STEPS = [10, 50, 100]
PLAN = {"steps": STEPS, "minSamples": 100_000_000, "dwell": "24h", "interval": "1s",
        "judge": {"metrics": ["error"]}}
KEYS = 200  # distinct x-user-id values the keyed requests cycle through
TAGS = {"1": "b1", "2": "b2"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
KINDS = ("chat", "chat-stream", "chat-keyless", "summarize")


def write_config(tmp: Path) -> Path:
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "bench-canary-ops"},
        "spec": {
            "processor": {"stateDir": "state"},
            "backends": [{"name": n, "models": ["m"], "endpoints": [f"{n}:8000"]} for n in ("gpt-stable", "gpt-canary")],
            "routes": [
                {"path": "/v1/chat/completions", "kind": "openai", "name": "chat",
                 "targets": ["gpt-stable", "gpt-canary"]},
                {"path": "/summarize", "name": "summarize", "kind": "llm", "target": "gpt-stable",
                 "transform": '{"summary": $.output.text, "v": "file"}'},
            ],
            "bundles": [{"name": "summ"}],
            "rollouts": [{"name": ROLLOUT, "route": "chat",
                          "arms": [{"name": "stable", "backend": "gpt-stable"},
                                   {"name": ARM, "backend": "gpt-canary", "weight": STEPS[0]}],
                          "key": {"sources": [{"header": "x-user-id"}], "trustedHeaders": ["x-user-id"]},
                          "plan": PLAN}],
        },
    }
    path = tmp / "gw.yaml"
    path.write_text(json.dumps(doc, indent=1))
    return path


# ---------------------------------------------------------------------------------------------- load

class RecordingLoad(Load):
    """loadgen.Load on HTTP/1.1, one request in flight per connection, cycling through KINDS; every
    request recorded as (kind, t_sent, t_answered, key, status, variant, v, ok) for the checks."""

    def __init__(self, url: str, clients: int, timeout: float = 20.0):
        super().__init__(url, [Req("POST", "/v1/chat/completions")], connections=clients, streams=1, http2=False,
                         timeout=timeout)
        self.records: list[tuple] = []

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        n = i
        while not self._stop.is_set():
            kind = KINDS[n % len(KINDS)]
            key = f"u{(n * 7919) % KEYS}" if kind != "chat-keyless" else None
            n += 1
            headers = {"content-type": "application/json"}
            if key is not None:
                headers["x-user-id"] = key
            if kind == "summarize":
                path, body = "/summarize", {"query": "hello"}
            else:
                path, body = "/v1/chat/completions", dict(CHAT, stream=True) if kind == "chat-stream" else CHAT
            req = Req("POST", path)
            t0 = time.monotonic()
            try:
                r = await client.post(self.url + path, json=body, headers=headers)
            except httpx.HTTPError as e:
                t1 = time.monotonic()
                self._record(req, 0, type(e).__name__, repr(e))
                self.records.append((kind, t0, t1, key, 0, None, None, False))
                continue
            t1 = time.monotonic()
            variant, v, ok = r.headers.get("x-adapter-variant"), None, 200 <= r.status_code < 300
            code, problem = "", ""
            if ok and kind == "summarize":
                try:
                    v = r.json().get("v")
                except ValueError:
                    ok, problem = False, "not JSON"
            elif ok and kind == "chat-stream" and "data: [DONE]" not in r.text:
                ok, problem = False, "stream without [DONE]"
            if ok:
                self._record(req, 200, "", "")
            else:
                try:
                    err = r.json().get("error")
                    code = str(err.get("code") if isinstance(err, dict) else err or "")[:120]
                    if isinstance(err, dict) and err.get("flags") not in (None, "", "-"):
                        code += f" [{err['flags']}]"
                except (ValueError, AttributeError):
                    code = problem or r.text[:80]
                self._record(req, r.status_code if not 200 <= r.status_code < 300 else 598, code or problem,
                             f"{kind}: {r.text}")
            self.records.append((kind, t0, t1, key, r.status_code, variant, v, ok))


# ----------------------------------------------------------------------------------------------- ops

class Ops:
    """The operator side: actions on the admin port, each waited for until live, timed."""

    def __init__(self, st: Any, bundles: dict[str, Path]):
        self.st, self.admin = st, st.processor_admin_url
        self.bundles = {v: p.read_bytes() for v, p in bundles.items()}
        self.client = httpx.Client(timeout=120)
        self.log: list[dict] = []  # per op: kind, t_start, t_end, ok, ms, detail, state after
        self.weight = None
        self.tag = "file"

    def _status(self) -> dict:
        doc = self.client.get(f"{self.admin}/canary/{ROLLOUT}").json()
        return doc.get("rollouts", doc).get(ROLLOUT, doc)

    def _done(self, kind: str, t0: float, ok: bool, detail: str, state: tuple) -> bool:
        t1 = time.monotonic()
        self.log.append({"kind": kind, "t_start": t0, "t_end": t1, "ok": ok, "ms": round(1000 * (t1 - t0), 1),
                         "detail": detail, "state": state})
        if not ok:
            print(f"  op {kind} FAILED: {detail}", flush=True)
        return ok

    def canary(self, action: str, want_bp: int, want_status: str) -> bool:
        t0 = time.monotonic()
        try:
            r = self.client.post(f"{self.admin}/canary/{ROLLOUT}/{action}", json={"reason": "bench_canary_ops"})
            doc = r.json()
            if r.status_code != 200 or not doc.get("applied"):
                return self._done(action, t0, False, f"{r.status_code} {json.dumps(doc)[:400]}", (self.weight, self.tag))
            deadline = time.monotonic() + 30
            while True:  # the answer came after the republish; the status must agree
                s = self._status()
                w = s["arms"][ARM]["weight_bp"]
                if s["live"] and w == want_bp and s["plan"]["status"] == want_status:
                    break
                if time.monotonic() > deadline:
                    return self._done(action, t0, False, f"not live: weight {w}, status {s['plan']['status']}, "
                                      f"live {s['live']}, apply_error {s.get('apply_error')}", (self.weight, self.tag))
                time.sleep(0.05)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return self._done(action, t0, False, repr(e), (self.weight, self.tag))
        self.weight = want_bp
        return self._done(action, t0, True, f"generation {doc['reload']['generation']}", (self.weight, self.tag))

    def bundle(self, version: str) -> bool:
        t0 = time.monotonic()
        ref = f"summ@{version}"
        try:
            r = self.client.post(f"{self.admin}/bundles", content=self.bundles[version],
                                 headers={"content-type": "application/zip"})
            doc = r.json()
            gen = doc.get("generation")
            workers = (doc.get("reload") or {}).get("workers", {})
            if r.status_code != 200 or not doc.get("accepted") or set(workers.values()) != {gen} \
                    or len(workers) != len(self.st.supervisor.workers) or (doc.get("reload") or {}).get("errors"):
                return self._done("bundle", t0, False, f"{r.status_code} {json.dumps(doc)[:600]}", (self.weight, self.tag))
            b = self.client.get(f"{self.admin}/bundles").json()
            if b["routes"].get("summarize") != ref or b["generation"] != gen:
                return self._done("bundle", t0, False, f"GET /bundles: {json.dumps(b)[:400]}", (self.weight, self.tag))
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return self._done("bundle", t0, False, repr(e), (self.weight, self.tag))
        self.tag = TAGS[version]
        return self._done("bundle", t0, True, f"{ref} generation {gen}", (self.weight, self.tag))

    def close(self) -> None:
        self.client.close()


# -------------------------------------------------------------------------------------------- checks

def check(records: list[tuple], ops_log: list[dict], start_state: tuple, salt: str, rollout: Any) -> dict:
    """Every answered request against the states that were live (or being applied) while it was in
    flight: state k (after op k-1) may serve from op k-1's start until op k's end."""
    states = [start_state] + [o["state"] for o in ops_log]
    starts = [o["t_start"] for o in ops_log]
    ends = [o["t_end"] for o in ops_log]
    arm_cache: dict[tuple[str, int], str] = {}

    def arm(key: str, bp: int) -> str:
        k = (key, bp)
        if k not in arm_cache:
            arm_cache[k] = arm_at(rollout.with_weight(ARM, bp), bucket(salt, key))
        return arm_cache[k]

    out = Counter()
    samples: list[str] = []
    for kind, t0, t1, key, status, variant, v, ok in records:
        out[f"{kind}_sent"] += 1
        if not ok:
            continue
        # states overlapping [t0, t1]: k from (ops ending before t0) to (ops starting before t1)
        lo = bisect.bisect_left(ends, t0)  # ops 0..lo-1 ended before t0: state lo is the earliest possible
        hi = bisect.bisect_right(starts, t1)  # ops 0..hi-1 started before t1: state hi the latest
        allowed = states[lo:hi + 1]
        if kind.startswith("chat"):
            out[f"variant {variant}"] += 1
            if not variant:
                out["missing_variant"] += 1
                if len(samples) < 10:
                    samples.append(f"{kind} {key}: no x-adapter-variant")
                continue
            if key is not None:
                want = {f"{ROLLOUT}/{arm(key, w)}" for w, _ in allowed if w is not None}
                if want and variant not in want:
                    out["wrong_arm"] += 1
                    if len(samples) < 10:
                        samples.append(f"{kind} {key}: {variant}, expected {sorted(want)} "
                                       f"(states {allowed}, at +{t0 - (ends[lo - 1] if lo else t0):.3f}s)")
            elif variant not in (f"{ROLLOUT}/stable", f"{ROLLOUT}/{ARM}"):
                out["wrong_arm"] += 1
        else:
            out[f"v {v}"] += 1
            want = {tag for _, tag in allowed}
            if v not in want:
                out["wrong_mapping"] += 1
                if len(samples) < 10:
                    samples.append(f"summarize: v {v!r}, expected {sorted(want)} (states {allowed})")
        out["checked"] += 1
    return {"counts": dict(out), "samples": samples}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))], 1)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# ---------------------------------------------------------------------------------------------- run

def run(args: argparse.Namespace) -> dict:
    from bench_reliability import variant  # Envoy's local replies with %RESPONSE_FLAGS%

    tmp = Path(tempfile.mkdtemp(prefix="bench-canary-ops-"))
    cfg = write_config(tmp)
    bundles = {"1": make_bundle(tmp, "1", tag=TAGS["1"]), "2": make_bundle(tmp, "2", tag=TAGS["2"])}
    t_begin = time.monotonic()
    la_start = loadavg()
    st = make_stack(cfg, workers=2, simulate=True, run_dir=str(tmp / "run"))
    load = ops = None
    stats: dict[str, Any] = {}
    with variant("shipped"):
        try:
            st.start()
            print(f"stack up in {time.monotonic() - t_begin:.1f}s: Envoy pid {st.envoy_pid}, workers "
                  f"{st.supervisor.pids}, simulators {[p.pid for p, _ in st.simulators.values()]} "
                  f"(OpenAI API simulators, not models)", flush=True)
            ops = Ops(st, bundles)
            s0 = ops._status()
            ops.weight = s0["arms"][ARM]["weight_bp"]
            start_state = (ops.weight, ops.tag)
            ref = st.supervisor.snapshot.rollouts[ROLLOUT].rollout
            salt = ref.hash_salt
            retries0 = envoy_counter(st, "cluster.adapter_processor.upstream_rq_retry")
            load = RecordingLoad(st.url, args.clients).start()
            time.sleep(args.warmup)
            for i in range(args.ops):
                version = "1" if i % 2 == 0 else "2"
                for name, step in (("promote", lambda: ops.canary("promote", STEPS[1] * 100, "running")),
                                   ("rollback", lambda: ops.canary("rollback", 0, "rolled_back")),
                                   ("resume", lambda: ops.canary("resume", STEPS[0] * 100, "running")),
                                   ("bundle", lambda: ops.bundle(version))):
                    step()
                    time.sleep(args.pause)
                if (i + 1) % max(1, args.ops // 10) == 0 or i + 1 == args.ops:
                    r = load.report
                    print(f"round {i + 1}/{args.ops}: {r.sent} requests, {r.failed} failed; ops "
                          f"{sum(o['ok'] for o in ops.log)}/{len(ops.log)} ok ({time.monotonic() - t_begin:.0f}s)",
                          flush=True)
            time.sleep(args.warmup)
        finally:
            if load is not None:
                load.stop()
            try:
                if st.snapshot is not None and st.envoy is not None:
                    stats["envoy_processor_retries"] = envoy_counter(
                        st, "cluster.adapter_processor.upstream_rq_retry") - (retries0 if load else 0)
                    stats["config_mismatch"] = mismatch_total(st)
                    stats["last_events_by"] = Counter(e.get("by") for e in ops._status().get("events", [])) \
                        if ops else {}
            except Exception as e:  # noqa: BLE001 - reported, the run's numbers stand
                stats["error"] = repr(e)
            if ops is not None:
                ops.close()
            st.stop()
    report = load.report
    checks = check(load.records, ops.log, start_state, salt, ref)
    by_kind: dict[str, dict] = {}
    for kind in ("promote", "rollback", "resume", "bundle"):
        done = [o for o in ops.log if o["kind"] == kind]
        ms = [o["ms"] for o in done if o["ok"]]
        by_kind[kind] = {"attempted": len(done), "succeeded": len(ms), "p50_ms": pct(ms, 0.5),
                         "p95_ms": pct(ms, 0.95), "max_ms": max(ms) if ms else None}
    c = checks["counts"]
    failed_ops = [{k: o[k] for k in ("kind", "ms", "detail")} for o in ops.log if not o["ok"]]
    doc = {
        "schema": 1, "bench": "bench_canary_ops", "simulated": True,
        "note": ("backends are OpenAI API simulators (backends/simulator_openai.py), not models; the real Envoy "
                 "and 2 real processor workers"),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": benchenv.cpu(), "git": benchenv.git_revision(), "python": platform.python_version(),
        "command": " ".join(["perf/bench_canary_ops.py", *args.argv]),
        "elapsed_s": round(time.monotonic() - t_begin, 1), "loadavg_start": la_start, "loadavg_end": loadavg(),
        "settings": {"ops": args.ops, "clients": args.clients, "pause_s": args.pause, "workers": 2,
                     "plan_steps_percent": STEPS, "keys": KEYS, "kinds": list(KINDS)},
        "requests": {"sent": report.sent, "ok": report.ok, "failed": report.failed,
                     "seconds": round(report.seconds, 1),
                     "by_status": {str(k): v for k, v in sorted(report.by_status.items())},
                     "failures": [{"path": p, "status": s, "code": code, "n": n}
                                  for (p, s, code), n in report.by_code.most_common()],
                     "failure_samples": report.samples,
                     "by_kind": {k: c.get(f"{k}_sent", 0) for k in KINDS},
                     "checked": c.get("checked", 0), "missing_variant": c.get("missing_variant", 0),
                     "wrong_arm": c.get("wrong_arm", 0), "wrong_mapping": c.get("wrong_mapping", 0),
                     "variants_seen": {k[8:]: n for k, n in sorted(c.items()) if k.startswith("variant ")},
                     "mappings_seen": {k[2:]: n for k, n in sorted(c.items()) if k.startswith("v ")},
                     "check_samples": checks["samples"]},
        "ops": by_kind, "failed_ops": failed_ops, "stats": stats,
    }
    doc["ok"] = (report.failed == 0 and not failed_ops and report.sent > 0
                 and all(v["succeeded"] == args.ops for v in by_kind.values())
                 and not (c.get("missing_variant") or c.get("wrong_arm") or c.get("wrong_mapping")))
    return doc


def envoy_counter(st: Any, name: str) -> float:
    r = httpx.get(f"{st.admin_url}/stats", params={"filter": f"^{name}$"}, timeout=5)
    for line in r.text.splitlines():
        k, _, v = line.partition(": ")
        if k == name:
            return float(v)
    return 0.0


def mismatch_total(st: Any) -> float:
    from tests.promtext import scrape

    return scrape(f"{st.processor_admin_url}/metrics").total("adapter_processor_config_mismatch_total")


def results_text(doc: dict) -> str:
    r, o = doc["requests"], doc["ops"]
    statuses = ", ".join(f"{k}: {v:,}" for k, v in r["by_status"].items())
    rows = "\n".join(
        f"| {k} | {v['attempted']} | {v['succeeded']} | {v['p50_ms']} | {v['p95_ms']} | {v['max_ms']} |"
        for k, v in o.items())
    fails = "; ".join(f"{f['path']} {f['status']} {f['code']}: {f['n']}" for f in r["failures"][:6]) or "none"
    return f"""
## {doc['date']}: promotions, rollbacks and bundle loads under load through Envoy (perf/bench_canary_ops.py)

- machine: {doc['machine']}; Python {doc['python']}; code {doc['git']}; load average at start {doc['loadavg_start']}, at end {doc['loadavg_end']}
- command: `.venv/bin/python {doc['command']}` ({doc['elapsed_s']} s)
- the real Envoy and 2 processor workers; **the backends are OpenAI API simulators** (not models); {doc['settings']['clients']} HTTP/1.1 clients, one request in flight each, cycling chat keyed / chat keyed streamed / chat keyless / summarize (llm route, bundle mapping) for the whole run; per round: promote (10 -> 50 %), rollback (-> 0 %), resume (-> 10 %), bundle load (summ@1 and summ@2 alternating), each waited for until live, {doc['settings']['pause_s']} s apart

| | requests | ok | failed | statuses | missing `x-adapter-variant` | wrong arm | wrong mapping |
|---|---:|---:|---:|---|---:|---:|---:|
| load | {r['sent']:,} | {r['ok']:,} | **{r['failed']}** | {statuses} | {r['missing_variant']} | {r['wrong_arm']} | {r['wrong_mapping']} |

| op | attempted | succeeded | p50 ms | p95 ms | max ms |
|---|---:|---:|---:|---:|---:|
{rows}

Failures: {fails}. Envoy processor-cluster retries during the run: {doc['stats'].get('envoy_processor_retries')}; processor config_mismatch: {doc['stats'].get('config_mismatch')}. Checked against the state live while each request was in flight: {r['checked']:,} answers (keyed chat: the arm `canary.assign` gives the key; summarize: the live bundle's `v`); arms seen {r['variants_seen']}, mappings seen {r['mappings_seen']}. Overall: {'every op applied, 0 failed requests' if doc['ok'] else 'NOT clean (see perf/results JSON)'}.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=None, help="rounds of promote, rollback, resume, bundle load (100)")
    p.add_argument("--quick", action="store_true", help="5 rounds")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--pause", type=float, default=0.2)
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of load before the first and after the last op")
    p.add_argument("--out", default=None)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    args.argv = argv
    if args.ops is None:
        args.ops = 5 if args.quick else 100
    if args.ops < 1 or args.clients < 1:
        p.error("--ops and --clients must be at least 1")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    doc = run(args)
    r = doc["requests"]
    print(f"{r['sent']} requests, {r['failed']} failed ({r['by_status']}); missing variant {r['missing_variant']}, "
          f"wrong arm {r['wrong_arm']}, wrong mapping {r['wrong_mapping']}")
    for k, v in doc["ops"].items():
        print(f"  {k:9s} {v['succeeded']}/{v['attempted']}  p50 {v['p50_ms']} ms  p95 {v['p95_ms']} ms")
    for s in r["failure_samples"][:6] + r["check_samples"][:6]:
        print("  ", s[:300])
    out = Path(args.out) if args.out else (None if args.no_write else RESULTS_JSON)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")
    if not args.no_write:
        benchenv.append_results(results_text(doc))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
