"""Process-level lifecycle: the real `adapterctl up` and `adapterctl serve` as subprocesses.

- SIGHUP to `up` with a valid changed file: every worker reports the new generation (`GET /config`
  and `adapter_processor_worker_config_info` on the processor's `/metrics`, parsed) and Envoy's
  traffic gets the new config; with a broken file: the refusal is logged once with file:line, the
  generation stays, traffic is still served; a worker killed then restarts on the last accepted
  generation, not on the broken file.
- SIGHUP to `serve`: a refusal (logged once, no generation used up), then an accepted reload.
- A second SIGINT/SIGTERM to `up` and to `serve` while the first stop waits for a draining
  stream: exit 130 at once, nothing left behind; `up` stopped Envoy before the processor.
- `kill -9` of `up`: Envoy, the workers (a restarted one included) and the simulator all exit
  (PR_SET_PDEATHSIG).
- Worker restart backoff (growing delays, from the supervisor's log and `GET /config`) and the
  supervisor's `/healthz`: 503 while a worker is dead, 200 once it is back.

Every wait is a poll on a condition with a generous deadline; every process started here is
stopped by PID at the end.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack import free_port, free_port_block
from tests.conftest import REPO
from tests.integration.test_servicer import recorded

DEADLINE = 60.0  # generous: 2 shared cores; every wait returns as soon as its condition holds
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: lifecycle}}
spec:
  modelRef: qwen2.5-finance
  processor: {{basePort: {base}, adminPort: {padmin}, workers: 2, shutdownGrace: {grace}}}
  backends:
    - {{name: llm, endpoints: ["llm.invalid:8000"]}}
  routes:
    - path: /v1/analyze
      target: llm
      transform: '{{"voucher": {{"amount": $.output.amount, "{key}": $.output.account}}}}'
"""
BROKEN = "  nonsense: 1\n"  # appended under spec: an unknown field
BROKEN_LINE = len(CONFIG.splitlines()) + 1


# -- helpers ---------------------------------------------------------------------------------

def ports() -> dict[str, int]:
    """Free ports for the listener, Envoy admin, processor admin and a block of 2 workers, all distinct."""
    while True:
        p = {"listen": free_port(), "admin": free_port(), "padmin": free_port(), "base": free_port_block(2)}
        used = [p["listen"], p["admin"], p["padmin"], p["base"], p["base"] + 1]
        if len(set(used)) == len(used):
            return p


def write_config(path: Path, p: dict[str, int], key: str = "account", grace: str = "5s", broken: bool = False) -> Path:
    path.write_text(CONFIG.format(key=key, grace=grace, **p) + (BROKEN if broken else ""))
    return path


def starttime(pid: int) -> int | None:
    """A process's start time (field 22 of /proc/PID/stat), None when gone or a zombie: with the
    PID it names one process, so a reused PID is never mistaken for it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def descendants(pid: int) -> dict[int, int]:
    """Every process below `pid` (recursively, from /proc/PID/task/*/children): {pid: start time}."""
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except FileNotFoundError:
                continue
            for k in kids:
                st = starttime(k)
                if st is not None and k not in found:
                    found[k] = st
                    todo.append(k)
    return found


def survivors(pids: dict[int, int]) -> list[int]:
    return [p for p, st in pids.items() if starttime(p) == st]


class Proc:
    """`python -m extproc ARGS` (what `adapterctl` runs), stdout and stderr in files under tmp_path."""

    def __init__(self, tmp_path: Path, name: str, *args: str):
        self.out_path, self.err_path = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.popen = subprocess.Popen([sys.executable, "-m", "extproc", *args], stdout=out, stderr=err, cwd=REPO)
        self.pid = self.popen.pid
        self.children: dict[int, int] = {}  # descendants seen by the test: killed by PID if they outlive it

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def track(self) -> dict[int, int]:
        self.children.update(descendants(self.pid))
        return dict(self.children)


def wait_for(cond, what: str, proc: Proc | None = None, timeout: float = DEADLINE):
    """Poll `cond()` until it is truthy (returned); fail at the deadline, or at once if `proc` exits."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and proc.popen.poll() is not None:
            pytest.fail(f"{what}: the process exited with {proc.popen.returncode}\n{proc.out}\n{proc.err}")
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g}s: {what}" + (f"\n{proc.err}" if proc else ""))
        time.sleep(0.02)


@pytest.fixture
def start(tmp_path):
    """Start `python -m extproc ...` processes; each, and every descendant the test saw, is stopped by PID."""
    started: list[Proc] = []

    def run(name: str, *args: str) -> Proc:
        p = Proc(tmp_path, name, *args)
        started.append(p)
        return p

    yield run
    for p in started:
        if p.popen.poll() is None:
            p.popen.terminate()
            try:
                p.popen.wait(30)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        for pid in survivors(p.children):  # only those the test already failed on, or never reached
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_up(start, cfg: Path, p: dict[str, int]) -> Proc:
    up = start("up", "up", str(cfg), "--simulate", "--port", str(p["listen"]), "--admin-port", str(p["admin"]))
    wait_for(lambda: "Ctrl-C stops everything" in up.out, "`adapterctl up` printed that it is up", up)
    up.track()
    return up


def start_serve(start, cfg: Path, p: dict[str, int]) -> Proc:
    serve = start("serve", "serve", str(cfg))
    wait_for(lambda: "processor: 2 worker(s)" in serve.out, "`adapterctl serve` printed that it is up", serve)
    serve.track()
    return serve


def admin(p: dict[str, int]) -> str:
    return f"http://127.0.0.1:{p['padmin']}"


def config_state(p: dict[str, int]) -> dict:
    return httpx.get(f"{admin(p)}/config", timeout=10).json()


def metrics(p: dict[str, int]) -> dict[str, list]:
    """The processor admin's /metrics, parsed: {family name: [samples]}."""
    text = httpx.get(f"{admin(p)}/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def worker_info(p: dict[str, int]) -> set[tuple[str, str, str]]:
    """`adapter_processor_worker_config_info`: {(worker, generation, digest)} of the series with value 1."""
    return {(s.labels["worker"], s.labels["generation"], s.labels["digest"])
            for s in metrics(p)["adapter_processor_worker_config_info"] if s.value == 1}


def reload_counts(p: dict[str, int]) -> dict[str, float]:
    return {s.labels["result"]: s.value for s in metrics(p)["adapter_processor_config_reloads"]
            if s.name == "adapter_processor_config_reloads_total"}


def on_generation(p: dict[str, int], generation: int):
    """`GET /config` once every worker is alive, ready and on `generation`, else None."""
    try:
        state = config_state(p)
    except httpx.HTTPError:
        return None
    ok = all(w["alive"] and w["ready"] and w["generation"] == generation for w in state["workers"])
    return state if ok and state["generation"] == generation else None


def analyze(p: dict[str, int]) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{p['listen']}/v1/analyze", content=b'{"query": "q"}', timeout=30)


def refusals(err: str) -> list[tuple[str, str]]:
    """Each refusal the supervisor logged: (its first line, the next line: the first issue)."""
    lines = err.splitlines()
    return [(line, lines[i + 1] if i + 1 < len(lines) else "") for i, line in enumerate(lines)
            if "config reload refused" in line]


def health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="envoy.service.ext_proc.v3.ExternalProcessor"), timeout=5).status
        except grpc.RpcError:
            return -1


class OpenStream:
    """An ext_proc stream to one worker, left open after the request headers (a request in flight)."""

    def __init__(self, port: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.outgoing: queue.Queue = queue.Queue()
        self.replies = pb_grpc.ExternalProcessorStub(self.channel).Process(
            iter(self.outgoing.get, None), metadata=(("x-adapter-route", "v1-analyze"),))
        self.outgoing.put(recorded("v1-analyze-rec-llm-ok.txtpb")[0])
        next(self.replies)  # the worker answered the headers: the stream is open on it

    def close(self) -> None:
        self.outgoing.put(None)
        self.channel.close()


def healthz(p: dict[str, int]) -> int:
    try:
        return httpx.get(f"{admin(p)}/healthz", timeout=10).status_code
    except httpx.HTTPError:
        return -1


# -- SIGHUP ------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_sighup_to_up_reloads_refuses_a_broken_file_and_a_restarted_worker_keeps_the_last_good(tmp_path, start):
    p = ports()
    cfg = write_config(tmp_path / "gw.yaml", p)
    up = start_up(start, cfg, p)
    first = wait_for(lambda: on_generation(p, 1), "both workers on generation 1", up)
    assert set(analyze(p).json()["voucher"]) == {"amount", "account"}

    # a valid change: both workers move to generation 2, and Envoy's traffic gets it
    write_config(cfg, p, key="acct")
    up.signal(signal.SIGHUP)
    line = wait_for(lambda: re.search(r"config reload accepted: generation 2 \(digest ([0-9a-f]+)\); "
                                      r"workers 0=2 1=2\n", up.err), "the accepted reload's line", up)
    digest = line.group(1)
    state = wait_for(lambda: on_generation(p, 2), "both workers on generation 2", up)
    assert state["digest"] == digest != first["digest"]
    assert [(w["generation"], w["digest"]) for w in state["workers"]] == [(2, digest)] * 2
    assert [w["pid"] for w in state["workers"]] == [w["pid"] for w in first["workers"]]  # reloaded in place
    assert worker_info(p) == {("0", "2", digest), ("1", "2", digest)}
    assert [s.value for s in metrics(p)["adapter_processor_config_accepted_generation"]] == [2]
    assert reload_counts(p) == {"accepted": 1, "refused": 0}
    assert set(analyze(p).json()["voucher"]) == {"amount", "acct"}

    # a broken file: refused once with file:line, nothing changes, traffic still served
    write_config(cfg, p, key="broken", broken=True)
    up.signal(signal.SIGHUP)
    wait_for(lambda: refusals(up.err), "the refusal in the log", up)
    where = f"{cfg}:{BROKEN_LINE}: spec.nonsense: unknown field"
    [(head, issue)] = refusals(up.err)
    assert head.endswith(f"ERROR extproc.supervisor: config reload refused, keeping generation 2 (digest {digest}):")
    assert issue.startswith(where), issue
    after = config_state(p)
    assert after["generation"] == 2 and after["digest"] == digest
    assert after["reloads"] == {"accepted": 1, "refused": 1}
    assert any(where in i for i in after["last_refusal"]["issues"])
    # the workers kept what they had: same processes, same generation, nothing changed since the accepted reload
    assert [(w["pid"], w["generation"], w["digest"], w["changed_at"]) for w in after["workers"]] == \
        [(w["pid"], w["generation"], w["digest"], w["changed_at"]) for w in state["workers"]]
    assert worker_info(p) == {("0", "2", digest), ("1", "2", digest)}
    assert reload_counts(p) == {"accepted": 1, "refused": 1}
    assert set(analyze(p).json()["voucher"]) == {"amount", "acct"}
    assert len(refusals(up.err)) == 1 and "config reload accepted: generation 3" not in up.err

    # worker 0 killed while the file is broken: restarted on generation 2's bundle
    victim = after["workers"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    state = wait_for(lambda: (s := on_generation(p, 2)) and s["workers"][0]["pid"] != victim and s,
                     "worker 0 restarted and ready", up)
    reborn = state["workers"][0]
    assert (reborn["restarts"], reborn["digest"]) == (1, digest)
    assert re.search(rf"worker 0 \(pid {victim}\) exited with -9; restarting in [\d.]+s on generation 2\n", up.err)
    assert worker_info(p) == {("0", "2", digest), ("1", "2", digest)}
    up.track()

    # through Envoy: the restarted worker answers (once Envoy's health check has it back), on generation 2
    def answered_by_reborn():
        r = httpx.get(f"http://127.0.0.1:{p['listen']}/health/adapter?probe=processor", timeout=10)
        return r.status_code == 200 and r.json()["processor"]["pid"] == reborn["pid"] and r.json()["processor"]
    proc = wait_for(answered_by_reborn, "a health probe through Envoy answered by the restarted worker", up)
    assert (proc["generation"], proc["digest"]) == (2, digest)
    replies = [analyze(p) for _ in range(20)]
    assert [(r.status_code, set(r.json()["voucher"])) for r in replies] == [(200, {"amount", "acct"})] * 20
    assert len(refusals(up.err)) == 1


def test_sighup_to_serve_refuses_a_broken_file_then_accepts_the_fixed_one(tmp_path, start):
    p = ports()
    cfg = write_config(tmp_path / "gw.yaml", p)
    serve = start_serve(start, cfg, p)
    first = wait_for(lambda: on_generation(p, 1), "both workers on generation 1", serve)
    d1 = first["digest"]
    assert worker_info(p) == {("0", "1", d1), ("1", "1", d1)}

    write_config(cfg, p, key="acct", broken=True)
    serve.signal(signal.SIGHUP)
    wait_for(lambda: refusals(serve.err), "the refusal in the log", serve)
    [(head, issue)] = refusals(serve.err)
    assert head.endswith(f"ERROR extproc.supervisor: config reload refused, keeping generation 1 (digest {d1}):")
    assert issue.startswith(f"{cfg}:{BROKEN_LINE}: spec.nonsense: unknown field"), issue
    state = config_state(p)
    assert state["generation"] == 1 and state["reloads"] == {"accepted": 0, "refused": 1}
    assert [(w["pid"], w["generation"], w["digest"], w["changed_at"]) for w in state["workers"]] == \
        [(w["pid"], w["generation"], w["digest"], w["changed_at"]) for w in first["workers"]]
    assert worker_info(p) == {("0", "1", d1), ("1", "1", d1)}
    assert reload_counts(p) == {"accepted": 0, "refused": 1}
    assert healthz(p) == 200
    assert "config reload accepted" not in serve.err

    # fixed: the refusal used up no generation, so this one is 2, on both workers
    write_config(cfg, p, key="acct")
    serve.signal(signal.SIGHUP)
    line = wait_for(lambda: re.search(r"config reload accepted: generation 2 \(digest ([0-9a-f]+)\); "
                                      r"workers 0=2 1=2\n", serve.err), "the accepted reload's line", serve)
    d2 = line.group(1)
    state = wait_for(lambda: on_generation(p, 2), "both workers on generation 2", serve)
    assert d2 != d1 and state["digest"] == d2
    assert [w["pid"] for w in state["workers"]] == [w["pid"] for w in first["workers"]]
    assert worker_info(p) == {("0", "2", d2), ("1", "2", d2)}
    assert reload_counts(p) == {"accepted": 1, "refused": 1}
    assert len(refusals(serve.err)) == 1


# -- stopping: a second signal, kill -9 -------------------------------------------------------

@pytest.mark.e2e
def test_a_second_sigint_to_up_while_it_stops_exits_130_and_envoy_went_first(tmp_path, start):
    p = ports()
    cfg = write_config(tmp_path / "gw.yaml", p, grace="300s")  # the first stop waits on the open stream
    up = start_up(start, cfg, p)
    wait_for(lambda: on_generation(p, 1), "both workers on generation 1", up)
    children = up.track()
    [envoy] = [pid for pid in children if "envoy" in cmdline(pid).split()[0]]
    stream = OpenStream(p["base"])
    try:
        up.signal(signal.SIGINT)
        # the first stop is under way: the workers were told (worker 0 drains its stream); Envoy already stopped
        wait_for(lambda: health(p["base"]) == NOT_SERVING, "worker 0 draining (NOT_SERVING)", up)
        assert starttime(envoy) is None, "the processor was stopped before Envoy"
        assert up.popen.poll() is None  # still waiting for worker 0's drain
        up.signal(signal.SIGINT)
        assert up.popen.wait(DEADLINE) == 130
    finally:
        stream.close()
    assert "second signal: forcing exit" in up.err
    wait_for(lambda: not survivors(children), f"no process left of {sorted(children)}")


def test_a_second_sigterm_to_serve_while_it_stops_exits_130(tmp_path, start):
    p = ports()
    cfg = write_config(tmp_path / "gw.yaml", p, grace="300s")
    serve = start_serve(start, cfg, p)
    wait_for(lambda: on_generation(p, 1), "both workers on generation 1", serve)
    children = serve.track()
    assert len(children) == 2
    stream = OpenStream(p["base"])
    try:
        serve.signal(signal.SIGTERM)
        wait_for(lambda: health(p["base"]) == NOT_SERVING, "worker 0 draining (NOT_SERVING)", serve)
        assert serve.popen.poll() is None
        serve.signal(signal.SIGTERM)
        assert serve.popen.wait(DEADLINE) == 130
    finally:
        stream.close()
    assert "second signal: forcing exit" in serve.err
    wait_for(lambda: not survivors(children), f"no worker left of {sorted(children)}")


@pytest.mark.e2e
def test_kill_9_of_up_leaves_no_process_behind(tmp_path, start):
    p = ports()
    cfg = write_config(tmp_path / "gw.yaml", p)
    up = start_up(start, cfg, p)
    first = wait_for(lambda: on_generation(p, 1), "both workers on generation 1", up)
    # one worker restarted first: spawned by the supervisor's monitor thread, not the main one
    victim = first["workers"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: (s := on_generation(p, 1)) and s["workers"][0]["pid"] != victim, "worker 0 restarted", up)
    children = up.track()
    kinds = sorted("envoy" if "envoy" in cmdline(c).split()[0] else
                   "worker" if " worker " in cmdline(c) else
                   "simulator" if "backends.simulator_openai" in cmdline(c) else cmdline(c)
                   for c in survivors(children))
    assert kinds == ["envoy", "simulator", "worker", "worker"], kinds
    os.kill(up.pid, signal.SIGKILL)
    assert up.popen.wait(DEADLINE) == -signal.SIGKILL
    wait_for(lambda: not survivors(children),
             f"no process left of {sorted(children)} (left: {[cmdline(c) for c in survivors(children)]})")


# -- restarts -----------------------------------------------------------------------------------

def test_worker_restart_backoff_grows_and_healthz_is_503_while_a_worker_is_dead(tmp_path, start):
    p = ports()
    cfg = write_config(tmp_path / "gw.yaml", p)
    serve = start_serve(start, cfg, p)
    state = wait_for(lambda: on_generation(p, 1), "both workers on generation 1", serve)
    assert healthz(p) == 200
    other = state["workers"][1]["pid"]
    killed, outages = [], []
    for n in range(1, 5):
        victim = state["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)
        t0 = time.monotonic()
        wait_for(lambda: healthz(p) == 503, f"kill {n}: /healthz non-200 while worker 0 is dead", serve)
        if n == 4:  # the longest wait: what else shows the dead worker
            dead = config_state(p)["workers"][0]
            assert (dead["pid"], dead["alive"]) == (victim, False)
            assert {w for w, _, _ in worker_info(p)} == {"1"}
        wait_for(lambda: healthz(p) == 200, f"kill {n}: /healthz 200 again", serve)
        outages.append(time.monotonic() - t0)
        state = wait_for(lambda: (s := on_generation(p, 1)) and s["workers"][0]["pid"] != victim and s,
                         f"kill {n}: worker 0 restarted and ready", serve)
        assert state["workers"][0]["restarts"] == n
        serve.track()
    logged = re.findall(r"worker 0 \(pid (\d+)\) exited with (-?\d+); restarting in ([\d.]+)s on generation 1\n",
                        serve.err)
    assert [(int(pid), int(code)) for pid, code, _ in logged] == [(pid, -signal.SIGKILL) for pid in killed]
    delays = [float(d) for _, _, d in logged]
    assert delays[0] == 0.4 and all(a < b for a, b in zip(delays, delays[1:])), delays  # docs: 0.4 s up to 5 s
    # the supervisor waited longer each time, not only said so (the delays differ by 0.4 s and more)
    assert outages == sorted(outages), (delays, outages)
    final = config_state(p)
    assert (final["workers"][1]["pid"], final["workers"][1]["restarts"]) == (other, 0)
    assert "worker 1" not in serve.err
