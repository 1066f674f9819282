"""Canary step plans: a rollout's ramp as a state machine, driven by verdicts and operator actions.

What: a `Plan` ramps one canary arm of a `canary.assign.Rollout` through steps in percent (default
1 -> 5 -> 25 -> 50 -> 100). `advance(now, verdict, samples)` is the automatic control: it promotes to
the next step when the judge's verdict is `pass`, every judged arm has at least `min_samples`
observations and the step has lasted `dwell_s` seconds; it rolls back to 0 on `fail`; otherwise it
holds. Operators `pause`, `resume`, `promote` and `rollback`. Every call returns an `Event` (kind, who,
from/to step, weight and status, the reason, the evidence: the verdict's per-metric numbers, the
samples, the dwell, and the bucket ranges that change arm) for the log; `Event.changed` says whether
anything changed (a `hold` changes nothing). `plan.rollout` is the `Rollout` to apply now.
States: running (ramping) | paused (no automatic promotion; a `fail` still rolls back unless
`rollback_while_paused=False`) | rolled_back (every canary at 0, forcing off: `Rollout.rolled_back()`;
final: only an operator's `resume` restarts the ramp, at the first step) | completed (the last step
reached; nothing automatic happens). `resume` from paused restarts the step's dwell.
Transitions:
  running   --pass, n >= min_samples per arm, dwell >= dwell_s-->  next step (completed at the last)
  running   --fail-->                                              rolled_back (weight 0)
  paused    --fail (rollback_while_paused)-->                      rolled_back
  running, paused --operator promote--> next step;  --operator pause/resume--> paused/running
  running, paused, completed --operator rollback--> rolled_back;  rolled_back --operator resume--> step 1
  anything else: a hold event (advance) or a PlanError naming why (an operator action not allowed now).
Monotone: weights change only through `Rollout.with_weight` (a step) and `Rollout.rolled_back`; every
transition is checked with `canary.assign.monotone(old, new)` and a step that would move keys between
two canaries (raising canary 1 while canary 2 has traffic) is refused, at construction for the whole
plan and again at each transition (a PlanError; the state does not change). Keys move toward the canary
only on a promotion (or an operator's resume after a rollback); a rollback returns every key to the
baseline. The keys in the canary at a weight depend on the weight alone (`canary.assign`), so a plan
that goes 5 % -> 0 -> 5 % gives the canary the same users again.
Persistence: `PlanState` is plain data; `save_state(path, state)` writes JSON to a temporary file in the
same directory, fsyncs it and `os.replace`s it over the target (a crash leaves the old file or the new
one, never half of one); `load_state(path)` refuses a file that is not JSON or has a missing, mistyped or
out-of-range field with a `PlanStateError` naming the file and the field; `Plan.restore` also checks
the state against the rollout and config it is restored for (name, arm, steps); `plan.reload(path)`
replaces the plan's state only when the file is valid, so a corrupt file keeps the previous state.
Format (`format: 1`): {"format", "rollout", "arm", "steps_bp", "step", "weight_bp", "status",
"step_started", "updated", "reason"}; times are the caller's clock in seconds (wall time if the state
must survive a restart: a monotonic clock restarts with the process).
Parameters: `PlanConfig(steps=(1, 5, 25, 50, 100), min_samples=500, dwell_s=300.0, arm=None (the first
canary), rollback_while_paused=True)`.
Not here: reading windows, calling the judge on a schedule, applying `plan.rollout` to the live
config, the `adapterctl canary` commands (docs/canary.md).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from canary.assign import BUCKETS, Rollout, RolloutError, monotone, moves

FORMAT = 1
Status = Literal["running", "paused", "rolled_back", "completed"]
STATUSES = ("running", "paused", "rolled_back", "completed")
Kind = Literal["start", "promote", "rollback", "hold", "pause", "resume"]


class PlanError(ValueError):
    """A plan or an action that cannot be used; `field` names what is wrong."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class PlanStateError(ValueError):
    """A state file (or state) that cannot be loaded: the file, the field and why."""

    def __init__(self, file: str, field: str, reason: str) -> None:
        super().__init__(f"{file}: {field}: {reason}")
        self.file = file
        self.field = field
        self.reason = reason


def _percent_to_bp(p: Any, i: int) -> int:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p):
        raise PlanError(f"steps[{i}]", f"must be a number of percent, not {p!r}")
    bp = round(p * 100)
    if abs(p * 100 - bp) > 1e-6:
        raise PlanError(f"steps[{i}]", f"{p!r} % is not a whole number of basis points (0.01 %)")
    if not 0 < bp <= BUCKETS:
        raise PlanError(f"steps[{i}]", f"must be in (0, 100] percent, not {p!r}")
    return bp


@dataclass(frozen=True)
class PlanConfig:
    steps: tuple[float, ...] = (1, 5, 25, 50, 100)  # percent of traffic on the canary
    min_samples: int = 500  # per judged arm, for an automatic promotion
    dwell_s: float = 300.0  # at least this long at a step before an automatic promotion
    arm: str | None = None  # the canary arm ramped; None: the rollout's first canary
    rollback_while_paused: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        if not self.steps:
            raise PlanError("steps", "must list at least one step")
        bps = self.steps_bp
        for i, (a, b) in enumerate(zip(bps, bps[1:])):
            if b <= a:
                raise PlanError(f"steps[{i + 1}]", f"must be above the step before it ({self.steps[i]} %): "
                                f"a plan only ramps up")
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int) or self.min_samples < 0:
            raise PlanError("min_samples", f"must be a non-negative integer, not {self.min_samples!r}")
        if isinstance(self.dwell_s, bool) or not isinstance(self.dwell_s, (int, float)) or not self.dwell_s >= 0:
            raise PlanError("dwell_s", f"must be a non-negative number of seconds, not {self.dwell_s!r}")

    @property
    def steps_bp(self) -> tuple[int, ...]:
        return tuple(_percent_to_bp(p, i) for i, p in enumerate(self.steps))


@dataclass(frozen=True)
class PlanState:
    """Everything a plan needs to continue after a restart (with its rollout and config)."""

    rollout: str
    arm: str
    steps_bp: tuple[int, ...]
    step: int  # index into steps_bp: the current step (rolled_back: the step it rolled back from)
    weight_bp: int  # the canary's weight now (0 when rolled back)
    status: Status
    step_started: float  # when the current step (or the running period after a resume) began
    updated: float
    reason: str = ""
    format: int = FORMAT

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps_bp"] = list(self.steps_bp)
        return d

    @classmethod
    def from_dict(cls, data: Any, file: str = "<state>") -> PlanState:
        """Validate every field; a PlanStateError names the first bad one."""
        if not isinstance(data, dict):
            raise PlanStateError(file, "(top)", f"must be a JSON object, not {type(data).__name__}")

        def get(name: str, types: tuple[type, ...], what: str) -> Any:
            if name not in data:
                raise PlanStateError(file, name, "missing")
            v = data[name]
            if isinstance(v, bool) and bool not in types or not isinstance(v, types):
                raise PlanStateError(file, name, f"must be {what}, not {v!r}")
            return v

        fmt = get("format", (int,), "an integer")
        if fmt != FORMAT:
            raise PlanStateError(file, "format", f"is {fmt}, this version reads format {FORMAT}")
        rollout = get("rollout", (str,), "a string")
        arm = get("arm", (str,), "a string")
        if not rollout or not arm:
            raise PlanStateError(file, "rollout" if not rollout else "arm", "must not be empty")
        steps = get("steps_bp", (list,), "a list of basis points")
        if not steps or any(isinstance(s, bool) or not isinstance(s, int) or not 0 < s <= BUCKETS for s in steps):
            raise PlanStateError(file, "steps_bp",
                                 f"must be a non-empty list of integers in (0, {BUCKETS}], not {steps!r}")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise PlanStateError(file, "steps_bp", f"must increase, not {steps!r}")
        step = get("step", (int,), "an integer")
        if not 0 <= step < len(steps):
            raise PlanStateError(file, "step", f"{step} is not an index into steps_bp (0..{len(steps) - 1})")
        weight = get("weight_bp", (int,), "an integer")
        status = get("status", (str,), "a string")
        if status not in STATUSES:
            raise PlanStateError(file, "status", f"must be one of {', '.join(STATUSES)}, not {status!r}")
        expected = 0 if status == "rolled_back" else steps[step]
        if weight != expected:
            raise PlanStateError(file, "weight_bp", f"is {weight}, but status {status} at step {step} means {expected}")
        started = get("step_started", (int, float), "a number (seconds)")
        updated = get("updated", (int, float), "a number (seconds)")
        for name, v in (("step_started", started), ("updated", updated)):
            if not math.isfinite(v):
                raise PlanStateError(file, name, f"must be a finite number, not {v!r}")
        reason = data.get("reason", "")
        if not isinstance(reason, str):
            raise PlanStateError(file, "reason", f"must be a string, not {reason!r}")
        unknown = sorted(set(data) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise PlanStateError(file, unknown[0], "is not a field of a plan state")
        return cls(rollout, arm, tuple(steps), step, weight, status, float(started), float(updated), reason, fmt)


def save_state(path: str | os.PathLike, state: PlanState) -> None:
    """Write `state` as JSON atomically: a temporary file in the same directory, fsync, os.replace."""
    path = Path(path)
    data = json.dumps(state.to_dict(), indent=2, sort_keys=True).encode() + b"\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # the rename itself durable (best effort: not every filesystem lets a directory be fsynced)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def load_state(path: str | os.PathLike) -> PlanState:
    """Read and validate a state file; PlanStateError(file, field, reason) if it cannot be used."""
    file = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise PlanStateError(file, "(file)", f"cannot be read: {e.strerror or e}") from e
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise PlanStateError(file, "(json)", f"is not valid JSON: {e}") from e
    return PlanState.from_dict(data, file)


@dataclass(frozen=True)
class Event:
    """One call's outcome, for the log: what changed (if anything), who did it, why, on what evidence."""

    kind: Kind
    by: Literal["judge", "operator"]
    rollout: str
    arm: str
    at: float
    changed: bool
    from_status: str
    to_status: str
    from_step: int
    to_step: int
    from_weight_bp: int
    to_weight_bp: int
    reason: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    moves: tuple[tuple[int, int, str, str], ...] = ()  # (lo, hi, old arm, new arm) bucket ranges

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["evidence"] = dict(self.evidence)
        d["moves"] = [list(m) for m in self.moves]
        return d


def _verdict_of(verdict: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(verdict, str):
        v, ev = verdict, {"verdict": verdict}
    else:
        v = getattr(verdict, "verdict", None)
        ev = verdict.to_dict() if hasattr(verdict, "to_dict") else {"verdict": v}
    if v not in ("pass", "fail", "inconclusive"):
        raise PlanError("verdict", f"must be pass, fail or inconclusive, not {v!r}")
    return v, ev


class Plan:
    """A rollout's ramp. Construct with `Plan.start` (a new ramp) or `Plan.restore` (after a restart)."""

    def __init__(self, rollout: Rollout, config: PlanConfig, state: PlanState, *, source: str = "<state>") -> None:
        arm = config.arm if config.arm is not None else (rollout.canaries[0].name if rollout.canaries else None)
        if arm is None:
            raise PlanError("arm", f"rollout {rollout.name!r} has no canary arm to ramp")
        if arm not in {a.name for a in rollout.canaries}:
            raise PlanError("arm", f"{arm!r} is not a canary of rollout {rollout.name!r} "
                            f"(arms: {', '.join(rollout.arm_names)})")
        if state.rollout != rollout.name:
            raise PlanStateError(source, "rollout", f"is {state.rollout!r}, this plan is for {rollout.name!r}")
        if state.arm != arm:
            raise PlanStateError(source, "arm", f"is {state.arm!r}, this plan ramps {arm!r}")
        if tuple(state.steps_bp) != config.steps_bp:
            raise PlanStateError(source, "steps_bp", f"is {list(state.steps_bp)}, the plan's steps are "
                                 f"{list(config.steps_bp)} basis points (a changed plan needs a new ramp)")
        self.base = rollout
        self.config = config
        self.arm = arm
        self._check_steps()
        self.state = state
        self.last_event: Event | None = None

    # ---- construction

    @classmethod
    def start(cls, rollout: Rollout, config: PlanConfig = PlanConfig(), now: float = 0.0) -> Plan:
        """A new ramp at the first step; `plan.last_event` is its start event."""
        arm = config.arm if config.arm is not None else (rollout.canaries[0].name if rollout.canaries else "")
        bps = config.steps_bp
        state = PlanState(rollout.name, arm, bps, 0, bps[0], "running", now, now, "started")
        plan = cls(rollout, config, state)
        plan.last_event = Event("start", "operator", rollout.name, arm, now, True, "running", "running", 0, 0,
                                rollout.weight(arm), bps[0], f"started at the first step ({bps[0] / 100:g} %)",
                                {}, plan._moves(rollout, plan.rollout))
        return plan

    @classmethod
    def restore(cls, rollout: Rollout, config: PlanConfig, path: str | os.PathLike) -> Plan:
        """The plan saved at `path` (PlanStateError naming the file and field when it cannot be used)."""
        return cls(rollout, config, load_state(path), source=str(path))

    def save(self, path: str | os.PathLike) -> None:
        save_state(path, self.state)

    def reload(self, path: str | os.PathLike) -> None:
        """Replace the state with the file's, only if the file is valid for this plan (else raise and
        keep the current state)."""
        state = load_state(path)
        Plan(self.base, self.config, state, source=str(path))  # validates against rollout and config
        self.state = state

    # ---- what to apply

    def rollout_at(self, state: PlanState) -> Rollout:
        if state.status == "rolled_back":
            return self.base.rolled_back()
        try:
            return self.base.with_weight(self.arm, state.weight_bp)
        except RolloutError as e:
            raise PlanError("steps", f"{state.weight_bp} basis points for {self.arm!r} does not fit rollout "
                            f"{self.base.name!r}: {e}") from e

    @property
    def rollout(self) -> Rollout:
        """The rollout as it should be served now."""
        return self.rollout_at(self.state)

    @property
    def weight_bp(self) -> int:
        return self.state.weight_bp

    @property
    def status(self) -> Status:
        return self.state.status

    def _check_steps(self) -> None:
        """Every step of the plan, and a rollback from any of them, must be monotone."""
        bps = self.config.steps_bp
        prev = self.base
        try:
            weights = [self.base.with_weight(self.arm, bp) for bp in bps]
        except RolloutError as e:
            raise PlanError("steps", f"a step does not fit rollout {self.base.name!r}: {e}") from e
        back = self.base.rolled_back()
        for i, r in enumerate(weights):
            if not monotone(prev, r):
                raise PlanError(f"steps[{i}]", f"moving {self.arm!r} to {bps[i] / 100:g} % moves keys between "
                                f"canaries of {self.base.name!r} (not monotone): ramp the last canary, or one "
                                f"at a time")
            if not monotone(r, back):
                raise PlanError(f"steps[{i}]", "a rollback from this step would not be monotone")
            prev = r

    # ---- transitions

    @staticmethod
    def _moves(old: Rollout, new: Rollout) -> tuple[tuple[int, int, str, str], ...]:
        return tuple((m.lo, m.hi, m.old, m.new) for m in moves(old, new))

    def _event(self, kind: Kind, by: str, now: float, old: PlanState | None, new: PlanState, reason: str,
               evidence: Mapping[str, Any]) -> Event:
        old = old or new
        return Event(kind, by, self.base.name, self.arm, now, old != new and (
            old.status != new.status or old.weight_bp != new.weight_bp or old.step != new.step
            or old.step_started != new.step_started),
            old.status, new.status, old.step, new.step, old.weight_bp, new.weight_bp, reason, dict(evidence))

    def _go(self, kind: Kind, by: str, now: float, new: PlanState, reason: str,
            evidence: Mapping[str, Any]) -> Event:
        old = self.state
        r_old, r_new = self.rollout_at(old), self.rollout_at(new)
        if not monotone(r_old, r_new):  # defensive: _check_steps already refused such plans
            raise PlanError("steps", f"{kind} from {old.weight_bp} to {new.weight_bp} basis points is not monotone")
        self.state = new
        ev = replace(self._event(kind, by, now, old, new, reason, evidence), moves=self._moves(r_old, r_new))
        self.last_event = ev
        return ev

    def _hold(self, now: float, reason: str, evidence: Mapping[str, Any]) -> Event:
        ev = self._event("hold", "judge", now, None, self.state, reason, evidence)
        self.last_event = ev
        return ev

    def _next(self, now: float, reason: str) -> PlanState:
        s = self.state
        if s.step + 1 >= len(s.steps_bp):
            raise PlanError("step", f"already at the last step ({s.steps_bp[-1] / 100:g} %)")
        step = s.step + 1
        last = step == len(s.steps_bp) - 1
        return replace(s, step=step, weight_bp=s.steps_bp[step], status="completed" if last else s.status,
                       step_started=now, updated=now, reason=reason)

    def _back(self, now: float, reason: str) -> PlanState:
        return replace(self.state, weight_bp=0, status="rolled_back", step_started=now, updated=now, reason=reason)

    def advance(self, now: float, verdict: Any, samples: Mapping[str, int] | int) -> Event:
        """The automatic control: `verdict` a `canary.judge.Verdict` (or "pass" | "fail" |
        "inconclusive"); `samples` per arm (arm -> observations in the judged window) or the smallest
        count. Promote, roll back or hold; the event carries the verdict, samples and dwell."""
        v, vev = _verdict_of(verdict)
        s = self.state
        if isinstance(samples, Mapping):
            counts = {k: int(n) for k, n in samples.items()}
            n_min = min(counts.get(self.base.baseline, 0), counts.get(self.arm, 0))
        else:
            counts, n_min = {"min": int(samples)}, int(samples)
        dwell = now - s.step_started
        evidence = {"verdict": vev, "samples": counts, "min_samples": self.config.min_samples,
                    "dwell_s": round(dwell, 3), "min_dwell_s": self.config.dwell_s}
        if s.status in ("rolled_back", "completed"):
            what = "rolled back: an operator must resume" if s.status == "rolled_back" else "completed"
            return self._hold(now, f"{what}; automatic control does nothing", evidence)
        if v == "fail" and (s.status == "running" or self.config.rollback_while_paused):
            failed = [m["metric"] for m in vev.get("metrics", ()) if m.get("verdict") == "fail"]
            reason = f"verdict fail ({', '.join(failed) or 'judge'}) at {s.weight_bp / 100:g} %: rolled back to 0"
            return self._go("rollback", "judge", now, self._back(now, reason), reason, evidence)
        if s.status == "paused":
            return self._hold(now, f"paused; verdict {v}", evidence)
        if v != "pass":
            return self._hold(now, f"verdict {v}", evidence)
        missing = []
        if n_min < self.config.min_samples:
            missing.append(f"samples {n_min} < {self.config.min_samples} per arm")
        if dwell < self.config.dwell_s:
            missing.append(f"dwell {dwell:.0f} s < {self.config.dwell_s:g} s")
        if missing:
            return self._hold(now, f"verdict pass, but {' and '.join(missing)}", evidence)
        reason = (f"verdict pass with {n_min} samples per arm after {dwell:.0f} s: "
                  f"{s.weight_bp / 100:g} % -> {s.steps_bp[s.step + 1] / 100:g} %")
        return self._go("promote", "judge", now, self._next(now, reason), reason, evidence)

    # ---- operator actions

    def pause(self, now: float, reason: str = "") -> Event:
        if self.state.status != "running":
            raise PlanError("status", f"cannot pause a plan that is {self.state.status}")
        why = f"paused by an operator{': ' + reason if reason else ''}"
        return self._go("pause", "operator", now, replace(self.state, status="paused", updated=now, reason=why),
                        why, {})

    def resume(self, now: float, reason: str = "") -> Event:
        """From paused: running again, the step's dwell restarting now. From rolled_back: the ramp
        restarts at the first step."""
        s = self.state
        if s.status == "paused":
            why = f"resumed by an operator at {s.weight_bp / 100:g} % (dwell restarts){': ' + reason if reason else ''}"
            return self._go("resume", "operator", now, replace(s, status="running", step_started=now, updated=now,
                                                                  reason=why), why, {})
        if s.status == "rolled_back":
            why = (f"resumed by an operator after a rollback: restarting at {s.steps_bp[0] / 100:g} %"
                   f"{': ' + reason if reason else ''}")
            return self._go("resume", "operator", now, replace(s, status="running", step=0, weight_bp=s.steps_bp[0],
                                                                  step_started=now, updated=now, reason=why), why, {})
        raise PlanError("status", f"cannot resume a plan that is {s.status}")

    def promote(self, now: float, reason: str = "") -> Event:
        """The next step now, whatever the verdict (an operator's decision; a paused plan stays paused)."""
        s = self.state
        if s.status not in ("running", "paused"):
            raise PlanError("status", f"cannot promote a plan that is {s.status}"
                            + (" (resume it first)" if s.status == "rolled_back" else ""))
        nxt = self._next(now, "")
        why = (f"promoted by an operator: {s.weight_bp / 100:g} % -> {nxt.weight_bp / 100:g} %"
               f"{': ' + reason if reason else ''}")
        return self._go("promote", "operator", now, replace(nxt, reason=why), why, {})

    def rollback(self, now: float, reason: str = "") -> Event:
        s = self.state
        if s.status == "rolled_back":
            raise PlanError("status", "already rolled back")
        why = f"rolled back by an operator at {s.weight_bp / 100:g} %{': ' + reason if reason else ''}"
        return self._go("rollback", "operator", now, self._back(now, why), why, {})

    def status_dict(self) -> dict[str, Any]:
        """For `adapterctl canary status` (later): the state plus the arms' weights now."""
        r = self.rollout
        return {**self.state.to_dict(), "weights_bp": {a: r.weight(a) for a in r.arm_names}}


__all__ = [
    "FORMAT", "STATUSES", "Event", "Plan", "PlanConfig", "PlanError", "PlanState", "PlanStateError", "load_state",
    "save_state",
]
