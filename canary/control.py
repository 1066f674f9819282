"""The canary controller: per rollout a step plan judged on gateway-wide per-arm windows, applied to the live config.

What: the supervisor (`extproc/supervisor.py`) owns one `Controller`. For every rollout of the
accepted config that has a `plan:` block (`RolloutRef.control`, a `ControlConfig`) it keeps a
`canary.plan.Plan` and a `canary.judge.Windows`; rollouts without one stay at the file's weights
(manual, as before). Each `tick()`:

```
samples = FeedReader.read()            every worker's finished requests since the last tick (canary/feed.py)
for each sample of a controlled rollout, at or after the moment its current weights went live:
    windows.observe(arm, t, latency_ms, ttft_ms, error, unit)   unit: the key's id (a cluster for the judge)
for each controlled rollout whose `interval` has passed, and whose weights are live:
    verdict = judge_windows(windows, baseline, ramped arm, now, judge config)
    event = plan.advance(wall time, verdict, windows.samples())           promote | rollback | hold
    changed: one structured log line (the event with its evidence), the plan state and the
             rollout's control file saved, the windows cleared, the new weights marked not yet live
tick() returns True when a rollout's weights changed: the supervisor then republishes the config
```

Applying: `prepare(snapshot)` (the config file compiled again, by `Supervisor.reload`) reconciles
the controller with the config and returns the weight overrides (`overrides()`: rollout ->
{"weights": {ramped arm: basis points}, "allow_force": bool}) that `extproc.config.bundle.publish`
puts in the bundle's manifest; every worker loads that bundle on SIGHUP and acknowledges
(make-before-break), and Envoy gets it after them, as any reload; `commit(pending)` after the
publish installs the reconciled state. A sample whose `t` is older than the moment its rollout's
weights last went live is dropped (`stale`): the requests in flight during a step belong to the step
before, and a new step is a new population.

Reconciling (at start and on every reload), per rollout, by its *fingerprint* (baseline, canary
names, each arm's backend, salt, the plan's steps and ramped arm):
- no `plan:` block: no control (the file's weights; a previous plan's state files are left as they are);
- same fingerprint as the plan the controller runs: kept (state, windows, events); the new block's
  min samples, dwell, interval, windows and judge thresholds apply from now on;
- otherwise (new rollout, new arms/backends/salt/steps): the saved state in the state directory is
  resumed when its fingerprint matches (a restart resumes at the saved step and weight, not the
  file's); else a new ramp at the first step (a reset: logged, the old files kept as `*.prev`).
The file's weight for the ramped arm is ignored while a plan controls it.

State directory (`spec.processor.stateDir`, default `.adapter-state` beside the config file): per
rollout `<name>.plan.json` (`canary.plan.PlanState`, atomic replace) and `<name>.control.json`
(`{"format": 1, "rollout", "fingerprint", "events": [the last EVENTS_KEPT changing events],
"last_hold": the last hold whose reason changed}`, atomic replace). Plans use wall time (a dwell survives a restart); windows use the feed's monotonic clock and
restart empty with the supervisor.

Operator actions (`action(name, "promote" | "rollback" | "pause" | "resume", reason)`) call the
plan's; `UnknownRollout` (no such rollout), `NoPlan` (a rollout without `plan:`) and
`canary.plan.PlanError` (not allowed now, e.g. pausing a rolled-back plan) are the refusals.
`status(name)` is what `adapterctl canary status` prints.
Wrapped here, not in canary/plan.py or canary/judge.py (owned elsewhere): the fingerprint, the
events file, the stale-sample cut-off, hold de-duplication in the log (a hold is logged when its
reason changes, numbers aside, not every tick; the last one is in the status) and the "is live" flag.
Cost: a tick reads the feed (about 1 us per record) and judges each due rollout (about 4 ms at the
default window sizes); nothing on the request path beyond the feed's record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from canary.feed import FeedReader, Sample, finite, variant_key
from canary.judge import JudgeConfig, Verdict, WindowConfig, Windows, judge_windows
from canary.plan import Event, Plan, PlanConfig, PlanError, PlanStateError

log = logging.getLogger("canary.control")

FORMAT = 1
EVENTS_KEPT = 50
ACTIONS = ("promote", "rollback", "pause", "resume")


@dataclass(frozen=True)
class ControlConfig:
    """A rollout's `plan:` block, compiled (`extproc/config/compile.py`)."""

    plan: PlanConfig = PlanConfig()
    judge: JudgeConfig = JudgeConfig()
    window: WindowConfig = WindowConfig()
    interval: float = 60.0  # seconds between judgements (the config's default: spec.rollouts[].plan.interval)


class UnknownRollout(LookupError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(f"no rollout named {name!r} (rollouts: {', '.join(known) or 'none'})")
        self.name = name


class NoPlan(LookupError):
    def __init__(self, name: str):
        super().__init__(f"rollout {name!r} has no plan: block: it is manual (its weights are the config "
                         f"file's; edit them and reload)")
        self.name = name


def fingerprint(ref: Any) -> str:
    """What identifies a ramp: a change of any of these starts a new one."""
    r, c = ref.rollout, ref.control
    doc = {"baseline": r.baseline, "canaries": [a.name for a in r.canaries], "salt": r.hash_salt,
           "backends": dict(sorted(dict(ref.arm_backends).items())),
           "steps_bp": list(c.plan.steps_bp) if c is not None else None,
           "arm": (c.plan.arm or (r.canaries[0].name if r.canaries else None)) if c is not None else None}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _write_json(path: Path, doc: Any) -> None:
    """Atomic: a temporary file in the same directory, fsynced, renamed over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@dataclass
class RolloutControl:
    """One controlled rollout: its plan, windows, evidence and whether its weights are live."""

    ref: Any  # extproc.config.snapshot.RolloutRef
    plan: Plan
    windows: Windows
    fingerprint: str
    events: deque = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    live: dict | None = None  # the overrides the published config serves (None: not yet published)
    since: float | None = None  # monotonic time its weights went live (samples before it are stale)
    next_judge: float = 0.0
    verdict: Verdict | None = None
    last_hold: dict | None = None
    stale: int = 0
    observed: int = 0

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def config(self) -> ControlConfig:
        return self.ref.control

    def override(self) -> dict:
        r = self.plan.rollout
        return {"weights": {self.plan.arm: r.weight(self.plan.arm)}, "allow_force": r.allow_force}


@dataclass
class Pending:
    """A reconciliation not yet installed (`Controller.prepare`, then `commit` once published)."""

    rollouts: dict[str, RolloutControl]
    known: tuple[str, ...]
    started: list[tuple[RolloutControl, Event | None, str]]  # new ramps or resumed ones, with why
    base: dict[str, RolloutControl] = field(default_factory=dict)  # kept rollouts: the object each was copied from
    published: dict[str, dict] = field(default_factory=dict)  # the overrides as of prepare (what is published)

    def __post_init__(self) -> None:
        if not self.published:
            self.published = {n: rc.override() for n, rc in sorted(self.rollouts.items())}

    def overrides(self) -> dict[str, dict]:
        return dict(self.published)


class Controller:
    def __init__(self, state_dir: str | os.PathLike, feed_dir: str | os.PathLike | None = None, *,
                 clock: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic):
        """`state_dir`: where plans are saved; `feed_dir`: the workers' feed files (None: fed only
        through `observe`); `clock`: wall time for plans, `mono`: the feed's monotonic clock."""
        self.state_dir = Path(state_dir)
        self.reader = FeedReader(feed_dir) if feed_dir is not None else None
        self.clock = clock
        self.mono = mono
        self._lock = threading.RLock()
        self._rollouts: dict[str, RolloutControl] = {}
        self._keys: dict[int, tuple[str, str]] = {}  # feed key -> (rollout, arm)
        self._known: tuple[str, ...] = ()  # every rollout of the config, controlled or not
        self._manual: dict[str, Any] = {}  # rollouts without a plan: name -> RolloutRef
        self.apply_error: str | None = None
        self.applies = 0

    # ---- files

    def plan_path(self, name: str) -> Path:
        return self.state_dir / f"{name}.plan.json"

    def control_path(self, name: str) -> Path:
        return self.state_dir / f"{name}.control.json"

    def _save(self, rc: RolloutControl, plan: bool = True) -> None:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            if plan:
                rc.plan.save(self.plan_path(rc.name))
            _write_json(self.control_path(rc.name), {"format": FORMAT, "rollout": rc.name,
                                                     "fingerprint": rc.fingerprint, "events": list(rc.events),
                                                     "last_hold": rc.last_hold})
        except OSError as e:
            log.error("canary %s: cannot save its state in %s: %s (the plan goes on in memory)", rc.name,
                      self.state_dir, e)

    def _load_control(self, name: str) -> dict | None:
        try:
            doc = json.loads(self.control_path(name).read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("rollout") == name else None

    def _keep_prev(self, name: str) -> None:
        for p in (self.plan_path(name), self.control_path(name)):
            if p.exists():
                try:
                    os.replace(p, p.with_name(p.name + ".prev"))
                except OSError:
                    pass

    # ---- reconciling with a config

    def prepare(self, snapshot: Any) -> Pending:
        """Reconcile with `snapshot`'s rollouts (nothing is installed yet: see `commit`)."""
        with self._lock:
            out: dict[str, RolloutControl] = {}
            base: dict[str, RolloutControl] = {}
            started: list[tuple[RolloutControl, Event | None, str]] = []
            for name, ref in snapshot.rollouts.items():
                if ref.control is None:
                    continue
                fp = fingerprint(ref)
                old = self._rollouts.get(name)
                if old is not None and old.fingerprint == fp:
                    plan = Plan(ref.rollout, ref.control.plan, old.plan.state)
                    plan.last_event = old.plan.last_event
                    rc = RolloutControl(ref, plan, old.windows, fp, old.events, old.live, old.since, old.next_judge,
                                        old.verdict, old.last_hold, old.stale, old.observed)
                    if ref.control.window != old.windows.config:
                        rc.windows = Windows(ref.control.window)
                    out[name] = rc
                    base[name] = old
                    continue
                rc, why = self._resume_or_start(ref, fp, replaced=old is not None)
                out[name] = rc
                started.append((rc, rc.plan.last_event if why.startswith("new") else None, why))
            return Pending(out, tuple(snapshot.rollouts), started, base)

    def _resume_or_start(self, ref: Any, fp: str, replaced: bool) -> tuple[RolloutControl, str]:
        name, cfg = ref.name, ref.control
        now = self.clock()
        reason = ""
        saved = self._load_control(name)
        if self.plan_path(name).exists():
            if saved is None or saved.get("fingerprint") != fp:
                reason = ("the saved plan is for other arms, backends, salt or steps" if saved is not None
                          else f"{self.control_path(name).name} is missing or unreadable")
            else:
                try:
                    plan = Plan.restore(ref.rollout, cfg.plan, self.plan_path(name))
                except (PlanStateError, PlanError) as e:
                    reason = f"the saved plan cannot be used: {e}"
                else:
                    rc = RolloutControl(ref, plan, Windows(cfg.window), fp)
                    rc.events.extend(e for e in saved.get("events", ()) if isinstance(e, dict))
                    rc.last_hold = saved.get("last_hold") if isinstance(saved.get("last_hold"), dict) else None
                    return rc, (f"resumed from {self.plan_path(name)}: {plan.status} at "
                                f"{plan.weight_bp / 100:g} % (step {plan.state.step + 1} of "
                                f"{len(plan.state.steps_bp)})")
            self._keep_prev(name)
        plan = Plan.start(ref.rollout, cfg.plan, now)
        rc = RolloutControl(ref, plan, Windows(cfg.window), fp)
        what = "new ramp (the rollout's arms, backends, salt or plan steps changed)" if replaced else "new ramp"
        return rc, what + (f"; reset: {reason}, kept as *.prev" if reason else "")

    def commit(self, pending: Pending) -> None:
        """The config `pending` was prepared for is published: install it. The weights of each
        controlled rollout are live from now on (samples before now are stale)."""
        with self._lock:
            now = self.mono()
            for rc, ev, why in pending.started:
                if ev is not None:
                    rc.events.append(ev.to_dict())
                    self._log(rc, ev.to_dict(), why)
                else:
                    log.info("canary %s", json.dumps({"rollout": rc.name, "kind": "resume-state", "reason": why,
                                                      "status": rc.plan.status, "weight_bp": rc.plan.weight_bp},
                                                     sort_keys=True))
                self._save(rc)
            for name, rc in pending.rollouts.items():
                old = pending.base.get(name)
                if old is not None and old.plan.state != rc.plan.state:
                    # a tick (or an operator) moved the plan while the config was being published: keep
                    # that move; it is not live yet (needs_apply), so the loop publishes it next
                    rc.plan.state, rc.plan.last_event = old.plan.state, old.plan.last_event
                    rc.verdict, rc.last_hold, rc.next_judge = old.verdict, old.last_hold, old.next_judge
                published = pending.published.get(name)
                if rc.live != published:
                    rc.live = published
                    rc.since = now
                    rc.windows.clear()
            self._rollouts = pending.rollouts
            self._known = pending.known
            self._keys = {variant_key(f"{n}/{arm}"): (n, arm) for n, rc in self._rollouts.items()
                          for arm in rc.ref.rollout.arm_names}
            self.apply_error = None
            self.applies += 1

    def set_manual(self, snapshot: Any) -> None:
        with self._lock:
            self._manual = {n: ref for n, ref in snapshot.rollouts.items() if ref.control is None}

    def failed_apply(self, error: str) -> None:
        """The publish for the plans' weights was refused: they stay not live; retried next tick."""
        with self._lock:
            self.apply_error = error

    def overrides(self) -> dict[str, dict]:
        with self._lock:
            return {n: rc.override() for n, rc in sorted(self._rollouts.items())}

    def needs_apply(self) -> bool:
        """A plan's weights differ from what the published config serves."""
        with self._lock:
            return any(rc.live != rc.override() for rc in self._rollouts.values())

    @property
    def controlled(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._rollouts)

    @property
    def interval(self) -> float:
        with self._lock:
            return min((rc.config.interval for rc in self._rollouts.values()), default=1.0)

    # ---- feeding and judging

    def observe(self, samples: list[Sample]) -> int:
        """Put feed records into their rollouts' windows; returns how many were used."""
        used = 0
        with self._lock:
            keys, rollouts = self._keys, self._rollouts
            live = {n: rc.live == rc.override() for n, rc in rollouts.items()}
            for s in samples:
                hit = keys.get(s.key)
                if hit is None:
                    continue
                rc = rollouts[hit[0]]
                if rc.since is None or s.t < rc.since or not live[hit[0]]:
                    rc.stale += 1
                    continue
                rc.windows.observe(hit[1], s.t, latency_ms=finite(s.latency_ms), ttft_ms=finite(s.ttft_ms),
                                   error=s.error, unit=s.unit)
                rc.observed += 1
                used += 1
        return used

    def tick(self) -> bool:
        """Read the feed, judge each due rollout, advance its plan. True when weights changed."""
        samples = self.reader.read() if self.reader is not None else []
        self.observe(samples)
        changed = False
        with self._lock:
            mono, wall = self.mono(), self.clock()
            for rc in self._rollouts.values():
                if mono < rc.next_judge or rc.live != rc.override():
                    continue  # not due, or its weights are not live yet (a publish is pending)
                rc.next_judge = mono + rc.config.interval
                base, arm = rc.ref.rollout.baseline, rc.plan.arm
                verdict = judge_windows(rc.windows, base, arm, mono, rc.config.judge)
                rc.verdict = verdict
                counts = rc.windows.samples(mono)
                ev = rc.plan.advance(wall, verdict, {base: counts.get(base, 0), arm: counts.get(arm, 0)})
                if ev.changed:
                    self._record(rc, ev)
                    changed = True
                else:
                    d = ev.to_dict()
                    new = rc.last_hold is None or _shape(rc.last_hold.get("reason")) != _shape(d["reason"])
                    rc.last_hold = d
                    if new:  # a hold is logged and saved when its reason changes, not its numbers
                        self._log(rc, d, "")
                        self._save(rc, plan=False)
        return changed

    def _record(self, rc: RolloutControl, ev: Event) -> None:
        d = ev.to_dict()
        rc.events.append(d)
        rc.last_hold = None
        rc.windows.clear()
        rc.next_judge = 0.0
        self._log(rc, d, "")
        self._save(rc)

    def _log(self, rc: RolloutControl, event: dict, why: str) -> None:
        doc = dict(event)
        if why:
            doc["why"] = why
        level = logging.WARNING if doc.get("kind") == "rollback" else logging.INFO
        log.log(level, "canary %s", json.dumps(doc, sort_keys=True, default=str))

    # ---- operators

    def action(self, name: str, action: str, reason: str = "") -> dict:
        """An operator's promote, rollback, pause or resume: the event (raises UnknownRollout,
        NoPlan, PlanError, or ValueError for another action)."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")
        with self._lock:
            rc = self._rollouts.get(name)
            if rc is None:
                if name in self._known:
                    raise NoPlan(name)
                raise UnknownRollout(name, list(self._known))
            ev = getattr(rc.plan, action)(self.clock(), reason)
            self._record(rc, ev)
            return ev.to_dict()

    def status(self, name: str | None = None) -> dict:
        """Every rollout (or one): arms, weights, samples, the last verdict, the plan, events."""
        with self._lock:
            if name is not None and name not in self._known:
                raise UnknownRollout(name, list(self._known))
            names = [name] if name is not None else list(self._known)
            out = {}
            mono = self.mono()
            for n in names:
                rc = self._rollouts.get(n)
                if rc is None:
                    ref = self._manual.get(n)
                    r = ref.rollout if ref is not None else None
                    out[n] = {"name": n, "plan": None, "manual": True,
                              "baseline": r.baseline if r else None,
                              "arms": {a: {"backend": ref.arm_backends.get(a), "weight_bp": r.weight(a),
                                           "weight_percent": r.weight(a) / 100} for a in r.arm_names} if r else {},
                              "routes": list(ref.routes) if ref is not None else []}
                    continue
                r = rc.plan.rollout
                counts = rc.windows.counts(mono)
                st = rc.plan.status_dict()
                out[n] = {
                    "name": n, "manual": False, "routes": list(rc.ref.routes), "baseline": r.baseline,
                    "arm": rc.plan.arm,
                    "arms": {a: {"backend": rc.ref.arm_backends.get(a), "weight_bp": r.weight(a),
                                 "weight_percent": r.weight(a) / 100,
                                 "samples": counts.get(a, {"latency_ms": 0, "ttft_ms": 0, "error": 0})}
                             for a in r.arm_names},
                    "plan": {**st, "paused": st["status"] == "paused",
                             "steps_percent": [bp / 100 for bp in st["steps_bp"]],
                             "min_samples": rc.config.plan.min_samples, "dwell_s": rc.config.plan.dwell_s,
                             "interval_s": rc.config.interval, "judge_min_samples": rc.config.judge.min_samples},
                    "live": rc.live == rc.override(), "apply_error": self.apply_error,
                    "verdict": rc.verdict.to_dict() if rc.verdict is not None else None,
                    "last_hold": rc.last_hold, "events": list(rc.events)[-10:],
                    "feed": {"observed": rc.observed, "stale": rc.stale,
                             "dropped": self.reader.dropped if self.reader is not None else 0},
                }
            return out

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def _shape(reason: Any) -> str:
    """A hold's reason without its numbers ("samples 12 < 30" and "samples 13 < 30" are one reason)."""
    return re.sub(r"\d+(\.\d+)?", "#", str(reason))


def default_state_dir(config_path: str | os.PathLike, configured: str | None) -> Path:
    """`spec.processor.stateDir` (relative: to the config file's directory), else `.adapter-state`
    beside the config file."""
    base = Path(config_path).resolve().parent
    if configured:
        p = Path(configured)
        return p if p.is_absolute() else base / p
    return base / ".adapter-state"


__all__ = ["ACTIONS", "ControlConfig", "Controller", "NoPlan", "Pending", "RolloutControl", "UnknownRollout",
           "default_state_dir", "fingerprint"]
