"""Mutation testing of the request path and the plugin modules (`make mutation`).

What: runs mutmut 3 over the modules below, against the in-process tests (tests/extproc,
tests/integration: the request path's unit and integration tests; e2e tests start subprocesses,
which mutmut's per-test function tracking cannot see), and writes
perf/results/mutation.json: {"modules": {"<path>": {"killed": n, "survived": m, "timeout": t,
"no_tests": u, "other": o, "score": killed / (killed + survived + timeout)}}, "survivors": {...}}.
The survivors are listed by mutant name so that `mutmut show <name>` (in .mutation/) prints
the diff; the triage is in docs/testing.md.

Why a copy: mutmut writes a mutated tree (mutants/) next to its config; the run happens in
.mutation/<group>/ (git-ignored), an export of HEAD (`--ref`), so the working tree is never touched,
uncommitted edits do not leak in, and a run can go on while you edit.

Cost: about 20 mutants per second per core on the fast modules; the whole set is a few thousand
mutants, tens of minutes on 2 cores. Not part of `make test`.

Usage: python scripts/mutation.py [--modules GLOB ...] [--tests PATH ...] [--max-children N]
       [--out PATH] [--work DIR] [--keep]   (make mutation MUTATION_ARGS="...")
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
# Modules whose functions nearly every test calls (each surviving mutant would rerun the whole
# in-process suite) run as their own group against the tests that judge them.
GROUPS = {
    "config": (["extproc/config/compile.py", "extproc/kinds.py"], ["tests/extproc/config", "tests/extproc/test_kinds.py"]),
}
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no_tests", 33: "no_tests", 36: "timeout",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"}


def expand(patterns: list[str]) -> list[str]:
    """Repo-relative .py files matching the globs (package __init__ files left out)."""
    return sorted({str(p.relative_to(REPO)) for pat in patterns for p in REPO.glob(pat)
                   if p.is_file() and p.suffix == ".py" and (p.name != "__init__.py" or "*" not in pat)})


def make_workspace(work: Path, ref: str) -> None:
    """`ref`'s tree (HEAD by default: what is committed, not half-edited files) in `work`."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True)
    for link in (".venv", ".tools"):  # mutmut's own copy (mutants/) gets ADAPTER_ENVOY_BIN instead
        if (REPO / link).exists():
            (work / link).symlink_to(REPO / link)


def write_config(work: Path, modules: list[str], tests: list[str]) -> None:
    # mutmut reads [tool.mutmut] from pyproject.toml first, then setup.cfg's [mutmut].
    cfg = ["[mutmut]", "source_paths=extproc", "only_mutate="]
    cfg += [f"    {m}" for m in modules]
    # The tests read files next to the code (examples/, envoy/, docs/, ...): copy every top-level
    # entry into mutants/ too, as mutmut does for tests/.
    extra = sorted(p.name for p in work.iterdir()
                   if p.name not in ("extproc", "tests", "mutants", "setup.cfg", ".venv", ".tools"))
    cfg += ["also_copy="] + [f"    {e}" for e in extra]
    cfg += ["pytest_add_cli_args_test_selection="] + [f"    {t}" for t in tests]
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


def run_group(name: str, modules: list[str], tests: list[str], work: Path, children: int, keep: bool,
              ref: str) -> tuple[int, dict]:
    if not (keep and work.exists()):
        make_workspace(work, ref)
    write_config(work, modules, tests)
    print(f"mutation[{name}]: {len(modules)} modules against {' '.join(tests)} in {work}, "
          f"{children} children", flush=True)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    envoy = REPO / ".tools" / "bin" / "envoy"
    if envoy.exists():
        env.setdefault("ADAPTER_ENVOY_BIN", str(envoy))
    rc = subprocess.run([str(Path(sys.executable).with_name("mutmut")), "run", "--max-children", str(children)],
                        cwd=work, env=env).returncode
    return rc, collect(work, modules)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", nargs="+", default=DEFAULT_MODULES, help="globs relative to the repo")
    ap.add_argument("--tests", nargs="+", default=None,
                    help="test paths (default: tests/extproc tests/integration, and per group for the config modules)")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(REPO / "perf" / "results" / "mutation.json"))
    ap.add_argument("--work", default=str(REPO / ".mutation"))
    ap.add_argument("--keep", action="store_true", help="reuse the workspaces (mutmut resumes a run)")
    ap.add_argument("--ref", default="HEAD", help="the commit whose tree is mutated (default HEAD)")
    args = ap.parse_args(argv)

    modules = expand(args.modules)
    if not modules:
        print(f"mutation: no module matches {args.modules}", file=sys.stderr)
        return 2
    if not Path(sys.executable).with_name("mutmut").exists():
        print("mutation: mutmut is not installed; `make mutation` installs the [mutation] extra",
              file=sys.stderr)
        return 2
    if args.tests:
        plan = [("all", modules, args.tests)]
    else:
        grouped = {m for ms, _ in GROUPS.values() for m in ms}
        plan = [("main", [m for m in modules if m not in grouped], TESTS)]
        plan += [(g, [m for m in ms if m in modules], tests) for g, (ms, tests) in GROUPS.items()]
        plan = [p for p in plan if p[1]]
    t0 = time.monotonic()
    ref = subprocess.run(["git", "rev-parse", args.ref], cwd=REPO, capture_output=True, text=True).stdout.strip()
    result: dict = {"modules": {}, "survivors": {}, "groups": {}, "ref": ref}
    rc = 0
    for name, mods, tests in plan:
        code, part = run_group(name, mods, tests, Path(args.work) / name, args.max_children, args.keep, ref)
        rc = rc or code
        result["modules"].update(part["modules"])
        result["survivors"].update(part["survivors"])
        result["groups"][name] = {"modules": mods, "tests": tests, "mutmut_exit": code}
    result["command"] = "make mutation"
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'module':45} {'killed':>7} {'survived':>9} {'timeout':>8} {'no tests':>9} {'score':>6}")
    for mod, c in result["modules"].items():
        score = "-" if c["score"] is None else f"{c['score']:.0%}"
        print(f"{mod:45} {c['killed']:7} {c['survived']:9} {c['timeout']:8} {c['no_tests']:9} {score:>6}")
    print(f"\nwrote {out} ({result['seconds']} s); a survivor's diff: cd {args.work}/<group> && "
          ".venv/bin/mutmut show <name>")
    return rc


if __name__ == "__main__":
    sys.exit(main())
