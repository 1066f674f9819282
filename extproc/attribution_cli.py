"""`adapterctl attribution [--window S] [--route R] [--json]`: where requests' time went, per route and component.

What: reads `adapter_processor_latency_seconds{route,component}` (extproc/attribution.py: routes with
`serverTiming`) from the processor supervisor's `/metrics` (every worker's values merged, as `adapterctl
status` finds the supervisor: `--admin URL`, else the `--config FILE`'s `spec.processor.adminPort`, else
9902) and prints, per route, each component's p50, p90, p99 and mean in milliseconds and its count.
Which requests: all since the workers started; with `--window S`, only those that ended in the next S
seconds (two scrapes S apart, the difference). Quantiles are estimated from the histogram buckets as
Prometheus' `histogram_quantile` does (linear within a bucket; a quantile in the last, open bucket is
that bucket's lower bound); the mean is exact (sum / count). Components a request did not have (no
request body, no RTT from the tenant agent, no streamed body) have fewer observations than the route's
requests, whose count is the `queue` row's (observed once per request).
Exit codes: 0 shown (also when there is nothing to show: it says so), 3 the supervisor cannot be reached.
Cost: one or two HTTP GETs of /metrics. Nothing on the request path.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

from extproc.attribution import COMPONENTS

METRIC = "adapter_processor_latency_seconds"
QUANTILES = (0.5, 0.9, 0.99)
Hist = dict[str, Any]  # {"buckets": {le: cumulative count}, "sum": s, "count": n}


def register(sub: Any) -> None:
    s = sub.add_parser("attribution", help="latency per route and component (Envoy, processor phases, queue, "
                       "network RTT, upstream TTFB and first token): p50/p90/p99 over recent requests")
    s.add_argument("--window", type=float, default=0.0, metavar="S",
                   help="only requests that end in the next S seconds (default: all since the workers started)")
    s.add_argument("--route", metavar="R", help="only this route")
    s.add_argument("--json", action="store_true", help="one JSON document")
    s.add_argument("--admin", metavar="URL", help="the processor admin URL (default: http://127.0.0.1:PORT with "
                   "PORT the --config file's spec.processor.adminPort, else 9902)")
    s.add_argument("--config", metavar="FILE", help="the AdapterGateway file, for the default admin port")
    s.set_defaults(fn=cmd_attribution)


def histograms(text: str) -> dict[tuple[str, str], Hist]:
    """{(route, component): histogram} of METRIC in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], Hist] = {}
    for family in text_string_to_metric_families(text):
        if family.name != METRIC:
            continue
        for s in family.samples:
            key = (s.labels.get("route", ""), s.labels.get("component", ""))
            h = out.setdefault(key, {"buckets": {}, "sum": 0.0, "count": 0.0})
            if s.name.endswith("_bucket"):
                h["buckets"][float(s.labels["le"])] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
            elif s.name.endswith("_count"):
                h["count"] = s.value
    return out


def delta(new: dict[tuple[str, str], Hist], old: dict[tuple[str, str], Hist]) -> dict[tuple[str, str], Hist]:
    """What was observed between two scrapes (a series that restarted, e.g. a worker replaced, counts whole)."""
    out = {}
    for key, h in new.items():
        o = old.get(key)
        if o is None or h["count"] < o["count"]:
            out[key] = h
            continue
        out[key] = {"buckets": {le: n - o["buckets"].get(le, 0.0) for le, n in h["buckets"].items()},
                    "sum": h["sum"] - o["sum"], "count": h["count"] - o["count"]}
    return out


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """`histogram_quantile(q, ...)` over cumulative buckets {le: count}; None without observations."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        n = buckets[le]
        if n >= rank:
            if math.isinf(le):
                return lower  # the open bucket: its lower bound, as Prometheus does
            inside = n - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, n
    return lower


def breakdown(hists: dict[tuple[str, str], Hist], route: str | None = None) -> dict[str, Any]:
    """{route: {"requests": n, "components": {component: {count, mean_ms, p50_ms, p90_ms, p99_ms}}}}."""
    order = {c: i for i, c in enumerate(COMPONENTS)}
    out: dict[str, Any] = {}
    for (r, component), h in sorted(hists.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99), kv[0][1])):
        if route is not None and r != route:
            continue
        if h["count"] <= 0:
            continue
        row: dict[str, Any] = {"count": int(h["count"]), "mean_ms": round(h["sum"] / h["count"] * 1000.0, 3)}
        for q in QUANTILES:
            # every observation 0 (the queue today): exactly 0, not the middle of the first bucket
            v = 0.0 if h["sum"] == 0 else quantile(q, h["buckets"])
            row[f"p{round(q * 100)}_ms"] = round(v * 1000.0, 3) if v is not None else None
        entry = out.setdefault(r, {"requests": 0, "components": {}})
        entry["components"][component] = row
        if component == "queue":
            entry["requests"] = row["count"]
    return out


def pretty(doc: dict[str, Any]) -> str:
    routes = doc["routes"]
    scope = f"requests that ended in the last {doc['window_s']:g} s" if doc.get("window_s") else \
        "all requests since the workers started"
    if not routes:
        return (f"no latency attribution in {doc['admin']}/metrics ({scope}): no route has serverTiming, "
                "or none of its requests has ended yet")
    lines = [f"latency attribution, {scope} (ms; quantiles estimated from histogram buckets, mean exact)"]
    for name, r in routes.items():
        lines.append(f"route {name}: {r['requests']} requests")
        lines.append(f"  {'component':<28}{'count':>7}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}")
        for component, row in r["components"].items():
            cells = "".join(f"{row[k]:>10.3f}" if row[k] is not None else f"{'-':>10}"
                            for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms"))
            lines.append(f"  {component:<28}{row['count']:>7}{cells}")
    return "\n".join(lines)


def _scrape(admin: str) -> dict[tuple[str, str], Hist]:
    import httpx

    r = httpx.get(f"{admin}/metrics", timeout=5)
    r.raise_for_status()
    return histograms(r.text)


def cmd_attribution(args: Any) -> int:
    from extproc.logs_cli import _admin_url

    admin = _admin_url(args)
    if args.window < 0:
        print("adapterctl attribution: --window must be >= 0 seconds", file=sys.stderr)
        return 2
    try:
        hists = _scrape(admin)
        if args.window > 0:
            time.sleep(args.window)
            hists = delta(_scrape(admin), hists)
    except Exception as e:  # noqa: BLE001
        print(f"adapterctl attribution: the processor supervisor at {admin} cannot be reached ({e})",
              file=sys.stderr)
        return 3
    doc = {"admin": admin, "window_s": args.window or None, "routes": breakdown(hists, args.route)}
    print(json.dumps(doc, indent=1) if args.json else pretty(doc))
    return 0


__all__ = ["register", "cmd_attribution", "histograms", "delta", "quantile", "breakdown", "pretty"]
