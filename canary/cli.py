"""`adapterctl canary`: the operator's view and hands on the supervisor's canary controller.

What: `adapterctl canary status [ROLLOUT] [--json]` prints every rollout (or one): its arms with
backend, weight and samples in the current window, the plan (step, weight, status, paused or not,
min samples, dwell), whether the plan's weights are live, the last verdict per metric with its
reason, and the last events. `adapterctl canary promote|rollback|pause|resume ROLLOUT [--reason
TEXT]` calls the plan's operator action and applies it at once (the supervisor republishes the
config with the new weights). Both talk to the processor supervisor's admin port (`GET /canary[/NAME]`,
`POST /canary/NAME/ACTION`), found as `adapterctl reload` finds it: `--admin URL`, else
`http://127.0.0.1:PORT` with PORT the `--config` file's `spec.processor.adminPort`, else 9902.
Exit codes: 0 done; 1 refused by the plan (e.g. pausing a rolled-back plan) or not applied (the
config republish was refused: the message says why; the controller retries every 5 s); 2 usage; 3 unknown
rollout, or a rollout without a `plan:` block (manual: edit its weights and reload); 4 the
supervisor is unreachable or answered something else than JSON.
`adapterctl bundle load FILE.zip [--admin URL] [--json]` sends a bundle to the supervisor (`POST
/bundles`): verified, preloaded in the sandbox with its golden cases, published only if it passes.
Exit 0 loaded (the generation serving it is printed); 1 refused (each reason on stderr: FILE: FIELD:
REASON, or the golden case with its diff; nothing changed); 4 unreachable. `adapterctl restart --rolling`
(`POST /restart`): every worker replaced in turn with its drain; exit 0 done, 1 stopped at a worker
that did not come back, 4 unreachable.
Cost: one HTTP request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

EXIT_OK, EXIT_REFUSED, EXIT_UNKNOWN, EXIT_UNREACHABLE = 0, 1, 3, 4


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `canary` (status, promote, rollback, pause, resume) to adapterctl's subcommands."""
    s = subparsers.add_parser("canary", help="canary rollouts: status, promote, rollback, pause, resume",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    csub = s.add_subparsers(dest="canary_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--admin", metavar="URL", help="the processor admin URL (default: http://127.0.0.1:PORT "
                       "with PORT the --config file's spec.processor.adminPort, else 9902)")
        p.add_argument("--config", metavar="FILE", help="the AdapterGateway file, for the default admin port")
        p.add_argument("--timeout", type=float, default=30.0)
        p.add_argument("--json", action="store_true", help="print the supervisor's JSON answer")

    st = csub.add_parser("status", help="arms, weights, samples, verdict per metric, plan step, events")
    st.add_argument("rollout", nargs="?", metavar="ROLLOUT")
    common(st)
    st.set_defaults(fn=cmd_status)
    for action, text in (("promote", "the next step now, whatever the verdict"),
                         ("rollback", "every canary key back to the baseline (weight 0) now"),
                         ("pause", "no automatic promotion (a failing verdict still rolls back)"),
                         ("resume", "running again (after a rollback: from the first step)")):
        a = csub.add_parser(action, help=text)
        a.add_argument("rollout", metavar="ROLLOUT")
        a.add_argument("--reason", default="", help="kept in the event and the log")
        common(a)
        a.set_defaults(fn=cmd_action, action=action)


def register_bundle_load(bundle_subparsers: argparse._SubParsersAction) -> None:
    """Add `bundle load` to adapterctl's `bundle` subcommands (build and verify are extproc/cli.py's)."""
    b = bundle_subparsers.add_parser("load", help="load a bundle into the running gateway: verified, preloaded in "
                                     "a sandbox with its golden requests, published only if it passes")
    b.add_argument("file", metavar="FILE.zip")
    b.add_argument("--admin", metavar="URL", help="the processor admin URL (default: http://127.0.0.1:PORT with "
                   "PORT the --config file's spec.processor.adminPort, else 9902)")
    b.add_argument("--config", metavar="FILE", help="the AdapterGateway file, for the default admin port")
    b.add_argument("--timeout", type=float, default=120.0)
    b.add_argument("--json", action="store_true", help="print the supervisor's JSON answer")
    b.set_defaults(fn=cmd_bundle_load)


def register_restart(subparsers: argparse._SubParsersAction) -> None:
    """Add `restart --rolling` to adapterctl's subcommands."""
    r = subparsers.add_parser("restart", help="replace the processor's workers (new code) one at a time, with drain")
    r.add_argument("--rolling", action="store_true", required=True, help="one worker at a time (the only mode)")
    r.add_argument("--admin", metavar="URL")
    r.add_argument("--config", metavar="FILE")
    r.add_argument("--timeout", type=float, default=600.0)
    r.add_argument("--json", action="store_true")
    r.set_defaults(fn=cmd_restart)


def cmd_bundle_load(args: argparse.Namespace) -> int:
    import httpx

    url = _admin(args) + "/bundles"
    try:
        with open(args.file, "rb") as f:
            data = f.read()
    except OSError as e:
        print(f"adapterctl bundle load: refused {args.file}:\n  {args.file}: bundle: cannot be read: "
              f"{e.strerror or e}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        r = httpx.post(url, content=data, headers={"content-type": "application/zip"}, timeout=args.timeout)
        doc = r.json()
    except (httpx.HTTPError, ValueError) as e:
        print(f"adapterctl bundle load: {url}: supervisor unreachable or not answering JSON: {type(e).__name__}: {e}",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    if not isinstance(doc, dict) or not doc.get("accepted"):
        stage = doc.get("stage", "?") if isinstance(doc, dict) else "?"
        print(f"adapterctl bundle load: refused {args.file} at {stage} ({doc.get('bundle') or 'unnamed'}); keeping "
              f"generation {doc.get('generation')}:", file=sys.stderr)
        for line in (doc.get("problems") or []) if isinstance(doc, dict) else [str(doc)]:
            print(f"  {line}", file=sys.stderr)
        return EXIT_REFUSED
    if not args.json:
        pre = doc.get("preload") or {}
        print(f"loaded {doc['bundle']} (manifest sha256 {doc['digest']}): routes {', '.join(doc['routes'])}; "
              f"{len(pre.get('golden') or ())} golden cases passed in the sandbox ({pre.get('network')}); "
              f"generation {doc['generation']}")
    return EXIT_OK


def cmd_restart(args: argparse.Namespace) -> int:
    got = _call(args, "POST", "/restart")
    if got is None:
        return EXIT_UNREACHABLE
    code, doc = got
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    for w in doc.get("workers") or ():
        if not args.json:
            print(f"worker {w['index']} (port {w['port']}): pid {w['old_pid']} -> {w['pid']}, drained in "
                  f"{w['drained_s']:g} s, ready after {w['ready_s']:g} s, generation {w['generation']}")
    if not doc.get("ok"):
        print(f"adapterctl restart: stopped: {doc.get('error')}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK


def _admin(args: argparse.Namespace) -> str:
    from extproc.cli import _default_admin

    return (args.admin or _default_admin(args.config)).rstrip("/")


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> tuple[int, Any] | None:
    import httpx

    url = _admin(args) + path
    try:
        r = httpx.request(method, url, json=body, timeout=args.timeout)
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError) as e:
        print(f"adapterctl canary: {url}: supervisor unreachable or not answering JSON: {type(e).__name__}: {e}",
              file=sys.stderr)
        return None


def _refusal(code: int, doc: Any) -> int:
    msg = doc.get("message", doc) if isinstance(doc, dict) else doc
    print(f"adapterctl canary: {msg}", file=sys.stderr)
    err = doc.get("error") if isinstance(doc, dict) else None
    return EXIT_UNKNOWN if err in ("unknown_rollout", "no_plan") else EXIT_REFUSED


def cmd_status(args: argparse.Namespace) -> int:
    got = _call(args, "GET", "/canary" + (f"/{args.rollout}" if args.rollout else ""))
    if got is None:
        return EXIT_UNREACHABLE
    code, doc = got
    if code != 200:
        return _refusal(code, doc)
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
        return EXIT_OK
    rollouts = doc.get("rollouts", {})
    if not rollouts:
        print("no rollouts in the running config")
    for name, r in rollouts.items():
        print(format_status(name, r))
    return EXIT_OK


def cmd_action(args: argparse.Namespace) -> int:
    got = _call(args, "POST", f"/canary/{args.rollout}/{args.action}", {"reason": args.reason})
    if got is None:
        return EXIT_UNREACHABLE
    code, doc = got
    if code != 200:
        return _refusal(code, doc)
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        ev = doc["event"]
        print(f"{args.rollout}: {ev['kind']} ({ev['from_status']} {ev['from_weight_bp'] / 100:g} % -> "
              f"{ev['to_status']} {ev['to_weight_bp'] / 100:g} %): {ev['reason']}")
    if not doc.get("applied"):
        errors = (doc.get("reload") or {}).get("errors") or "the controller will retry"
        print(f"adapterctl canary: {args.rollout}: recorded but not applied yet: {errors}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK


def _when(t: Any) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(t)))
    except (TypeError, ValueError):
        return "?"


def format_status(name: str, r: dict) -> str:
    """The human-readable status of one rollout (what `canary status` prints)."""
    lines = []
    routes = ", ".join(r.get("routes") or ()) or "-"
    if r.get("plan") is None:
        lines.append(f"rollout {name} (routes {routes}): manual (no plan: block; weights from the config file)")
        for arm, a in (r.get("arms") or {}).items():
            lines.append(f"  {arm:<12} {a['weight_percent']:>7g} %  backend {a.get('backend')}")
        return "\n".join(lines)
    p = r["plan"]
    steps = " -> ".join(f"{x:g}" for x in p["steps_percent"])
    flags = [p["status"]] + (["PAUSED"] if p.get("paused") else []) + ([] if r.get("live") else ["not live yet"])
    lines.append(f"rollout {name} (routes {routes}): {', '.join(flags)}; step {p['step'] + 1} of "
                 f"{len(p['steps_percent'])} ({steps} %), {r['arm']} at {p['weight_bp'] / 100:g} %")
    lines.append(f"  plan: min samples {p['min_samples']} per arm, dwell {p['dwell_s']:g} s, judged every "
                 f"{p['interval_s']:g} s; {p.get('reason', '')}")
    if r.get("apply_error"):
        lines.append(f"  not applied: {r['apply_error']}")
    for arm, a in r["arms"].items():
        s = a.get("samples") or {}
        role = "baseline" if arm == r.get("baseline") else "canary"
        lines.append(f"  {arm:<12} {role:<8} {a['weight_percent']:>7g} %  backend {a.get('backend')}  samples: "
                     f"{s.get('error', 0)} requests, {s.get('latency_ms', 0)} latencies, {s.get('ttft_ms', 0)} TTFTs")
    v = r.get("verdict")
    if v:
        lines.append(f"  verdict: {v['verdict']}")
        for m in v.get("metrics", ()):
            lines.append(f"    {m['metric']:<11} {m['verdict']:<12} {m.get('reason', '')}")
    else:
        lines.append("  verdict: none yet")
    hold = r.get("last_hold")
    if hold:
        lines.append(f"  holding: {hold.get('reason')}")
    for ev in (r.get("events") or [])[-5:]:
        lines.append(f"  {_when(ev.get('at'))} {ev.get('kind')} by {ev.get('by')}: {ev.get('reason')}")
    return "\n".join(lines)


__all__ = ["register", "register_bundle_load", "register_restart", "cmd_status", "cmd_action", "cmd_bundle_load",
           "cmd_restart", "format_status"]
