"""Decisions on a recorded fleet state, replayed: the same picks (and the same totals) as when recorded.

The fixture (tests/data/decisions/replay.json) was recorded from the code before the decision was
optimised (see its `recorded_at`): for each profile of perf/bench_routing.py that has scorers
(`adapter-gateway`: saturation-filter, share-cap-filter, prefix-cache-scorer, predicted-ttft-scorer,
in-flight-scorer, lora-affinity-scorer, max-score-picker; `epp-default`: queue, KV and prefix
scorers), the gateway config over bench_routing's 8-endpoint fleet, a schedule of engine samples
(queue, KV use, LoRA adapters; some endpoints saturated at times), and requests (shared-prefix
prompts, base-model and LoRA requests), replayed the way perf/bench_decision.py runs them: each pick
counted in the in-flight table, the 4th-oldest held request then gets its first token and ends. The
max-score picker's tie-break generator is seeded, so the run is deterministic. Every decision's picks
(pick + fallbacks) must equal the recorded ones, and with `explain` on every candidate's total must
equal the recorded total within 1e-12. The prefix index, the share-cap history and the in-flight
table all depend on earlier picks, so one diverging decision shows in many later ones.
Re-record (only when a plugin's formula changes on purpose):
    .venv/bin/python -m tests.extproc.scheduling.test_decision_replay record
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc.config.loader import load_text
from extproc.datalayer.engine_metrics import parse_metrics
from extproc.metrics import ProcessorMetrics
from extproc.request import parse_openai
from extproc.runtime import Runtime
from extproc.scheduling import NoCapacity
from extproc.scheduling.signals import EngineSignals
from extproc.stages.dispatch import dispatched, prefilled, release
from extproc.stream import ConfigRef, ExtProcService
from extproc.types import Outcome, RequestState
from tests.extproc.scheduling.signal_fleet import Clock

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "data" / "decisions" / "replay.json"
SIMULATOR = ROOT / "tests" / "data" / "metrics" / "simulator.txt"
IN_FLIGHT = 4
SEED = 20261201


# --- the recording's inputs (used only to record) ---------------------------------------------------

def _configs() -> dict[str, dict]:
    sys.path.insert(0, str(ROOT / "perf"))
    import bench_routing as br

    fleet = [(node, None, 9000 + i) for i, node in enumerate(br.FLEET)]
    return {p: br.gateway_config(p, fleet) for p in ("adapter-gateway", "epp-default")}


def _words(rng: random.Random, n: int) -> str:
    vocab = ["alpha", "beta", "gamma", "delta", "kv", "cache", "route", "token", "prefill", "decode", "gpu",
             "tenant", "adapter", "queue", "batch", "latency", "model", "sql", "chat", "vector"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _inputs(endpoints: list[str], model: str) -> dict[str, Any]:
    rng = random.Random(SEED)
    systems = [_words(rng, rng.randint(250, 600)) for _ in range(10)]
    requests = []
    for _ in range(240):
        r = rng.random()
        requests.append({"system": rng.randrange(len(systems)), "question": _words(rng, rng.randint(5, 60)),
                         "model": model if r < 0.7 else ("finance-lora" if r < 0.85 else "sql-lora"),
                         "max_tokens": rng.choice([32, 128, 512, 2048]),
                         "priority": -1 if rng.random() < 0.2 else 0})
    schedule = []
    for at in range(0, len(requests), 30):
        samples = {}
        for e in endpoints:
            samples[e] = {"queue": rng.choice([0, 0, 1, 2, 3, 5]), "kv_usage": round(rng.uniform(0.0, 1.0), 4),
                          "lora_running": rng.choice([[], ["finance-lora"], ["sql-lora"], ["finance-lora", "sql-lora"]]),
                          "lora_waiting": rng.choice([[], ["sql-lora"]]), "max_lora": rng.choice([1, 2, 4])}
        schedule.append({"at": at, "samples": samples})
    # every endpoint saturated for a few requests: refusals (429 for the sheddable, 503 for the others)
    schedule.append({"at": 121, "samples": {e: {"queue": 9, "kv_usage": 0.5, "lora_running": [], "lora_waiting": [],
                                                "max_lora": 1} for e in endpoints}})
    schedule.append({"at": 127, "samples": schedule[4]["samples"]})
    schedule.sort(key=lambda s: s["at"])
    return {"systems": systems, "requests": requests, "schedule": schedule, "model": model}


# --- the replay --------------------------------------------------------------------------------------

def replay(config: dict, inputs: dict, explain: bool, state_dir: str) -> list[dict]:
    """Every request's decision: {"picks": [...]} or {"refused": reason}, plus {"total": {...}} when
    `explain` (the profile's own explanation)."""
    config = json.loads(json.dumps(config))
    if explain:
        for prof in config["spec"]["schedulingProfiles"]:
            prof["explain"] = True
    snap = load_text(json.dumps(config), "replay.yaml")
    rt = Runtime(state_dir=state_dir)
    ExtProcService(ConfigRef(snap), ProcessorMetrics(CollectorRegistry()), runtime=rt)  # metrics sink on
    route = next(iter(snap.routes.values()))
    backend = snap.backends["pool"]
    endpoints = tuple(backend.endpoint_ids)
    base = dataclasses.replace(parse_metrics("vllm", SIMULATOR.read_text()), models=(inputs["model"],))
    clock = Clock()
    sig = EngineSignals(clock=clock, inflight=rt.inflight.get)
    sig.update({e: (f"http://{e}/metrics", "vllm") for e in endpoints})
    rt.signals = sig
    sched = rt.plugin(route.picker)
    sched.picker[1].rng = random.Random(SEED)
    schedule = {s["at"]: s["samples"] for s in inputs["schedule"]}
    held: deque = deque()
    out = []
    try:
        for i, r in enumerate(inputs["requests"]):
            if i in schedule:
                for e, s in schedule[i].items():
                    st = sig._states[e]
                    st.interval = 0.2
                    st.sample = dataclasses.replace(base, queue=s["queue"], kv_usage=s["kv_usage"],
                                                    lora_running=tuple(s["lora_running"]),
                                                    lora_waiting=tuple(s["lora_waiting"]), max_lora=s["max_lora"])
                    st.scraped_at = clock.t
            state = RequestState(snapshot=snap, route=route, started=0.0, request_id=f"r{i}", runtime=rt)
            state.request = parse_openai("/v1/chat/completions", {
                "model": r["model"], "max_tokens": r["max_tokens"], "stream": True,
                "priority": r["priority"],
                "messages": [{"role": "system", "content": inputs["systems"][r["system"]]},
                             {"role": "user", "content": r["question"]}]})
            try:
                picks = sched.pick(state, backend, endpoints)
            except NoCapacity as e:
                out.append({"refused": "overloaded" if e.sheddable else "no_capacity"})
                continue
            rec: dict[str, Any] = {"picks": list(picks)}
            if explain:
                rec["total"] = state.attrs["decision"]["total"]
            out.append(rec)
            if picks:
                dispatched(state, picks[0])
                held.append(state)
                if len(held) > IN_FLIGHT:
                    old = held.popleft()
                    old.first_body = 1.0
                    prefilled(old)
                    release(old, Outcome.OK)
    finally:
        for inst in list(rt._plugins.values()):
            close = getattr(inst, "close", None)
            if close is not None:
                close()
    return out


def record() -> None:
    import datetime as dt
    import subprocess
    import tempfile

    configs = _configs()
    snap = load_text(json.dumps(configs["adapter-gateway"]), "replay.yaml")
    endpoints = list(snap.backends["pool"].endpoint_ids)
    import bench_routing as br  # on the path since _configs()

    inputs = _inputs(endpoints, br.MODEL)
    doc: dict[str, Any] = {
        "recorded_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "code": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                               cwd=ROOT).stdout.strip(),
        "inputs": inputs, "profiles": {}}
    for policy, cfg in configs.items():
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            plain = replay(cfg, inputs, False, a)
            explained = replay(cfg, inputs, True, b)
        assert [d.get("picks") for d in plain] == [d.get("picks") for d in explained], policy
        doc["profiles"][policy] = {"config": cfg, "decisions": explained}
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE}")


# --- the tests ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(FIXTURE.read_text())


def test_the_recording_exercises_ties_refusals_filters_and_several_endpoints(recorded):
    # a recording where every decision is the same would not catch a changed decision
    for policy, prof in recorded["profiles"].items():
        picks = [d["picks"][0] for d in prof["decisions"] if "picks" in d]
        assert len(set(picks)) >= 4, policy
    ag = recorded["profiles"]["adapter-gateway"]["decisions"]
    tops = [sorted(d["total"].values())[-2:] for d in ag if len(d.get("total", ())) > 1]
    assert sum(1 for a, b in tops if a == b) > 0  # equal best totals: the seeded tie-break matters
    assert any(len(d.get("total", ())) < 8 for d in ag)  # filters removed candidates
    assert {d.get("refused") for d in ag} >= {"overloaded", "no_capacity"}  # nothing left: both refusals


@pytest.mark.parametrize("policy", ["adapter-gateway", "epp-default"])
@pytest.mark.parametrize("explain", [False, True])
def test_replayed_decisions_equal_the_recorded_ones(recorded, policy, explain, tmp_path):
    prof = recorded["profiles"][policy]
    got = replay(prof["config"], recorded["inputs"], explain, str(tmp_path))
    want = prof["decisions"]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.get("picks") == w.get("picks") and g.get("refused") == w.get("refused"), (i, g, w)
        if explain and "total" in w:
            assert g["total"].keys() == w["total"].keys(), i
            for e, v in w["total"].items():
                assert abs(g["total"][e] - v) <= 1e-12, (i, e, g["total"][e], v)


if __name__ == "__main__" and sys.argv[1:] == ["record"]:
    record()
