"""Profile: a py-spy profile of one processor worker under a fixed load, per git revision (before/after).

What: for each `--rev REV` (one or two; default HEAD), a clean worktree of that revision
(`git worktree add --detach /tmp/wt-prof-<sha> <sha>`, with .venv and .tools symlinked from this
checkout and extproc/scheduling/_prefix*.so copied; other C accelerators of the revision without a
.so there, e.g. _score at later revisions, are compiled in place from the revision's own source with
cc and setup.py's flags, as `make setup` would have built them), and in it, with PYTHONPATH and the working
directory pointing at the worktree (so the venv's editable install does not import this checkout's
code), `extproc.stack.Stack` of that revision's perf/configs/bench-gateway.yaml with `--workers`
processor workers (default 1) in front of bench_overhead's upstream (a separate Envoy answering a
canned chat completion with `direct_response`; started from this checkout, not the revision's).
The fixed load: two wrk processes at once, `--connections` each (default 4), on the llm route
(POST /v1/analyze, bench_overhead's 1 KB JSON body) and the headers-only route (POST
/v1/chat/completions, passthrough). After `--warmup` seconds, py-spy samples worker 0 twice in a
row, `--duration` seconds each (default 4) at `--rate` Hz (default 100), with `--native` (C and Cython
frames: grpc's cygrpc, uvloop, libc calls; `--no-native` leaves it out): once `--format speedscope`
(perf/results/profiles/profile-<sha>.speedscope.json, open in https://www.speedscope.app) and once
`--format raw --full-filenames` (collapsed stacks, flamegraph.pl's input; with `--keep-raw` kept as
perf/results/profiles/profile-<sha>.raw.txt with file names shortened to the part inside the worktree,
site-packages or the stdlib, line numbers dropped and equal stacks merged; else only read). The top-N tables
(`--top`, default 20) come from the raw file: samples whose innermost frame is a blocking call
(epoll_wait, futex through glibc's `syscall`, ...: WAITING below) are counted as waiting and left
out; of the rest ("busy" samples), per function (name and file; native frames known only by an
address are `[native]` of their library) the share where it is the innermost frame (own time) and
where it is anywhere in the stack (total time). py-spy itself already leaves out threads it sees
idle, but without --native it cannot see that the event loop sits in epoll inside uvloop's C code
and counts that as `Runner.run` (half the samples in a first try).
Output: perf/results/profile-<sha>.json (`{"rev", "sha", "subject", "date", "machine", "load", "samples_all",
"samples_waiting", "samples",
"wrk", "top": [{"function", "file", "own", "own_pct", "total", "total_pct"}], "ours_total": [...], ...}`),
the two profile files, and with two revisions a side-by-side top-N table by own time and one of our
own code (extproc/, backends/, canary/) by total time; unless --no-write, a dated RESULTS.md section
with them (`--label` a line on where it ran). Each worktree is removed afterwards (also on error).
Checks: frames from this checkout's own files in the worktree's profile (the editable install leaking
in) are counted and reported (`frames_from_main_checkout`, must be 0), and every wrk response must be 2xx.
py-spy needs ptrace rights over the worker (root, or CAP_SYS_PTRACE / kernel.yama.ptrace_scope=0): CI and
the development machine run as root. It comes with the `perf` and `test` extras
(`pip install -e '.[perf]'`); this script uses .venv/bin/py-spy, else py-spy on PATH.
Run: `.venv/bin/python perf/profile_hotpath.py --rev 52c5dad --rev HEAD [--workers 1] [--connections 4]
[--warmup 2] [--duration 4] [--rate 100] [--top 20] [--label TEXT] [--no-write]`.
Cost: per revision a worktree (seconds, plus a C build when one is needed), a stack start and
warm-up + 2 x duration of load: about 30 s per revision here. Files: with --native 60-100 KB of speedscope
per revision at 4 s x 100 Hz (and 30-200 KB of raw text with --keep-raw); without, about 10 KB each.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_overhead, benchenv

import bench_overhead as bo  # noqa: E402
import benchenv  # noqa: E402

from extproc.stack import free_port, stop_process  # noqa: E402

REPO = bo.REPO
RESULTS_DIR = REPO / "perf" / "results"
PROFILES_DIR = RESULTS_DIR / "profiles"
OURS = ("extproc/", "backends/", "canary/", "ebpf/")
ROUTES = ("llm", "headers")

# Runs inside the worktree (cwd and PYTHONPATH = the worktree): the revision's own Stack and config.
# argv: upstream "host:port", workers, run dir. Prints one JSON line once serving, stops at EOF on stdin.
DRIVER = r"""
import json, os, sys, yaml
from pathlib import Path
from extproc.stack import Stack, free_port, free_port_block
upstream, workers, run_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
cfg = yaml.safe_load(Path("perf/configs/bench-gateway.yaml").read_text())
cfg["spec"]["backends"][0]["endpoints"] = [upstream]
run_dir.mkdir(parents=True, exist_ok=True)
path = run_dir / "bench-gateway.yaml"
path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
st = Stack(str(path), listen_port=free_port(), admin_port=free_port(), processor_base_port=free_port_block(workers),
           processor_admin_port=free_port(), workers=workers, run_dir=str(run_dir / "gateway"), log_level="warning")
st.start()
try:
    import extproc
    native = {}
    for mod in ("_prefix", "_score"):
        try:
            __import__("extproc.scheduling." + mod)
            native[mod] = True
        except ImportError:
            native[mod] = False
    print(json.dumps({"url": st.url, "admin": st.admin_url, "envoy": st.envoy.pid,
                      "workers": [w.proc.pid for w in st.supervisor.workers],
                      "extproc": os.path.dirname(extproc.__file__), "native": native}), flush=True)
    sys.stdin.read()
finally:
    st.stop()
"""


# --------------------------------------------------------------------------------------------
# Worktree
# --------------------------------------------------------------------------------------------

def worktree_path(sha: str) -> Path:
    return Path(f"/tmp/wt-prof-{sha}")


def worktree_commands(repo: Path, sha: str, wt: Path, so_files: list[Path]) -> list[list[str]]:
    """The commands that make the worktree of `sha` at `wt`: `git worktree add --detach`, .venv and .tools
    symlinked from `repo`, the `so_files` (repo-relative, e.g. extproc/scheduling/_prefix.*.so) copied."""
    cmds = [["git", "-C", str(repo), "worktree", "add", "--detach", str(wt), sha]]
    for name in (".venv", ".tools"):
        cmds.append(["ln", "-sfn", str(repo / name), str(wt / name)])
    for so in so_files:
        cmds.append(["cp", "-p", str(repo / so), str(wt / so)])
    return cmds


def remove_command(repo: Path, wt: Path) -> list[str]:
    return ["git", "-C", str(repo), "worktree", "remove", "--force", str(wt)]


def build_command(source: Path) -> list[str]:
    """cc for one optional accelerator next to its source, with setup.py's flags for both (-O2,
    -ffp-contract=off for _score's bit-identical arithmetic, zlib for _prefix). Not setup.py itself:
    with the venv's setuptools it trips over pyproject.toml (pip's isolated build has a newer one)."""
    import sysconfig
    out = source.with_name(source.stem + sysconfig.get_config_var("EXT_SUFFIX"))
    return [os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", "-ffp-contract=off",
            f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(out), "-lz"]


def make_worktree(rev: str) -> tuple[str, Path, list[str]]:
    """(full sha, worktree path, notes) for `rev`; the caller removes it with remove_command."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    wt = worktree_path(sha[:12])
    if wt.exists():  # a leftover of an interrupted run of this script
        subprocess.run(remove_command(REPO, wt), capture_output=True)
        shutil.rmtree(wt, ignore_errors=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)
    so_files = sorted(p.relative_to(REPO) for p in (REPO / "extproc" / "scheduling").glob("_prefix*.so"))
    for cmd in worktree_commands(REPO, sha, wt, so_files):
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    notes = [f"copied {', '.join(str(s) for s in so_files) or 'no _prefix .so (none built here)'}"]
    # other accelerators of this revision without a .so: built from the revision's own sources
    for c in sorted((wt / "extproc" / "scheduling").glob("_*.c")):
        if list(c.parent.glob(c.stem + "*.so")):
            continue
        cmd = build_command(c)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        notes.append(f"built {c.stem} from the revision's {c.name}" if p.returncode == 0 else
                     f"{c.stem} not built ({p.stderr.strip()[-200:]}): its Python fallback runs")
    return sha, wt, notes


# --------------------------------------------------------------------------------------------
# py-spy raw output
# --------------------------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def shorten(path: str, roots: list[str]) -> str:
    """A frame's file relative to the first of `roots` it lies under (worktree, site-packages, stdlib),
    else as it is."""
    for root in roots:
        root = root.rstrip("/") + "/"
        if path.startswith(root):
            return path[len(root):]
    return path


def parse_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) format, one stack a line: `outer;...;innermost COUNT` -> [(frames, count)]."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        out.append((stack.split(";"), int(count)))
    return out


_CPYTHON_BUILD = re.compile(r"^.*/Python-\d+\.\d+\.\d+/")  # pyenv's build tree in native frames' debug info


def function_key(frame: str, roots: list[str] = ()) -> tuple[str, str]:
    """`"handle (/tmp/wt/extproc/stream.py:120)"` -> ("handle", "extproc/stream.py"): line numbers dropped;
    native frames named only by an address (`0x7f... (cygrpc...so)`) become `[native]` of their library, so
    that runs compare."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip(), ""
    func, file = m.group("func"), shorten(m.group("file"), list(roots))
    if re.fullmatch(r"0x[0-9a-fA-F]+", func):
        func = "[native]"
    return func, _CPYTHON_BUILD.sub("cpython/", file)


# Innermost frames that mean the thread is blocked, not running (py-spy --native shows the libc call; without
# --native py-spy's own idle detection drops most of these, but misses the event loop in uvloop/cygrpc C code).
# `syscall` is glibc's generic wrapper: in these processes it is futex waits (gRPC's and abseil's mutexes).
WAITING = frozenset({"epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select", "pselect", "syscall",
                     "futex", "__futex_abstimed_wait_common", "__futex_abstimed_wait_common64",
                     "pthread_cond_wait", "pthread_cond_timedwait", "sem_wait", "sem_timedwait", "sem_clockwait",
                     "nanosleep", "clock_nanosleep", "accept", "accept4", "read_wakeup_fd"})


def split_waiting(stacks: list[tuple[list[str], int]]) -> tuple[list[tuple[list[str], int]], int]:
    """(stacks whose innermost frame is not a blocking call, samples that were waiting)."""
    busy, waiting = [], 0
    for frames, count in stacks:
        if frames and function_key(frames[-1])[0] in WAITING:
            waiting += count
        else:
            busy.append((frames, count))
    return busy, waiting


def top_functions(stacks: list[tuple[list[str], int]], n: int = 20, roots: list[str] = (),
                  only: tuple[str, ...] = (), by: str = "own") -> list[dict[str, Any]]:
    """Functions by own samples (innermost frame) or total samples (anywhere in the stack, once per
    stack), with shares of all samples; `only`: file prefixes to keep (e.g. our packages). Ties by name."""
    own: Counter = Counter()
    total: Counter = Counter()
    samples = 0
    for frames, count in stacks:
        samples += count
        keys = [function_key(f, roots) for f in frames]
        if keys:
            own[keys[-1]] += count
        for k in set(keys):
            total[k] += count
    chosen = own if by == "own" else total
    keys = [k for k in chosen if not only or k[1].startswith(only)]
    keys.sort(key=lambda k: (-chosen[k], k))
    return [{"function": f, "file": file, "own": own[(f, file)], "total": total[(f, file)],
             "own_pct": round(100 * own[(f, file)] / samples, 2) if samples else 0.0,
             "total_pct": round(100 * total[(f, file)] / samples, 2) if samples else 0.0}
            for f, file in keys[:n]]


def side_by_side(a: dict[str, Any], b: dict[str, Any], key: str = "top", pct: str = "own_pct") -> str:
    """A markdown table: rank, A's function and share, B's function and share (and B's share of A's
    function, to see where it went)."""
    ra, rb = a[key], b[key]
    b_by = {(r["function"], r["file"]): r for r in b.get("all_" + key, rb)}
    word = "own" if pct == "own_pct" else "total"
    out = [f"| # | {a['label']} function | {word} % | same in {b['label']} % | {b['label']} function | {word} % |",
           "|---:|---|---:|---:|---|---:|"]
    for i in range(max(len(ra), len(rb))):
        x = ra[i] if i < len(ra) else None
        y = rb[i] if i < len(rb) else None
        same = b_by.get((x["function"], x["file"])) if x else None
        out.append("| {} | {} | {} | {} | {} | {} |".format(
            i + 1, f"`{x['function']}` ({x['file']})" if x else "", f"{x[pct]:.1f}" if x else "",
            (f"{same[pct]:.1f}" if same else "0") if x else "",
            f"`{y['function']}` ({y['file']})" if y else "", f"{y[pct]:.1f}" if y else ""))
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# One revision
# --------------------------------------------------------------------------------------------

def find_pyspy() -> str:
    for cand in (REPO / ".venv" / "bin" / "py-spy", shutil.which("py-spy")):
        if cand and Path(cand).exists():
            return str(cand)
    raise SystemExit("py-spy not found: pip install -e '.[perf]' (it needs ptrace rights: root or CAP_SYS_PTRACE)")


def profile_rev(rev: str, args: argparse.Namespace, upstream: str, wrk: str, pyspy: str,
                run_dir: Path) -> dict[str, Any]:
    sha, wt, notes = make_worktree(rev)
    short = sha[:12]
    driver: subprocess.Popen | None = None
    try:
        env = dict(os.environ, PYTHONPATH=str(wt))
        env.pop("PYTHONHOME", None)
        rdir = run_dir / short
        driver = subprocess.Popen([str(REPO / ".venv" / "bin" / "python"), "-c", DRIVER, upstream, str(args.workers),
                                   str(rdir)], cwd=wt, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, start_new_session=True)
        line = driver.stdout.readline() if driver.stdout else ""
        if not line.strip().startswith("{"):
            raise RuntimeError(f"{rev}: the stack did not start (exit {driver.poll()}, printed {line!r})")
        info = json.loads(line)
        if not info["extproc"].startswith(str(wt)):
            raise RuntimeError(f"{rev}: extproc imported from {info['extproc']}, not the worktree {wt}")
        bo.wait_processor_healthy(info["admin"], args.workers, rev)
        bo.check_responses({"gateway": info["url"]}, list(ROUTES))
        total_s = args.warmup + 2 * args.duration + 4
        loads = {r: subprocess.Popen(
            [wrk, "--latency", "-t", "1", "-c", str(args.connections), "-d", f"{round(total_s)}s", "--timeout", "5s",
             "-s", str(bo.lua_post(run_dir / f"{short}-{r}.lua", bo.BODIES[r])), info["url"] + bo.PATHS[r]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ROUTES}
        load0 = os.getloadavg()
        time.sleep(args.warmup)
        PROFILES_DIR.mkdir(parents=True, exist_ok=True)
        pid = str(info["workers"][0])
        speedscope = PROFILES_DIR / f"profile-{short}.speedscope.json"
        raw_path = (PROFILES_DIR if args.keep_raw else run_dir) / f"profile-{short}.raw.txt"
        base = [pyspy, "record", "--pid", pid, "--duration", str(args.duration), "--rate", str(args.rate),
                *(["--native"] if args.native else [])]
        for cmd in (base + ["--format", "speedscope", "-o", str(speedscope)],
                    base + ["--format", "raw", "--full-filenames", "-o", str(raw_path)]):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration + 30)
            if p.returncode != 0:
                raise RuntimeError(f"py-spy failed ({p.returncode}): {p.stderr.strip()[-500:]} (ptrace rights?)")
        wrk_res = {}
        for r, proc in loads.items():
            out, err = proc.communicate(timeout=total_s + 30)
            res = bo.parse_wrk(out)
            bo._check(res, f"{rev} {r}")
            wrk_res[r] = {"rps": round(res.rps, 1), "p50_ms": round(res.p50, 3), "requests": res.requests}
        load1 = os.getloadavg()
    finally:
        if driver is not None:
            try:
                driver.stdin.close()
                driver.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                stop_process(driver)
        subprocess.run(remove_command(REPO, wt), capture_output=True)
        shutil.rmtree(wt, ignore_errors=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)
    # roots to shorten: the worktree first, then anything on this venv's sys.path (site-packages, stdlib)
    roots = [str(wt)] + sorted((p for p in sys.path if p and p != str(REPO) and os.path.isdir(p)), key=len,
                               reverse=True)
    raw_text = raw_path.read_text()
    stacks = parse_raw(raw_text)
    leaked = sum(c for frames, c in stacks for f in frames
                 if f"({REPO}/" in f and "/.venv/" not in f and "/.tools/" not in f)
    # the committed raw file with short names (the worktree's path is gone anyway)
    merged: Counter = Counter()
    for frames, c in stacks:
        merged[";".join(f"{fn} ({fl})" for fn, fl in (function_key(x, roots) for x in frames))] += c
    raw_path.write_text("".join(f"{k} {c}\n" for k, c in sorted(merged.items())))
    all_samples = sum(c for _, c in stacks)
    stacks, waiting = split_waiting(stacks)
    subject = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%s", sha], capture_output=True,
                             text=True).stdout.strip()
    return {
        "rev": rev, "sha": short, "label": f"{rev} ({short[:7]})" if rev != short[:len(rev)] else short[:7],
        "subject": subject[:120], "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": benchenv.cpu(), "load": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in load1]},
        "workers": args.workers, "connections_per_route": args.connections, "duration_s": args.duration,
        "rate_hz": args.rate, "py_spy_native": args.native, "samples_all": all_samples, "samples_waiting": waiting,
        "samples": sum(c for _, c in stacks), "wrk": wrk_res, "worktree": notes,
        "native": info["native"], "frames_from_main_checkout": leaked,
        "speedscope": str(speedscope.relative_to(REPO)), "speedscope_bytes": speedscope.stat().st_size,
        "raw": str(raw_path.relative_to(REPO)) if args.keep_raw else None, "raw_bytes": raw_path.stat().st_size,
        "top": top_functions(stacks, args.top, roots),
        "ours_total": top_functions(stacks, args.top, roots, only=OURS, by="total"),
        "all_top": top_functions(stacks, 10**6, roots),
        "all_ours_total": top_functions(stacks, 10**6, roots, only=OURS, by="total"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", action="append", default=None, help="a git revision (give twice for before/after)")
    ap.add_argument("--workers", type=int, default=1, help="processor workers (default 1; worker 0 is sampled)")
    ap.add_argument("--connections", type=int, default=4, help="wrk connections per route (default 4)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before sampling (default 2)")
    ap.add_argument("--duration", type=int, default=4, help="seconds per py-spy recording (default 4)")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second (default 100)")
    ap.add_argument("--no-native", dest="native", action="store_false",
                    help="without py-spy --native (C/Cython frames of grpc's cygrpc and uvloop, libc calls): their "
                         "time, waits in epoll included, then counts as the innermost Python frame's")
    ap.add_argument("--keep-raw", action="store_true",
                    help="keep the raw (collapsed) stacks in perf/results/profiles/ too (default: speedscope only)")
    ap.add_argument("--top", type=int, default=20, help="rows of the top tables (default 20)")
    ap.add_argument("--label", default="", help="a line for RESULTS.md: where and under what load it ran")
    ap.add_argument("--no-write", action="store_true", help="print only: no JSON, profiles kept, no RESULTS.md")
    args = ap.parse_args(argv)
    revs = args.rev or ["HEAD"]
    if len(revs) > 2:
        ap.error("at most two --rev")
    command = " ".join([".venv/bin/python perf/profile_hotpath.py",
                        *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))])

    def _on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    if argv is None:
        signal.signal(signal.SIGTERM, _on_sigterm)
    pyspy, wrk = find_pyspy(), bo.ensure_wrk()
    run_dir = Path(tempfile.mkdtemp(prefix="profile-hotpath-"))
    upstream: subprocess.Popen | None = None
    results = []
    try:
        up_port, up_admin = free_port(), free_port()
        upstream = bo._start_envoy(bo.upstream_bootstrap(up_port, up_admin), run_dir / "upstream.yaml", 1,
                                   f"http://127.0.0.1:{up_admin}", "upstream")
        for rev in revs:
            res = profile_rev(rev, args, f"127.0.0.1:{up_port}", wrk, pyspy, run_dir)
            results.append(res)
            print(f"{res['label']}: {res['samples_all']} samples, {res['samples_waiting']} waiting, "
                  f"wrk {res['wrk']}, native {res['native']}, "
                  f"{'; '.join(res['worktree'])}; speedscope {res['speedscope']} ({res['speedscope_bytes']:,} B), "
                  f"raw {res['raw'] or '(not kept)'} ({res['raw_bytes']:,} B); frames from this checkout: "
                  f"{res['frames_from_main_checkout']}", flush=True)
    finally:
        stop_process(upstream)
        shutil.rmtree(run_dir, ignore_errors=True)
    for res in results:
        if res["frames_from_main_checkout"]:
            print(f"warning: {res['label']}: {res['frames_from_main_checkout']} samples ran this checkout's code",
                  file=sys.stderr)
    tables = []
    if len(results) == 2:
        a, b = results
        tables = [f"Top {args.top} by own time (% of busy samples):\n\n" + side_by_side(a, b),
                  f"Our code (extproc/, backends/, canary/, ebpf/), top {args.top} by total time (% of busy "
                  "samples with the function anywhere in the stack):\n\n" + side_by_side(a, b, "ours_total", "total_pct")]
    else:
        r = results[0]
        tables = ["\n".join(["| # | function | own % | total % |", "|---:|---|---:|---:|"]
                            + [f"| {i + 1} | `{t['function']}` ({t['file']}) | {t['own_pct']:.1f} "
                               f"| {t['total_pct']:.1f} |"
                               for i, t in enumerate(r["top"])])]
    print()
    print("\n\n".join(tables))
    if args.no_write:
        return 0
    for res in results:
        out = RESULTS_DIR / f"profile-{res['sha']}.json"
        doc = {k: v for k, v in res.items() if not k.startswith("all_")}
        doc["command"] = command
        out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {out}")
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    label = f"- **{args.label}**\n" if args.label else ""
    runs = "\n".join(
        f"- {r['label']} \"{r['subject']}\": {r['samples_all']} samples, {r['samples_waiting']} of them waiting, "
        f"{r['samples']} busy; wrk llm {r['wrk']['llm']['rps']:,.0f} req/s, "
        f"headers {r['wrk']['headers']['rps']:,.0f} req/s; load average {r['load']['start'][0]:.2f} -> "
        f"{r['load']['end'][0]:.2f}; C accelerators {r['native']}; {'; '.join(r['worktree'])}; "
        f"`{r['speedscope']}` ({r['speedscope_bytes'] // 1024} KB)"
        + (f", `{r['raw']}` ({r['raw_bytes'] // 1024} KB)" if r['raw'] else "")
        for r in results)
    benchenv.append_results(f"""
## {now}: profile_hotpath (py-spy, one processor worker, {' vs '.join(r['label'] for r in results)})

{label}- Machine: {benchenv.cpu()}; code: clean worktrees of each revision (PYTHONPATH = the worktree)
- Command: `{command}`
- Load: {args.workers} worker(s); two wrk at once, c={args.connections} each, on llm (POST /v1/analyze, {len(bo.LLM_BODY)} B) and headers (POST /v1/chat/completions, passthrough); py-spy {args.rate} Hz for {args.duration} s {' --native' if args.native else ''} on worker 0 after {args.warmup:g} s of load; shares are of busy samples (py-spy's non-idle samples less those blocked in a wait call)
{runs}

{chr(10).join(chr(10) + t + chr(10) for t in tables)}""")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: everything started was stopped", file=sys.stderr)
        sys.exit(130)
