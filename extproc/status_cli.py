"""`adapterctl status [--json]`: the running gateway at a glance, from the supervisor and what the workers share.

What, in one report (pretty, or `--json` for scripts):
- **config**: the accepted generation and digest, and per worker its generation, digest, pid, whether it
  is alive and ready, restarts, and a refused generation with its reason (`GET /config`);
- **backends and endpoints**: from the accepted config bundle (the path `GET /config` names): each
  backend's kind and endpoints with their labels and engine, their gateway-wide in-flight requests,
  tokens and pending prefill tokens (the workers' shared table, `extproc/datalayer/inflight.py`, read in
  place), and the engine's live signals where it exports them (queue, running, KV-cache use, LoRA
  adapters: one scrape of each engine's metrics now, 1 s timeout, `extproc/datalayer/engine_metrics.py`;
  `unreachable` with the error otherwise);
- **tenants**: the configured tenants with their quota and the tenant agent's live numbers (CPU use
  against the limit, throttling, admitted / rejected) when its snapshot is there (`ebpf/snapshot.py`,
  `/dev/shm/adapter-gateway/...`; `agent: not running` otherwise);
- **budgets** (tenants with `budget`): per tenant this minute's and today's requests and tokens against
  its limits, from the budget store (`extproc/qos/budget_store.budgets_view`);
- **rollouts**: arms, weights, samples and the plan's step and status (`GET /canary`);
- **qos** (configs with `spec.qos`): per SLO and objective the attainment over the matrix horizon, the
  workers' counts added up (`qos-<worker>.json` in the state dir, `extproc/qos/engine.aggregate`), the
  deviation and where the matrix is escalated; per tenant with a glitch threshold the last window's P99
  and whether its breaker is open (in which workers);
- **admission** (`spec.qos.admission`): per pool the gateway-wide slots held (every worker's slot file in
  `<stateDir>/admission/`, read in place), each worker's concurrency limit, the requests waiting per class
  and the lowest Jain's index (`admission-<worker>.json`, `extproc/qos/queue.admission_view`).
Which supervisor: `--admin URL`, else the `--config FILE`'s `spec.processor.adminPort`, else 9902.
Exit codes: 0 shown, 3 the supervisor cannot be reached.
Cost: a few HTTP calls to the supervisor, one metrics scrape per engine endpoint (in parallel), one read of
each worker's in-flight file. Nothing on the request path.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SCRAPE_TIMEOUT_S = 1.0


def register(sub: Any) -> None:
    s = sub.add_parser("status", help="config generation per worker, backends and endpoints with live signals, "
                       "tenants, rollouts")
    s.add_argument("--json", action="store_true", help="one JSON document")
    s.add_argument("--admin", metavar="URL", help="the processor admin URL (default: http://127.0.0.1:PORT with "
                   "PORT the --config file's spec.processor.adminPort, else 9902)")
    s.add_argument("--config", metavar="FILE", help="the AdapterGateway file, for the default admin port")
    s.set_defaults(fn=cmd_status)


def _scrape(url: str, engine: str) -> dict[str, Any]:
    import httpx

    from extproc.datalayer.engine_metrics import parse_metrics

    try:
        r = httpx.get(url, timeout=SCRAPE_TIMEOUT_S)
        r.raise_for_status()
        s = parse_metrics(engine, r.text)
    except Exception as e:  # noqa: BLE001 - any failure is a state to show, not a crash
        return {"unreachable": f"{type(e).__name__}: {e}"[:200]}
    out = {k: getattr(s, k) for k in ("queue", "running", "kv_usage", "lora_running", "lora_waiting", "max_lora",
                                      "gpu_utilization", "gpu_memory_used_bytes") if getattr(s, k, None) is not None}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _metrics_url(backend: Any, endpoint: str) -> str:
    path = (getattr(backend, "endpoint_metrics_paths", {}) or {}).get(endpoint) or "/metrics"
    return f"http://{endpoint}{path}"


def backends_view(snap: Any, state_dir: str | None) -> list[dict[str, Any]]:
    from extproc.datalayer.inflight import InflightTable

    table = InflightTable(state_dir, reader=True) if state_dir else None
    all_eps = [e for b in snap.backends.values() for e in b.endpoint_ids]
    loads = table.loads(all_eps) if table is not None else {}
    jobs = {}
    with ThreadPoolExecutor(max_workers=8) as pool:
        for b in snap.backends.values():
            for e in b.endpoint_ids:
                engine = (b.endpoint_engines or {}).get(e)
                if engine:
                    jobs[(b.name, e)] = pool.submit(_scrape, _metrics_url(b, e), engine)
        out = []
        for b in snap.backends.values():
            eps = []
            for e in b.endpoint_ids:
                n, tokens, prefill = loads.get(e, (0, 0, 0))
                row: dict[str, Any] = {"endpoint": e, "labels": dict(b.endpoint_labels.get(e) or {}),
                                       "engine": (b.endpoint_engines or {}).get(e),
                                       "in_flight": {"requests": n, "tokens": tokens, "prefill_tokens": prefill}}
                job = jobs.get((b.name, e))
                if job is not None:
                    row["signals"] = job.result()
                eps.append(row)
            out.append({"name": b.name, "kind": b.kind, "models": list(getattr(b, "models", ()) or ()),
                        "endpoints": eps})
    return out


def _quota(tenant: Any) -> dict[str, float] | None:
    """The tenant's configured CPU quota (`spec.tenants[].cpu`: limit in CPUs, burst share), None when unlimited."""
    cpu = getattr(tenant, "cpu", None)
    return None if cpu is None else {"limit": cpu.limit, "burst": cpu.burst}


LIVE_SHOWN = ("cpu_used", "cpu_limit", "over_quota", "nr_throttled", "throttled_ns", "admitted", "rejected")


def tenants_view(snap: Any) -> dict[str, Any]:
    tenants = [{"id": t.id, "cpu_quota": _quota(t)} for t in getattr(snap, "tenants", ())]
    try:
        from ebpf.snapshot import SnapshotReader, snapshot_path

        path = getattr(getattr(snap, "tenancy", None), "snapshot", None) or snapshot_path()
        live = SnapshotReader(path, recheck_s=0).current()
    except Exception as e:  # noqa: BLE001 - the agent's snapshot is optional
        return {"tenants": tenants, "agent": f"unreadable: {e}"[:200]}
    if live is None:
        return {"tenants": tenants, "agent": "not running (no snapshot)"}
    by_id = {t.as_dict().get("tenant") or t.as_dict().get("id"): t.as_dict() for t in live}
    for t in tenants:
        t["live"] = by_id.get(t["id"])
    return {"tenants": tenants, "agent": {"age_s": round(live.age_s, 3), "stale": live.stale, "source": live.source}}


def gather(admin: str) -> dict[str, Any]:
    import httpx

    from extproc.config.bundle import load_bundle

    config = httpx.get(f"{admin}/config", timeout=5).json()
    doc: dict[str, Any] = {"admin": admin, "config": config}
    snap = None
    if config.get("bundle"):
        try:
            snap = load_bundle(config["bundle"])
        except Exception as e:  # noqa: BLE001
            doc["bundle_error"] = f"{type(e).__name__}: {e}"[:300]
    if snap is not None:
        doc["backends"] = backends_view(snap, config.get("state_dir"))
        doc.update(tenants_view(snap))
        if any(getattr(t, "budget", None) is not None for t in snap.tenants):
            from extproc.qos.budget_store import budgets_view

            doc["budgets"] = budgets_view(snap, config.get("state_dir"))
        if getattr(snap.spec.spec, "qos", None) is not None:
            from extproc.qos.engine import aggregate

            doc["qos"] = aggregate(config.get("state_dir")) or {"workers": [], "slos": {}, "tenants": {},
                                                                "note": "no worker has published yet"}
            if snap.spec.spec.qos.admission:
                from extproc.qos.queue import admission_view

                doc["admission"] = admission_view(snap, config.get("state_dir"))
    try:
        r = httpx.get(f"{admin}/canary", timeout=5)
        doc["rollouts"] = r.json().get("rollouts", {}) if r.status_code == 200 else {"error": r.status_code}
    except Exception as e:  # noqa: BLE001
        doc["rollouts"] = {"error": str(e)[:200]}
    return doc


def pretty(doc: dict[str, Any]) -> str:
    c = doc["config"]
    lines = [f"config: generation {c.get('generation')} digest {str(c.get('digest'))[:12]} from {c.get('source')}"]
    for w in c.get("workers", ()):
        state = "ready" if w.get("ready") else ("alive" if w.get("alive") else "DOWN")
        lines.append(f"  worker {w['index']}: pid {w.get('pid')} {state} generation {w.get('generation')} "
                     f"restarts {w.get('restarts')}" + (f" REFUSED {w['refused']}" if w.get("refused") else ""))
    for b in doc.get("backends", ()):
        lines.append(f"backend {b['name']} ({b['kind']}) models {', '.join(b['models']) or '-'}")
        for e in b["endpoints"]:
            f = e["in_flight"]
            sig = e.get("signals")
            sig_text = ("" if sig is None else " unreachable" if "unreachable" in sig else
                        " " + " ".join(f"{k}={v}" for k, v in sig.items()))
            labels = ",".join(f"{k}={v}" for k, v in e["labels"].items())
            lines.append(f"  {e['endpoint']} [{labels}] in flight {f['requests']} ({f['tokens']} tokens, "
                         f"{f['prefill_tokens']} to prefill){sig_text}")
    if "tenants" in doc:
        agent = doc.get("agent")
        lines.append(f"tenants ({'agent ' + json.dumps(agent) if agent else ''}):")
        for t in doc["tenants"]:
            q = t.get("cpu_quota")
            quota = "unlimited" if q is None else f"{q['limit']:g} CPU (+{q['burst'] * 100:g}% burst)"
            live = t.get("live")
            live_text = "no live numbers" if live is None else " ".join(
                f"{k}={live[k]:.3f}" if isinstance(live[k], float) else f"{k}={live[k]}" for k in LIVE_SHOWN
                if k in live)
            lines.append(f"  {t['id']}: quota {quota}; {live_text}")
    budgets = doc.get("budgets")
    if budgets is not None:
        lines.append(f"budgets (store {budgets['store']}):")
        for t, v in budgets["tenants"].items():
            if "error" in v:
                lines.append(f"  {t}: {v['error']}")
                continue
            parts = [f"{w} {v[w]['requests']}/{v[w]['limits'][0] or '-'} requests "
                     f"{v[w]['tokens']}/{v[w]['limits'][1] or '-'} tokens" for w in ("minute", "day")]
            lines.append(f"  {t}: " + "; ".join(parts))
    qos = doc.get("qos")
    if qos is not None:
        ages = ", ".join(f"worker {w['worker']} {w['age_s']}s ago" for w in qos.get("workers", ()))
        lines.append(f"qos (published: {ages or 'none yet'}):")
        for name, s in qos.get("slos", {}).items():
            parts = []
            for o, v in s["horizon"].items():
                a = v.get("attainment")
                parts.append(f"{o} {'-' if a is None else f'{100 * a:.1f}%'} of {v['counted']} "
                             f"(target {s['targets'].get(o)}%)")
            dev = s.get("deviation")
            esc = s.get("escalated_workers")
            lines.append(f"  slo {name}: {'; '.join(parts) or 'no requests'}; deviation "
                         f"{'-' if dev is None else f'{dev:+.1f}'} points"
                         + (f"; matrix escalated in workers {esc}" if esc else ""))
        for t, v in qos.get("tenants", {}).items():
            p99 = v.get("last_p99_s")
            state = f"SHEDDING (breaker open in workers {v['open_workers']})" if v.get("open") else "ok"
            lines.append(f"  tenant {t}: glitch breaker {state}; last window P99 "
                         f"{'-' if p99 is None else f'{p99 * 1000:.2f} ms'} (threshold "
                         f"{(v.get('threshold_s') or 0) * 1000:g} ms), trips {v.get('trips', 0)}")
    adm = doc.get("admission")
    if adm is not None:
        lines.append("admission:")
        for name, p in adm.get("pools", {}).items():
            limits = ", ".join(f"worker {w} {v.get('limit')}" for w, v in p["workers"].items()) or "none published"
            waiting = ", ".join(f"{c} {n}" for c, n in sorted(p["waiting"].items())) or "none"
            jain = [j for v in p["workers"].values() for j in (v.get("jain") or {}).values()]
            lines.append(f"  pool {name}: in flight {p['in_flight']} (gateway-wide); limit {limits}; waiting "
                         f"{waiting}" + (f"; Jain's index {min(jain):.3f}" if jain else ""))
    ro = doc.get("rollouts")
    if isinstance(ro, dict) and ro and "error" not in ro:
        lines.append("rollouts:")
        for name, r in ro.items():
            arms = r.get("arms", {}) if isinstance(r, dict) else {}
            text = ", ".join(f"{a} {v.get('weight_percent')}%" for a, v in arms.items() if isinstance(v, dict))
            plan = (r.get("plan") or {}) if isinstance(r, dict) else {}
            lines.append(f"  {name}: {text}; " + ("manual weights" if r.get("manual") else
                                                  f"plan {plan.get('status', '-')}"))
    return "\n".join(lines)


def cmd_status(args: Any) -> int:
    from extproc.logs_cli import _admin_url

    admin = _admin_url(args)
    try:
        doc = gather(admin)
    except Exception as e:  # noqa: BLE001
        print(f"adapterctl status: the processor supervisor at {admin} cannot be reached ({e})", file=sys.stderr)
        return 3
    print(json.dumps(doc, indent=1, default=str) if args.json else pretty(doc))
    return 0


__all__ = ["register", "cmd_status", "gather", "pretty"]
