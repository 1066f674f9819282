"""The long fuzz mode: the tests/fuzz targets for as many cases as asked, in deterministic slices.

What: runs the four fuzz targets of tests/fuzz (`stream`, `templates`, `config`, `openapi`: each
module's `CASES` strategy and `check(case)`, the same properties the suite checks on a few
examples) with hypothesis's engine, generation only, in chunks of `--chunk` examples (a fresh
engine per chunk keeps hypothesis's own memory bounded; each chunk has its own seed, derived from
the target, the slice and the chunk's index with blake2b, so a slice is the same cases on every
machine). A property broken, or any exception, is recorded and the run goes on; afterwards each
kind of crash is replayed from its chunk's seed with shrinking on, and the minimal failing example
is saved to a file. Not part of the suite.

    .venv/bin/python perf/fuzz.py                        # 1,000,000 cases over the 4 targets, one slice
    .venv/bin/python perf/fuzz.py --slice 3/20           # the 3rd of 20 slices (50,000 cases)
    .venv/bin/python perf/fuzz.py --slice 1-4/20         # slices 1 to 4, one after the other
    .venv/bin/python perf/fuzz.py --target stream --cases 40000   # stream's quarter: 10,000 cases
    .venv/bin/python perf/fuzz.py --quick                # 1,000 cases per target, prints only
    .venv/bin/python perf/fuzz.py --slice 1/20 --report  # no run: a RESULTS.md section of every stored slice

Cases: `--cases` is the total over the four targets (a quarter each; `--target` runs only some of
them), and a slice runs its 1/M share.
Recorded per target and slice (`--out`, default perf/results/fuzz.json; slices of the same M
merge into it under a lock, so parallel runs and CI jobs can each run some): cases run, crashes (kind, count, the minimal example's
file under perf/results/fuzz-crashes/), hangs (cases over the per-case limit, `CASE_LIMIT_S` = 10
s), refusals by class (the refusal's message with quoted text and numbers taken out: "every
refusal a clear error" is this table), cases/s, and the process's RSS (current and peak) at the
start and end of the slice. Unless `--quick` or `--no-write`, a section with the machine, date,
command and a table is appended to perf/RESULTS.md.
Cost: the targets' own (about 1 to 20 ms a case, most of it hypothesis's generation: see RESULTS.md
for the measured cases/s on this machine).
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import hashlib
import importlib
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from benchenv import cpu, git_revision  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

TARGETS = {
    "stream": "tests.fuzz.test_fuzz_stream",
    "templates": "tests.fuzz.test_fuzz_templates",
    "config": "tests.fuzz.test_fuzz_config",
    "openapi": "tests.fuzz.test_fuzz_openapi",
}
DEFAULT_OUT = HERE / "results" / "fuzz.json"
CRASH_DIR = HERE / "results" / "fuzz-crashes"
SUPPRESS = list(HealthCheck)


def rss_kb() -> tuple[int, int]:
    """(current, peak) resident set size of this process, KiB."""
    current = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                current = int(line.split()[1])
    except OSError:
        pass
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def chunk_seed(target: str, k: int, m: int, chunk: int) -> int:
    digest = hashlib.blake2b(f"fuzz:{target}:{k}/{m}:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def crash_kind(exc: BaseException) -> str:
    first = (str(exc).splitlines() or [""])[0]
    from tests.fuzz.harness import refusal_class
    return f"{type(exc).__name__}: {refusal_class(first, 100)}"


class SliceRun:
    """One target's share of one slice: the cases, what broke and how they were refused."""

    def __init__(self, name: str, module, k: int, m: int, cases: int, chunk: int, limit: float):
        self.name, self.module, self.k, self.m = name, module, k, m
        self.cases, self.chunk, self.limit = cases, chunk, limit
        self.ran = 0
        self.crashes: dict[str, dict] = {}  # kind -> {count, chunk, first}
        self.hangs = 0
        self.refusals: collections.Counter = collections.Counter()
        self.slowest = 0.0

    def one(self, case) -> None:
        from tests.fuzz.harness import Hang
        self.ran += 1
        t0 = time.perf_counter()
        try:
            refusal = self.module.check(case)
        except Hang as e:
            self.hangs += 1
            self._crash(e, case, hang=True)
            return
        except Exception as e:  # noqa: BLE001 - every escape is a finding, recorded, and the run goes on
            self._crash(e, case)
            return
        finally:
            dt = time.perf_counter() - t0
            self.slowest = max(self.slowest, dt)
        if dt > self.limit:
            self.hangs += 1
            self._crash(TimeoutError(f"case took {dt:.1f} s, over the {self.limit:g} s limit"), case, hang=True)
        self.refusals["accepted" if refusal is None else refusal] += 1

    def _crash(self, exc: BaseException, case, hang: bool = False) -> None:
        kind = crash_kind(exc)
        entry = self.crashes.setdefault(kind, {"count": 0, "chunk": self._chunk, "hang": hang,
                                               "example": repr(case)[:4000],
                                               "traceback": "".join(traceback.format_exception(exc))[-4000:]})
        entry["count"] += 1

    def run(self) -> dict:
        rss0 = rss_kb()
        t0 = time.perf_counter()
        done, index = 0, 0
        while done < self.cases:
            n = min(self.chunk, self.cases - done)
            self._chunk = index
            self._engine(index, n, shrink=False, only=None)
            done += n
            index += 1
        elapsed = time.perf_counter() - t0
        rss1 = rss_kb()
        for kind, entry in self.crashes.items():
            entry["minimal_example_file"] = self._minimise(kind, entry)
        return {"cases": self.ran, "seconds": round(elapsed, 1), "cases_per_s": round(self.ran / elapsed, 1),
                "crashes": sum(e["count"] for e in self.crashes.values() if not e["hang"]),
                "hangs": self.hangs, "crash_kinds": self.crashes, "slowest_case_s": round(self.slowest, 3),
                "rss_kb": {"start": rss0[0], "end": rss1[0], "peak_start": rss0[1], "peak_end": rss1[1],
                           "growth": rss1[0] - rss0[0]},
                "refusals": dict(self.refusals.most_common())}

    def _engine(self, index: int, n: int, shrink: bool, only: str | None) -> None:
        phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]

        @seed(chunk_seed(self.name, self.k, self.m, index))
        @settings(max_examples=n, database=None, deadline=None, derandomize=False, phases=phases,
                  suppress_health_check=SUPPRESS, print_blob=False, report_multiple_bugs=False)
        @given(self.module.CASES)
        def run(case):
            if only is None:
                self.one(case)
                return
            try:  # replaying one crash kind: raise it (so hypothesis shrinks), ignore the others
                self.module.check(case)
            except Exception as e:  # noqa: BLE001
                if crash_kind(e) == only:
                    self._last = case
                    raise

        run()

    def _minimise(self, kind: str, entry: dict) -> str | None:
        """Replay the chunk the crash came from with shrinking on; save the smallest example found."""
        self._last = None
        try:
            self._engine(entry["chunk"], self.chunk, shrink=True, only=kind)
        except Exception:  # noqa: BLE001 - the crash itself, shrunk
            pass
        case = self._last
        CRASH_DIR.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "-" for c in kind)[:60].strip("-")
        path = CRASH_DIR / f"{self.name}-{self.k}of{self.m}-{slug}.txt"
        path.write_text(f"# {kind}\n# target {self.name}, slice {self.k}/{self.m}, chunk {entry['chunk']}\n"
                        f"# minimal example (shrunk by hypothesis){'' if case is not None else ': not reproduced'}\n"
                        f"{case!r}\n\n# first traceback\n{entry['traceback']}\n")
        return str(path.relative_to(REPO))


def parse_slices(text: str) -> tuple[list[int], int]:
    ks, _, m = text.partition("/")
    m_ = int(m)
    lo, _, hi = ks.partition("-")
    first, last = int(lo), int(hi or lo)
    if not (1 <= first <= last <= m_):
        raise SystemExit(f"--slice {text}: need 1 <= K <= M (K or K1-K2)")
    return list(range(first, last + 1)), m_


def totals(slices: dict) -> dict:
    out: dict = {}
    for per_target in slices.values():
        for name, r in per_target.items():
            t = out.setdefault(name, {"cases": 0, "crashes": 0, "hangs": 0, "seconds": 0.0, "slices": 0,
                                      "max_rss_growth_kb": 0, "refusal_classes": 0, "refusals": collections.Counter()})
            t["cases"] += r["cases"]
            t["crashes"] += r["crashes"]
            t["hangs"] += r["hangs"]
            t["seconds"] += r["seconds"]
            t["slices"] += 1
            t["max_rss_growth_kb"] = max(t["max_rss_growth_kb"], r["rss_kb"]["growth"])
            t["refusals"].update(r["refusals"])
    for t in out.values():
        t["cases_per_s"] = round(t["cases"] / t["seconds"], 1) if t["seconds"] else 0.0
        t["seconds"] = round(t["seconds"], 1)
        t["refusal_classes"] = len(t["refusals"])
        t["refusals"] = dict(t["refusals"].most_common())
    return out


def _ranges(ks: list[int]) -> str:
    """[1, 2, 3, 6, 11, 12] -> "1-3, 6, 11-12"."""
    out: list[str] = []
    for k in sorted(ks):
        if out and int(out[-1].split("-")[-1]) == k - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{k}"
        else:
            out.append(str(k))
    return ", ".join(out)


def results_section(command: str, m: int, ran: list[int], report: dict, tot: dict, started: str) -> str:
    lines = [f"## {started} UTC: fuzzing, slices {_ranges(ran)} of {m} (perf/fuzz.py)", "",
             f"- machine: {cpu()}; commit {git_revision('extproc', 'backends', 'tests/fuzz')}",
             f"- command: `{command}`", "",
             "| target | slices run | cases | crashes | hangs | cases/s | RSS growth in a slice, max (MiB) | peak RSS (MiB) "
             "| refusal classes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in TARGETS:
        rows = [report[str(k)][name] for k in ran if name in report.get(str(k), {})]
        if not rows:
            continue
        cases = sum(r["cases"] for r in rows)
        secs = sum(r["seconds"] for r in rows)
        growth = max(r["rss_kb"]["growth"] for r in rows) / 1024
        peak = max(r["rss_kb"]["peak_end"] for r in rows) / 1024
        lines.append(f"| {name} | {len(rows)} | {cases:,} | {sum(r['crashes'] for r in rows)} | "
                     f"{sum(r['hangs'] for r in rows)} | {cases / secs:.0f} | {growth:.1f} | {peak:.0f} | "
                     f"{len({c for r in rows for c in r['refusals']})} |")
    all_cases = sum(t["cases"] for t in tot.values())
    lines += ["", f"Stored in perf/results/fuzz.json over all slices of {m} run so far: {all_cases:,} cases, "
              f"{sum(t['crashes'] for t in tot.values())} crashes, {sum(t['hangs'] for t in tot.values())} hangs.", ""]
    return "\n".join(lines) + "\n"


def load_slices(out: Path, m: int, cases: int) -> dict:
    """The slices stored in `out` for this slicing (M and --cases); {} for another one or none."""
    try:
        stored = json.loads(out.read_text())
    except (OSError, ValueError):
        return {}
    if stored.get("slices_of") != m or stored.get("cases_requested") != cases:
        return {}  # another slicing: a new report (the old one is kept beside it, see `store`)
    return stored.get("slices", {})


def store(out: Path, m: int, cases: int, k: int, name: str, result: dict, command: str, limit: float) -> dict:
    """Merge one target's slice result into `out` under a lock (several runs may share the file:
    parallel slices, CI jobs); returns every slice stored."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(out.parent, os.O_RDONLY)  # the folder is the lock: no lock file left in the tree
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        slices = load_slices(out, m, cases)
        if not slices and out.exists():  # another slicing's report: kept, not overwritten
            out.replace(out.with_name(f"{out.stem}.previous{out.suffix}"))
        slices.setdefault(str(k), {})[name] = result
        slices = dict(sorted(slices.items(), key=lambda kv: int(kv[0])))
        doc = {"cases_requested": cases, "slices_of": m, "machine": cpu(),
               "commit": git_revision("extproc", "backends", "tests/fuzz"), "command": command,
               "case_limit_s": limit, "slices": slices, "totals": totals(slices)}
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")  # ASCII: refusal texts may carry lone surrogates
        tmp.replace(out)
    finally:
        os.close(lock)  # releases the lock
    return slices


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1_000_000,
                    help="total cases over the four targets and all slices (a quarter each)")
    ap.add_argument("--slice", default="1/1", help="K/M: the K-th of M slices (K may be a range K1-K2)")
    ap.add_argument("--target", action="append", choices=sorted(TARGETS), help="only this target (repeatable)")
    ap.add_argument("--out", default=None, help=f"JSON report (default {DEFAULT_OUT.relative_to(REPO)})")
    ap.add_argument("--quick", action="store_true", help="1,000 cases per target; prints, writes only --out if given")
    ap.add_argument("--chunk", type=int, default=500, help="examples per hypothesis engine run (default 500)")
    ap.add_argument("--no-write", action="store_true", help="do not append a section to perf/RESULTS.md")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: append a RESULTS.md section from the slices --out holds for this slicing")
    args = ap.parse_args(argv)
    names = args.target or list(TARGETS)
    if args.quick:
        args.cases = 1000 * len(TARGETS)
    ks, m = parse_slices(args.slice)
    per_target = args.cases // len(TARGETS)  # --cases is over all four targets; --target runs some of them
    share = [per_target // m + (1 if i < per_target % m else 0) for i in range(m)]  # slice i+1's share
    out = Path(args.out) if args.out else (None if args.quick else DEFAULT_OUT)
    command = "python perf/fuzz.py " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    from tests.fuzz.harness import CASE_LIMIT_S

    if args.report:  # no run: a RESULTS.md section from what the report holds (every slice run so far)
        slices = load_slices(out or DEFAULT_OUT, m, args.cases)
        done = sorted(int(k) for k in slices)
        if not done:
            raise SystemExit(f"{out or DEFAULT_OUT}: no slice of {m} with --cases {args.cases} recorded")
        with (HERE / "RESULTS.md").open("a") as f:
            f.write("\n" + results_section(command, m, done, slices, totals(slices), started))
        return 0
    slices: dict = {}  # what this run did; merged into --out after every target
    for k in ks:
        report = slices.setdefault(str(k), {})
        for name in names:
            module = importlib.import_module(TARGETS[name])
            r = SliceRun(name, module, k, m, share[k - 1], args.chunk, CASE_LIMIT_S).run()
            r["date"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
            report[name] = r
            print(f"slice {k}/{m} {name}: {r['cases']} cases in {r['seconds']} s ({r['cases_per_s']}/s), "
                  f"{r['crashes']} crashes, {r['hangs']} hangs, RSS {r['rss_kb']['start']} -> {r['rss_kb']['end']} KiB, "
                  f"{len(r['refusals'])} refusal classes", flush=True)
            for kind, e in r["crash_kinds"].items():
                print(f"  {'HANG' if e['hang'] else 'CRASH'} x{e['count']}: {kind} -> {e.get('minimal_example_file')}")
            if out is not None:  # written after every target: an interrupted run keeps what it did
                merged = store(out, m, args.cases, k, name, r, command, CASE_LIMIT_S)
    tot = totals(merged if out is not None else slices)
    for name, t in tot.items():
        print(f"total {name}: {t['cases']} cases over {t['slices']} slice(s), {t['crashes']} crashes, "
              f"{t['hangs']} hangs, {t['cases_per_s']}/s, max RSS growth {t['max_rss_growth_kb']} KiB")
    if not args.quick and not args.no_write:
        with (HERE / "RESULTS.md").open("a") as f:
            f.write("\n" + results_section(command, m, ks, merged if out is not None else slices, tot, started))
    return 1 if any(t["crashes"] or t["hangs"] for t in tot.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
