"""The scheduling framework: a profile runs filters -> weighted, normalised scorers -> one picker.

What: `SchedulingProfile` is built once per worker by the `Runtime` for each profile of the
config (`spec.schedulingProfiles`, or the implicit profile of a route naming a scoring picker
alone) and lives across reloads: `configure(old_ref, new_ref)` rebinds it to the plugin
instances the runtime keeps (their own state survives) and resets its once-per-reload logging.
`pick(state, backend, endpoints)` is what dispatch calls, as on a standalone picker:
1. a `SchedulingContext` (state, backend, parsed request, runtime, endpoint labels) is built once;
2. filters run in order, each on what the previous one kept (`filter(ctx, candidates)`; what a
   filter returns is intersected with its input, so a filter can only remove). When nothing is
   left the profile raises `NoCapacity` and dispatch refuses the request: 503 `no_capacity`, or
   429 `overloaded` with Retry-After when the request is sheddable (its `priority` < 0, the GIE
   InferenceObjective rule; note vLLM reads the same body field as "lower runs earlier");
3. each scorer returns raw scores (`score(ctx, candidates)`); the framework normalises them to
   [0, 1]: a scorer class with `bounded = True` is only clamped, any other is min-max scaled over
   the candidates ((v - min) / (max - min); all equal -> 1.0 for every candidate that has a
   score); an endpoint the scorer left out, or a non-finite score, is 0. The total of an
   endpoint is sum(weight * normalised), summed in profile order. The framework keeps the totals
   as one list in candidate order (the candidates are distinct: the config refuses a duplicate
   endpoint) and adds each scorer's share with `accumulate` (in C, `_score.c`, when built; else
   `accumulate_py`, the reference: the same floats bit for bit) when its scores are plain floats or
   ints in a dict, else with `normalise`;
4. the picker orders the candidates from the totals: the pick, then fallbacks (a picker with
   `pick_ranked(ctx, candidates, totals)`, max-score-picker, gets the list; any other
   `pick(ctx, {endpoint: total})`);
5. every filter and scorer with a `picked(ctx, endpoint)` method is told the pick (in profile
   order; a learned index such as prefix-cache-scorer's records it there; GIE's PreRequest). A
   raising hook is logged and counted like its plugin's other failures; the pick stands.
A filter or scorer that raises is skipped (a filter then keeps everyone, a scorer adds 0 for
everyone), logged once per reload with its traceback and counted in
`adapter_processor_scheduler_plugin_errors_total{profile,plugin,slot}`; a picker that raises
leaves the filtered candidates in their order. Every plugin call is timed (`perf_counter_ns`)
into `adapter_processor_scheduler_plugin_duration_seconds{profile,plugin,slot}` and the whole
decision into `adapter_processor_scheduler_decision_duration_seconds{profile}`, buffered in the
worker's `Pending` like the other request-path metrics.
Explanation (`explain: true` on the profile): one JSON line per decision on logger
`extproc.scheduling.decision` (at INFO, enabled whatever the worker's log level): request id and
token, route, backend, model, profile, the candidates, what each filter kept, each scorer's weight,
raw and normalised scores, the totals, the pick and its fallbacks (or the refusal); the same dict
is stored in `state.attrs["decision"]` for later log and trace consumers.
Tracing (`spec.tracing`, extproc/tracing.py): a sampled request's decision is a span
`scheduling decision` under the dispatch stage's span, with the profile, the backend, the number of
candidates, the chosen endpoint and fallbacks (or the refusal) as attributes.
Why: the GIE endpoint picker's shape (filters, scorers normalised by the framework, a picker),
with the framework doing the timing, the normalisation and the error isolation so that a plugin is
one small file with one formula.
Cost: about 0.5 us of framework per plugin (its timing and buffered histogram observe; a filter that
keeps everyone costs no new tuple) plus the plugins' own cost; the normalisation and sum of four
bounded scorers over 8 candidates about 0.9 us in C (5.8 us before, in Python), the max-score ranking
0.6 us (perf/bench_decision.py, 2 shared cores); the explanation adds a dict per scorer and a JSON
encode, only when on (then the scores go through `normalise`).
"""

from __future__ import annotations

import logging
import math
from time import perf_counter_ns
from typing import Any, Mapping

import orjson

from extproc.scheduling import NoCapacity, SchedulingContext
from extproc.tracing import TRACE_ATTR

log = logging.getLogger(__name__)
decision_log = logging.getLogger("extproc.scheduling.decision")


def normalise(raw: Mapping[str, float], candidates: tuple[str, ...], bounded: bool) -> dict[str, float]:
    """Each candidate's score in [0, 1]: clamped when `bounded`, else min-max over the candidates
    that have a finite score (all equal: 1.0); a candidate without one gets 0."""
    present: dict[str, float] = {}
    for e in candidates:
        v = raw.get(e)
        if v is not None:
            try:
                f = float(v)
            except (TypeError, ValueError):
                continue
            if math.isfinite(f):
                present[e] = f
    if bounded:
        return {e: (min(1.0, max(0.0, present[e])) if e in present else 0.0) for e in candidates}
    if not present:
        return dict.fromkeys(candidates, 0.0)
    lo, hi = min(present.values()), max(present.values())
    if hi == lo:
        return {e: (1.0 if e in present else 0.0) for e in candidates}
    span = hi - lo
    return {e: ((present[e] - lo) / span if e in present else 0.0) for e in candidates}


_INF = math.inf

try:  # the numeric loop in C (setup.py builds it; optional): the same totals and the same ranking
    from extproc.scheduling import _score as _native
except ImportError:  # not built: accumulate_py below
    _native = None


def accumulate_py(totals: list[float], raw: Mapping[str, float], candidates: tuple[str, ...], weight: float,
                  bounded: bool) -> bool:
    """`normalise(raw, candidates, bounded)` times `weight`, added into `totals` (a list in candidate order),
    for the usual case of a dict of floats or ints (or missing scores); False, with `totals` untouched, when
    a value is anything else (then the caller uses `normalise`). The reference of `_score.accumulate`."""
    if not isinstance(raw, dict):
        return False
    get = raw.get
    vals = [get(e) for e in candidates]
    for v in vals:
        if v is not None and v.__class__ is not float and v.__class__ is not int:
            return False
    try:
        fv = [None if v is None else float(v) for v in vals]
    except OverflowError:  # an int beyond a double: `normalise` decides (and fails, as float() does)
        return False
    if bounded:
        for i, v in enumerate(fv):
            if v is None:
                continue
            if 0.0 < v < 1.0:
                totals[i] += weight * v
            elif 1.0 <= v < _INF:
                totals[i] += weight
        return True
    present = [v for v in fv if v is not None and math.isfinite(v)]
    if not present:
        return True
    lo, hi = min(present), max(present)
    span = hi - lo
    for i, v in enumerate(fv):
        if v is None or not math.isfinite(v):
            continue
        totals[i] += weight * 1.0 if hi == lo else weight * ((v - lo) / span)
    return True


def _add_bounded(totals: dict[str, float], raw: Mapping[str, float], candidates: tuple[str, ...],
                 weight: float) -> bool:
    """`normalise(raw, candidates, bounded=True)` times `weight`, added into `totals`, for the usual
    case of float (or missing) scores; False, with `totals` untouched, when a value is anything else
    (the totals-by-endpoint form of `accumulate_py`, which the profile itself uses)."""
    get = raw.get
    vals = [get(e) for e in candidates]
    for v in vals:
        if v is not None and v.__class__ is not float:
            return False
    for e, v in zip(candidates, vals):
        if v is None:
            continue
        if 0.0 < v < 1.0:
            totals[e] += weight * v
        elif 1.0 <= v < _INF:
            totals[e] += weight
    return True


accumulate = _native.accumulate if _native is not None else accumulate_py


class SchedulingProfile:
    """One profile's plugins in order, bound to the worker's long-lived plugin instances."""

    def __init__(self, ref: Any, runtime: Any):
        self.runtime = runtime
        self.ref = ref
        self._bind(ref)

    # --- lifecycle ---------------------------------------------------------------------------------

    def configure(self, old: Any, new: Any) -> None:
        """A reload: bind the (possibly changed) plugin list and reset the once-per-reload logging."""
        self.ref = new
        self._bind(new)

    def _bind(self, ref: Any) -> None:
        rt = self.runtime
        self.name = ref.name
        self.explain = ref.explain
        self.filters = tuple((f.name, rt.plugin(f)) for f in ref.filters)
        scorers = [(s.name, rt.plugin(s), float(w)) for s, w in ref.scorers]
        self.scorers = tuple((n, inst, w, bool(getattr(inst, "bounded", False))) for n, inst, w in scorers)
        self.picker = (ref.picker.name, rt.plugin(ref.picker))
        # a picker that ranks the totals as a list in candidate order (max-score-picker): no dict built for it
        self._ranked = getattr(self.picker[1], "pick_ranked", None)
        self._run_filters = tuple((n, f, None) for n, f in self.filters)
        self._run_scorers = tuple((n, inst, w, b, None) for n, inst, w, b in self.scorers)
        self._picker_child = None
        self.hooks = tuple((n, slot, inst.picked) for slot, plugins in
                           (("filter", self.filters), ("scorer", [(s[0], s[1]) for s in self.scorers]))
                           for n, inst in plugins if callable(getattr(inst, "picked", None)))
        self._logged: set[tuple[str, str]] = set()
        self._children: dict[tuple[str, str], tuple[Any, Any]] | None = None  # metric children, bound lazily
        self._decision_child: Any = None
        if ref.explain and decision_log.getEffectiveLevel() > logging.INFO:
            decision_log.setLevel(logging.INFO)  # asked for in the config: shown whatever --log-level says

    def _bind_metrics(self, sink: Any) -> None:
        m = sink.metrics
        children: dict[tuple[str, str], tuple[Any, Any]] = {}
        for slot, names in (("filter", [n for n, _ in self.filters]), ("scorer", [s[0] for s in self.scorers]),
                            ("picker", [self.picker[0]])):
            for n in names:
                children[(slot, n)] = (sink.child(m.scheduler_plugin_duration, self.name, n, slot),
                                       sink.child(m.scheduler_plugin_errors, self.name, n, slot))
        self._children = children
        self._decision_child = sink.child(m.scheduler_decision_duration, self.name)
        # what pick() runs, with each plugin's duration histogram child beside it (no lookup per decision)
        self._run_filters = tuple((n, f, children[("filter", n)][0]) for n, f in self.filters)
        self._run_scorers = tuple((n, inst, w, b, children[("scorer", n)][0]) for n, inst, w, b in self.scorers)
        self._picker_child = children[("picker", self.picker[0])][0]

    # --- the decision ------------------------------------------------------------------------------

    def pick(self, state: Any, backend: Any, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        t_start = perf_counter_ns()
        sink = getattr(self.runtime, "metrics_sink", None)
        if sink is not None and self._children is None:
            self._bind_metrics(sink)
        pending = sink.pending if sink is not None else None
        children = self._children if sink is not None else None
        request = state.request
        ctx = SchedulingContext(state, backend, request, self.runtime, backend.endpoint_labels, self.name)
        explain: dict[str, Any] | None = None
        if self.explain:
            explain = {"request_id": state.request_id, "token": state.token,
                       "route": state.route.name if state.route is not None else None, "backend": backend.name,
                       "model": request.model if request is not None else None, "profile": self.name,
                       "candidates": list(endpoints), "filters": [], "scorers": []}
        trace = state.attrs.get(TRACE_ATTR)  # extproc/tracing.py: only a sampled request of a traced config has one
        span = trace.decision_start(self.name, backend.name, len(endpoints)) if trace is not None else None
        picks: tuple[str, ...] = ()
        try:
            candidates = endpoints if endpoints.__class__ is tuple else tuple(endpoints)
            for name, f, child in self._run_filters:
                t0 = perf_counter_ns()
                try:
                    kept = f.filter(ctx, candidates)
                    if kept is candidates:
                        out = candidates
                    else:
                        cls = kept.__class__
                        if cls is tuple or cls is list:
                            if len(kept) == len(candidates) and (cls is tuple and kept == candidates
                                                                  or cls is list and tuple(kept) == candidates):
                                out = candidates  # kept everyone, in order: the intersection is the input
                            else:
                                keep = set(kept)
                                out = tuple([e for e in candidates if e in keep])
                        else:
                            keep = kept if isinstance(kept, (set, frozenset, dict)) else set(kept)
                            out = tuple([e for e in candidates if e in keep])
                except Exception:
                    self._failed(name, "filter", pending, children)
                    out = candidates
                if pending is not None:
                    pending.observe(child, (perf_counter_ns() - t0) * 1e-9)
                if explain is not None:
                    explain["filters"].append({"plugin": name, "kept": list(out)})
                candidates = out
                if not candidates:
                    priority = getattr(request, "priority", None)
                    sheddable = isinstance(priority, int) and priority < 0
                    if explain is not None:
                        explain.update(pick=None, fallbacks=[],
                                       refused="overloaded" if sheddable else "no_capacity")
                    raise NoCapacity(self.name, backend.name, name, len(endpoints), sheddable, priority)
            acc = [0.0] * len(candidates)  # each candidate's total, in candidate order
            for name, scorer, weight, bounded, child in self._run_scorers:
                t0 = perf_counter_ns()
                norm = None
                try:
                    raw = scorer.score(ctx, candidates)
                    if explain is not None or not accumulate(acc, raw, candidates, weight, bounded):
                        norm = normalise(raw, candidates, bounded)  # explained, or not all plain numbers
                        for i, e in enumerate(candidates):
                            acc[i] += weight * norm[e]
                    ok = True
                except Exception:
                    self._failed(name, "scorer", pending, children)
                    raw = norm = None
                    ok = False
                if pending is not None:
                    pending.observe(child, (perf_counter_ns() - t0) * 1e-9)
                if explain is not None:
                    explain["scorers"].append({
                        "plugin": name, "weight": weight, "bounded": bounded, "failed": not ok,
                        "raw": {e: _jsonable(raw.get(e)) for e in candidates} if ok else None,
                        "normalised": norm})
            name, picker = self.picker
            ranked = self._ranked
            totals = None if ranked is not None and explain is None else dict(zip(candidates, acc))
            t0 = perf_counter_ns()
            try:
                picks = tuple(ranked(ctx, candidates, acc) if ranked is not None else picker.pick(ctx, totals))
            except Exception:
                self._failed(name, "picker", pending, children)
                picks = candidates
            if pending is not None:
                pending.observe(self._picker_child, (perf_counter_ns() - t0) * 1e-9)
            if explain is not None:
                explain.update(total=totals, pick=picks[0] if picks else None, fallbacks=list(picks[1:]))
            if picks and self.hooks:
                for name, slot, hook in self.hooks:
                    try:
                        hook(ctx, picks[0])
                    except Exception:
                        self._failed(name, slot, pending, children, "its picked() hook failed; the pick stands")
            return picks
        except NoCapacity as e:
            if span is not None:
                trace.decision_end(span, None, e)
                span = None
            raise
        finally:
            if span is not None:
                trace.decision_end(span, picks, None)
            if pending is not None:
                pending.observe(self._decision_child, (perf_counter_ns() - t_start) * 1e-9)
            if explain is not None:
                state.attrs["decision"] = explain
                if decision_log.isEnabledFor(logging.INFO):
                    decision_log.info(orjson.dumps(explain).decode())

    def _failed(self, plugin: str, slot: str, pending: Any, children: Any, what: str | None = None) -> None:
        if pending is not None:
            pending.inc(children[(slot, plugin)][1])
        key = (plugin, slot)
        if key not in self._logged:
            self._logged.add(key)
            what = what or {"filter": "it keeps every candidate", "scorer": "it scores 0 for every candidate",
                            "picker": "the filtered candidates go in their order"}[slot]
            log.exception("scheduling profile %r: %s %r failed; %s (logged once until the next reload)",
                          self.name, slot, plugin, what)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v if math.isfinite(v) else str(v)
    return None if v is None else str(v)


__all__ = ["SchedulingProfile", "normalise"]
