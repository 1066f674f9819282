"""Sandboxed preload of an adapter bundle: compile it with the config and run its golden requests, in a
subprocess with resource limits, no network and a time limit, before any request can use it.

What: `preload(config_path, candidate, loaded=(), endpoints=None, limits=SandboxLimits(), declared=())`
runs, in a child process, what the supervisor would publish with the candidate added (the config file compiled
with the bundles loaded before and the candidate last: `extproc.config.loader.load_text(...,
loaded=...)`), then every golden case of the candidate (`canary.bundle.adapter_contents`) through the
route's compiled stages in process: `parse-json` -> `encode-request` (the backend body; compared with
`backendRequest` when given: every key given must be equal) -> the case's `output` wrapped as an OpenAI
chat answer (or its raw `backendResponse`) -> `decode-response` (the client body, compared exactly with
`response`, and the status). No backend, no network. The answer is a `PreloadResult`: `ok`, and else
`problems` (file, field, reason: a refused bundle.yaml, a template error, a config issue) or the golden
cases that failed, each with a unified diff of expected and actual JSON. A bundle passes only if it
compiles, names only routes the config has, carries at least one golden case per route it names, and
every case passes. `declared`: bundles the config file itself names (`spec.bundles[].path`) that the
accepted generation does not hold yet get the same checks (the supervisor runs them before a reload
or its first generation publishes them; `candidate` None).
`run_sandboxed(target, payload, limits)` is the sandbox itself, for any `module:function` taking and
returning JSON: the child is `python -I` (no PYTHONPATH, no user site), its own session, cwd and TMPDIR
a fresh temporary directory (removed after), a minimal environment, and before the target runs:
  RLIMIT_CPU     limits.cpu_seconds (the kernel sends SIGXCPU, then SIGKILL)
  RLIMIT_AS      limits.address_space bytes (allocation beyond fails: MemoryError, reported as memory)
  RLIMIT_NOFILE  limits.open_files;  RLIMIT_CORE 0 (no core dumps);  RLIMIT_FSIZE limits.file_bytes
  network        `unshare -n` when run as root (or `unshare -rn`, a user namespace, where the kernel allows
                 it): a network namespace with no interface up, so no socket reaches anything; otherwise
                 (`limits.network="guard"`, or neither works) a Python audit hook refusing every
                 socket.__new__/connect/bind/getaddrinfo, which code in C extensions could get around.
                 `SandboxResult.network` says which was enforced.
  wall clock     limits.wall_seconds: the whole process group is killed (SIGKILL) at the deadline.
Refusals are classified (`kind`): timeout, cpu, memory, crash (a signal or non-zero exit, stderr's tail
kept), error (the target raised: its message), bad_output.
What is not isolated: the filesystem (the child can read what the supervisor's user can; it writes in
its temporary directory, files capped by RLIMIT_FSIZE), other processes' signals (same user). Bundles
are declarative (templates and schemas, no code), so the sandbox bounds the compiler and the template
engine on hostile input rather than running bundle code.
Parameters: `SandboxLimits(cpu_seconds=10, address_space=1 GiB, open_files=64, file_bytes=64 MiB,
wall_seconds=20, network="auto")`.
Cost: one Python start plus the config compile plus the golden cases: about 0.3 to 1 s here, once per load.
"""

from __future__ import annotations

import difflib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_MARK = "@@adapter-preload-result@@ "


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 10
    address_space: int = 1 << 30
    open_files: int = 64
    file_bytes: int = 64 << 20
    wall_seconds: float = 20.0
    network: str = "auto"  # "auto": a network namespace where possible, else the guard; "guard"; "namespace" (required)


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    kind: str  # ok | timeout | cpu | memory | crash | error | bad_output
    value: Any = None  # what the target returned (JSON), when ok
    error: str = ""
    network: str = ""  # how the network was cut: "namespace (unshare -n)", "namespace (unshare -rn)", "audit hook"
    wall_s: float = 0.0


def network_prefix(mode: str = "auto") -> tuple[list[str], str]:
    """The command prefix that cuts the child's network, and its description; ([], "audit hook") when no
    namespace can be made here (or mode "guard"). Probes by running `unshare ... true` (a few ms)."""
    if mode == "guard":
        return [], "audit hook"
    unshare = shutil.which("unshare")
    candidates = []
    if unshare:
        if os.geteuid() == 0:
            candidates.append(([unshare, "-n"], "namespace (unshare -n)"))
        candidates.append(([unshare, "-rn"], "namespace (unshare -rn)"))
    for prefix, what in candidates:
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=5).returncode == 0:
                return prefix, what
        except (OSError, subprocess.TimeoutExpired):
            continue
    if mode == "namespace":
        raise RuntimeError("no network namespace can be made here (needs root, or unprivileged user namespaces)")
    return [], "audit hook"


def _limit(limits: SandboxLimits):
    def apply() -> None:  # preexec_fn: in the child, before exec
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.address_space, limits.address_space))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    return apply


_CHILD = """
import sys
sys.path.insert(0, {repo!r})
from canary.preload import _child_main
_child_main({target!r}, {guard!r})
"""


def run_sandboxed(target: str, payload: Any, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `target` ("module:function", called with `payload`, returning JSON) in the sandbox."""
    prefix, network = network_prefix(limits.network)
    work = tempfile.mkdtemp(prefix="adapter-preload-")
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [*prefix, sys.executable, "-I", "-c", _CHILD.format(repo=str(REPO), target=target, guard=not prefix)]
    started = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work,
                                env=env, preexec_fn=_limit(limits), start_new_session=True)
        try:
            out, err = proc.communicate(json.dumps(payload).encode(), timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return SandboxResult(False, "timeout", error=f"killed at the wall-clock limit of {limits.wall_seconds:g} s",
                                 network=network, wall_s=time.monotonic() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.monotonic() - started
    text, tail = out.decode("utf-8", "replace"), err.decode("utf-8", "replace").strip()[-2000:]
    code = proc.returncode
    if code < 0:
        sig = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        if -code == signal.SIGXCPU:
            return SandboxResult(False, "cpu", error=f"killed at the CPU limit of {limits.cpu_seconds} s ({sig})",
                                 network=network, wall_s=wall)
        if -code == signal.SIGKILL:  # not ours (the deadline is handled above): the hard CPU limit or the OOM killer
            tail = tail or f"the hard CPU limit ({limits.cpu_seconds + 1} s) or the kernel's OOM killer"
        return SandboxResult(False, "crash", error=f"killed by {sig}" + (f": {tail}" if tail else ""), network=network,
                             wall_s=wall)
    line = next((ln for ln in reversed(text.splitlines()) if ln.startswith(_MARK)), None)
    if line is None:
        if "MemoryError" in tail:
            return SandboxResult(False, "memory", error=f"out of memory at the address-space limit of "
                                 f"{limits.address_space >> 20} MiB", network=network, wall_s=wall)
        return SandboxResult(False, "crash", error=f"exited with code {code}" + (f": {tail}" if tail else ""),
                             network=network, wall_s=wall)
    try:
        doc = json.loads(line[len(_MARK):])
    except ValueError as e:
        return SandboxResult(False, "bad_output", error=f"unreadable result: {e}", network=network, wall_s=wall)
    if doc.get("memory"):
        return SandboxResult(False, "memory", error=f"out of memory at the address-space limit of "
                             f"{limits.address_space >> 20} MiB", network=network, wall_s=wall)
    if "error" in doc:
        return SandboxResult(False, "error", error=doc["error"], network=network, wall_s=wall)
    return SandboxResult(True, "ok", value=doc.get("value"), network=network, wall_s=wall)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the child and what it started
    except ProcessLookupError:
        pass


def _guard_network() -> None:
    """An audit hook (irremovable) refusing sockets: the fallback where no network namespace exists."""
    def hook(event: str, args: Any) -> None:
        if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
                     "socket.gethostbyname", "socket.gethostbyaddr"):
            raise PermissionError(f"network refused in the preload sandbox ({event})")
    sys.addaudithook(hook)


def _child_main(target: str, guard: bool) -> None:
    import importlib

    if guard:
        _guard_network()
    payload = json.loads(sys.stdin.read() or "null")
    module, _, func = target.partition(":")
    try:
        value = getattr(importlib.import_module(module), func)(payload)
        doc: dict[str, Any] = {"value": value}
    except MemoryError:
        doc = {"memory": True}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which refuses the bundle
        doc = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(_MARK + json.dumps(doc, default=str) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------------------------------
# the preload itself


@dataclass(frozen=True)
class GoldenResult:
    case: str
    route: str
    ok: bool
    stage: str = ""  # where it failed: backend-request, status, response
    diff: str = ""


@dataclass(frozen=True)
class PreloadResult:
    ok: bool
    bundle: str = ""  # "<name>@<version>"
    digest: str = ""
    routes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()  # "file: field: reason" lines
    golden: tuple[GoldenResult, ...] = ()
    sandbox: str = ""  # the sandbox's refusal (timeout, memory, ...) when it did not finish
    network: str = ""
    wall_s: float = 0.0

    @property
    def reason(self) -> str:
        """Why it was refused, in lines: problems, the sandbox, then each failed golden case with its diff."""
        lines = list(self.problems)
        if self.sandbox:
            lines.append(f"preload sandbox: {self.sandbox}")
        for g in self.golden:
            if not g.ok:
                lines.append(f"golden case {g.case} (route {g.route}) failed at {g.stage}:\n{g.diff}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["reason"] = self.reason
        return doc


def preload(config_path: str, candidate: str | None, loaded: tuple[str, ...] = (),
            endpoints: dict[str, tuple[tuple[str, int], ...]] | None = None,
            limits: SandboxLimits = SandboxLimits(), declared: tuple[str, ...] = ()) -> PreloadResult:
    """Compile the config with the bundles loaded before and `candidate` (a ZIP loaded now, or None) in
    the sandbox, and run the golden cases of `candidate` and of `declared` (ZIPs the config file's
    `spec.bundles` names, new since the accepted generation): the checks above, for each."""
    payload = {"config": str(Path(config_path).resolve()),
               "candidate": str(Path(candidate).resolve()) if candidate else None,
               "declared": [str(Path(p).resolve()) for p in declared],
               "loaded": [str(Path(p).resolve()) for p in loaded],
               "endpoints": {n: [[h, int(p)] for h, p in eps] for n, eps in (endpoints or {}).items()}}
    r = run_sandboxed("canary.preload:_preload_child", payload, limits)
    if not r.ok:
        return PreloadResult(False, sandbox=f"{r.kind}: {r.error}", network=r.network, wall_s=r.wall_s)
    v = r.value
    return PreloadResult(v["ok"], v.get("bundle", ""), v.get("digest", ""), tuple(v.get("routes", ())),
                         tuple(v.get("problems", ())), tuple(GoldenResult(**g) for g in v.get("golden", ())),
                         network=r.network, wall_s=r.wall_s)


def _preload_child(payload: dict[str, Any]) -> dict[str, Any]:
    """In the sandbox: verify, extract (the seam: what is compiled is what was hashed), compile, run golden."""
    from canary.bundle import BundleError, adapter_contents, load
    from extproc.config.compile import apply_bundle_part
    from extproc.config.loader import ConfigError, load_text, read_config

    candidate = payload["candidate"]
    checked = []  # (path, Bundle, AdapterContents)
    for i, path in enumerate(([candidate] if candidate else []) + payload["declared"]):
        try:
            b = load(path)
            b.extract(Path(os.getcwd()) / f"bundle-{i}")
            checked.append((path, b, adapter_contents(b)))
        except BundleError as e:
            return {"ok": False, "problems": [(f"{Path(path).name}: " if i or not candidate else "") + str(p)
                                              for p in e.problems]}
    refs = [f"{b.manifest.name}@{b.manifest.version}" for _, b, _ in checked]
    endpoints = {n: tuple((h, int(p)) for h, p in eps) for n, eps in payload["endpoints"].items()} or None
    try:
        snap = load_text(read_config(payload["config"]), payload["config"], endpoints=endpoints,
                         loaded=tuple(payload["loaded"]) + ((candidate,) if candidate else ()))
    except ConfigError as e:
        return {"ok": False, "bundle": ", ".join(refs), "problems": [str(i) for i in e.issues]}
    problems: list[str] = []
    golden: list[dict[str, Any]] = []
    routes: set[str] = set()
    for (path, b, contents), ref in zip(checked, refs):
        where = "" if path == candidate else f"{Path(path).name}: "
        missing = [r for r in contents.routes if r not in snap.routes]
        problems += [f"{where}bundle.yaml: routes.{r}: the config has no route {r!r} (routes: "
                     f"{', '.join(n for n in snap.routes if n != 'adapter-health')})" for r in missing]
        covered = {c.route for c in contents.golden}
        problems += [f"{where}golden/: routes.{r}: no golden case for this route (every route a bundle changes "
                     f"needs one: golden/NAME.yaml with route, request, output, response)"
                     for r in contents.routes if r not in covered]
        if missing or problems:
            continue
        bundle = snap.bundles[ref]
        routes |= set(contents.routes)
        for c in contents.golden:
            g = asdict(_run_case(snap, apply_bundle_part(snap.routes[c.route], bundle), c))
            g["case"] = where + g["case"]
            golden.append(g)
    if problems:
        return {"ok": False, "bundle": ", ".join(refs), "problems": problems}
    return {"ok": all(g["ok"] for g in golden), "bundle": ", ".join(refs),
            "digest": ", ".join(b.digest for _, b, _ in checked), "routes": sorted(routes), "golden": golden}


def _run_case(snap: Any, route: Any, case: Any) -> GoldenResult:
    import orjson

    from extproc.stages.decode_response import DecodeResponse
    from extproc.stages.encode_request import EncodeRequest
    from extproc.stages.parse_json import ParseJson
    from extproc.types import HttpMessage, Mutate, Phase, Reject, RequestState

    state = RequestState(snapshot=snap, route=route, started=time.monotonic())
    state.target = route.backend
    body = orjson.dumps(case.request)
    status, actual = 200, None
    v = ParseJson().on_request_body(state, HttpMessage(Phase.REQUEST_BODY, body=body, end_of_stream=True))
    if v is None:
        v = EncodeRequest().on_request_body(state, HttpMessage(Phase.REQUEST_BODY, body=body, end_of_stream=True))
    if isinstance(v, Mutate) and case.backend_request is not None:
        sent = orjson.loads(v.body)
        want = case.backend_request
        got = {k: sent.get(k) for k in want} if isinstance(want, dict) and isinstance(sent, dict) else sent
        if got != want:
            return GoldenResult(case.name, case.route, False, "backend-request", _diff(want, got))
    if isinstance(v, Mutate):
        answer = case.backend_response if case.backend_response is not None else {
            "id": "golden", "object": "chat.completion", "model": route.model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant",
                "content": case.output if isinstance(case.output, str) else json.dumps(case.output)}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        state.response_status = 200
        v = DecodeResponse().on_response_body(state, HttpMessage(Phase.RESPONSE_BODY, body=orjson.dumps(answer),
                                                                 end_of_stream=True))
    if isinstance(v, Reject):
        status, actual = v.status, {"error": {"code": v.code, "message": v.message}}
    elif isinstance(v, Mutate) and v.body is not None:
        actual = orjson.loads(v.body)
    if status != case.status:
        return GoldenResult(case.name, case.route, False, "status", f"expected status {case.status}, got {status}:\n"
                            + json.dumps(actual, indent=2, sort_keys=True))
    if status == 200 and actual != case.response:
        return GoldenResult(case.name, case.route, False, "response", _diff(case.response, actual))
    return GoldenResult(case.name, case.route, True)


def _diff(expected: Any, actual: Any) -> str:
    a = json.dumps(expected, indent=2, sort_keys=True, ensure_ascii=False).splitlines()
    b = json.dumps(actual, indent=2, sort_keys=True, ensure_ascii=False).splitlines()
    return "\n".join(difflib.unified_diff(a, b, "expected", "actual", lineterm=""))


__all__ = ["GoldenResult", "PreloadResult", "SandboxLimits", "SandboxResult", "network_prefix", "preload",
           "run_sandboxed"]
