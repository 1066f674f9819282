"""Mutation testing of the request path and the plugin modules (`make mutation`).

What: runs mutmut 3 over the modules below, against the in-process tests (tests/extproc,
tests/integration: the request path's unit and integration tests; e2e tests start subprocesses,
which mutmut's per-test function tracking cannot see), and writes
perf/results/mutation.json: {"modules": {"<path>": {"killed": n, "survived": m, "timeout": t,
"no_tests": u, "other": o, "score": killed / (killed + survived + timeout)}}, "survivors": {...}}.
The survivors are listed by mutant name so that `mutmut show <name>` (in .mutation/) prints
the diff; the triage is in docs/testing.md.

Why a copy: mutmut writes a mutated tree (mutants/) next to its config; the run happens in
.mutation/ (git-ignored), a copy of the files git knows, so the working tree is never touched and
a run can go on while you edit.

Cost: about 20 mutants per second per core on the fast modules; the whole set is a few thousand
mutants, tens of minutes on 2 cores. Not part of `make test`.

Usage: python scripts/mutation.py [--modules GLOB ...] [--max-children N] [--out PATH] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The request path (issue 9: stream, codec, pipeline, lifecycle, stages, config compile, dispatch)
# and every plugin module.
DEFAULT_MODULES = [
    "extproc/stream.py",
    "extproc/codec.py",
    "extproc/pipeline.py",
    "extproc/lifecycle.py",
    "extproc/request.py",
    "extproc/errors.py",
    "extproc/kinds.py",
    "extproc/feedback.py",
    "extproc/stages/*.py",
    "extproc/config/compile.py",
    "extproc/scheduling/__init__.py",
    "extproc/scheduling/*.py",
]
TESTS = ["tests/extproc", "tests/integration"]
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no_tests", 33: "no_tests", 36: "timeout",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"}


def expand(patterns: list[str]) -> list[str]:
    """Repo-relative .py files matching the globs (package __init__ files left out)."""
    return sorted({str(p.relative_to(REPO)) for pat in patterns for p in REPO.glob(pat)
                   if p.is_file() and p.suffix == ".py" and (p.name != "__init__.py" or "*" not in pat)})


def make_workspace(work: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            check=True, capture_output=True).stdout.split(b"\0")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = REPO / rel
        if not src.is_file() or rel.startswith(("perf/results/", ".mutation/")):
            continue
        dst = work / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    for link in (".venv", ".tools"):
        if (REPO / link).exists():
            (work / link).symlink_to(REPO / link)


def write_config(work: Path, modules: list[str]) -> None:
    # mutmut reads [tool.mutmut] from pyproject.toml first, then setup.cfg's [mutmut].
    cfg = ["[mutmut]", "source_paths=extproc", "only_mutate="]
    cfg += [f"    {m}" for m in modules]
    # The tests read files next to the code (examples/, envoy/, docs/, ...): copy every top-level
    # entry into mutants/ too, as mutmut does for tests/.
    extra = sorted(p.name for p in work.iterdir()
                   if p.name not in ("extproc", "tests", "mutants", "setup.cfg", ".venv", ".tools"))
    cfg += ["also_copy="] + [f"    {e}" for e in extra]
    cfg += ["pytest_add_cli_args_test_selection="] + [f"    {t}" for t in TESTS]
    # -p no:randomly: a fixed order, so a mutant's verdict does not depend on a seed.
    cfg += ["pytest_add_cli_args=", "    -p", "    no:randomly", "    -p", "    no:cacheprovider",
            "    -x", "    -q"]
    (work / "setup.cfg").write_text("\n".join(cfg) + "\n")


def collect(work: Path, modules: list[str]) -> dict:
    out: dict = {"modules": {}, "survivors": {}}
    for mod in modules:
        meta = work / "mutants" / (mod + ".meta")
        counts = {"killed": 0, "survived": 0, "timeout": 0, "no_tests": 0, "other": 0}
        survivors = []
        if meta.exists():
            data = json.loads(meta.read_text())
            for name, code in sorted(data.get("exit_code_by_key", {}).items()):
                status = STATUS.get(code, "other")
                counts[status] += 1
                if status == "survived":
                    survivors.append(name)
        judged = counts["killed"] + counts["survived"] + counts["timeout"]
        counts["score"] = round((counts["killed"] + counts["timeout"]) / judged, 4) if judged else None
        out["modules"][mod] = counts
        if survivors:
            out["survivors"][mod] = survivors
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", nargs="+", default=DEFAULT_MODULES, help="globs relative to the repo")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(REPO / "perf" / "results" / "mutation.json"))
    ap.add_argument("--work", default=str(REPO / ".mutation"))
    ap.add_argument("--keep", action="store_true", help="reuse .mutation/ (mutmut resumes a run)")
    args = ap.parse_args(argv)

    modules = expand(args.modules)
    if not modules:
        print(f"mutation: no module matches {args.modules}", file=sys.stderr)
        return 2
    mutmut = Path(sys.executable).with_name("mutmut")
    if not mutmut.exists():
        print("mutation: mutmut is not installed; `make mutation` installs the [mutation] extra",
              file=sys.stderr)
        return 2
    work = Path(args.work)
    if not (args.keep and work.exists()):
        make_workspace(work)
    write_config(work, modules)
    print(f"mutation: {len(modules)} modules in {work}, {args.max_children} children", flush=True)
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    envoy = REPO / ".tools" / "bin" / "envoy"
    if envoy.exists():
        env.setdefault("ADAPTER_ENVOY_BIN", str(envoy))
    rc = subprocess.run([str(mutmut), "run", "--max-children", str(args.max_children)], cwd=work,
                        env=env).returncode
    result = collect(work, modules)
    result["command"] = "make mutation"
    result["tests"] = TESTS
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["mutmut_exit"] = rc
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'module':45} {'killed':>7} {'survived':>9} {'timeout':>8} {'no tests':>9} {'score':>6}")
    for mod, c in result["modules"].items():
        score = "-" if c["score"] is None else f"{c['score']:.0%}"
        print(f"{mod:45} {c['killed']:7} {c['survived']:9} {c['timeout']:8} {c['no_tests']:9} {score:>6}")
    print(f"\nwrote {out} ({result['seconds']} s); survivors: cd {work} && .venv/bin/mutmut show <name>")
    return rc


if __name__ == "__main__":
    sys.exit(main())
