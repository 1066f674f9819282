"""Layering: which package may import which, and what the processor needs installed.

- `backends/` imports nothing from `extproc/` (the processor imports `backends`, never the reverse);
  the errors adapters catch are defined in `backends/base.py` and re-exported by the processor.
- The ONNX Runtime server and the simulators are extras (`ort`, `sim` in pyproject.toml): the
  processor imports and loads a config with those packages blocked.
- One tenant model: the tenant agent (`ebpf/`) parses tenants with the config's schema and refuses
  what the processor's config refuses, with the same message.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

# --------------------------------------------------------------------------------------------------
# (a) backends/ never imports extproc/


def imports_of(source: str, filename: str = "<src>") -> list[tuple[int, str]]:
    """(line, module) of every import in `source`: module level, inside functions, relative ones
    resolved against nothing (kept as written), and importlib.import_module / __import__ calls."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else "")
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def offending(root: Path, forbidden: str) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for line, module in imports_of(path.read_text(), str(path)):
            if module == forbidden or module.startswith(forbidden + "."):
                out.append(f"{path.relative_to(REPO)}:{line}: imports {module}")
    return out


def test_the_import_scan_sees_every_form():
    src = """
from extproc.template import MissingPathError
import extproc.semantic.mapping as m
def f():
    from extproc import config
    import importlib
    importlib.import_module("extproc.stream")
    __import__("extproc")
"""
    assert sorted(imports_of(src)) == [(2, "extproc.template"), (3, "extproc.semantic.mapping"), (5, "extproc"),
                                       (6, "importlib"), (7, "extproc.stream"), (8, "extproc")]


def test_backends_import_nothing_from_extproc():
    files = list((REPO / "backends").rglob("*.py"))
    assert len(files) > 10  # the adapters, the simulators and the ONNX Runtime server are all scanned
    assert offending(REPO / "backends", "extproc") == []


def test_the_config_schema_imports_nothing_from_ebpf():
    """ebpf -> extproc.config.schema is the allowed direction; the schema must not import back."""
    mods = [m for _, m in imports_of((REPO / "extproc" / "config" / "schema.py").read_text())]
    assert not [m for m in mods if m == "ebpf" or m.startswith("ebpf.")]


# --------------------------------------------------------------------------------------------------
# (b) the processor imports without the ort / sim extras

PROCESSOR_MODULES = ("extproc.server", "extproc.stream", "extproc.config.loader", "extproc.stages",
                     "extproc.supervisor", "extproc.cli", "backends", "ebpf.snapshot", "ebpf.agent")


def _dist_to_module(requirement: str) -> str:
    return re.split(r"[\[=<>!~; ]", requirement, maxsplit=1)[0].lower().replace("-", "_")


def extras_only_modules() -> set[str]:
    """Import names of everything in the `ort` and `sim` extras that the core dependencies lack."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {_dist_to_module(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    return {_dist_to_module(r) for name in ("ort", "sim") for r in extras[name]} - core


def test_the_ort_and_sim_packages_are_extras_not_dependencies():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {_dist_to_module(r) for r in project["dependencies"]}
    assert {"onnxruntime", "onnx", "numpy", "ml_dtypes", "uvicorn", "httptools", "hypercorn"} <= extras_only_modules()
    assert not core & {"onnxruntime", "onnx", "numpy", "ml_dtypes", "uvicorn", "httptools", "hypercorn"}
    assert "'.[test,ort,sim]'" in (REPO / "Makefile").read_text()  # make run / make test still have them


BLOCKED_RUN = r"""
import importlib, importlib.abc, importlib.machinery, json, sys

BLOCKED = set(json.loads(sys.argv[1]))

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: an ort/sim extra)", name=name)
        return None

sys.meta_path.insert(0, Blocker())
# Code that probes for a package without importing it (flatbuffers looks for numpy this way) asks the
# path finder directly: make the blocked packages absent there too, as on a processor-only install.
_find = importlib.machinery.PathFinder.find_spec.__func__
importlib.machinery.PathFinder.find_spec = classmethod(
    lambda cls, name, path=None, target=None: None if name.partition(".")[0] in BLOCKED else _find(cls, name, path, target))

for name in BLOCKED:  # the block works
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"{name} was not blocked")

for module in json.loads(sys.argv[2]):
    importlib.import_module(module)

import backends
from extproc.config.loader import load_file

adapters = {kind: cls() for kind, cls in backends.adapter_kinds().items()}
snap = load_file(sys.argv[3])
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
print(json.dumps({"routes": sorted(snap.routes), "adapters": sorted(adapters), "loaded": loaded}))
"""


def test_the_processor_imports_and_loads_its_config_without_the_extras():
    blocked = sorted(extras_only_modules())
    assert {"onnxruntime", "onnx", "numpy", "uvicorn"} <= set(blocked)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", BLOCKED_RUN, json.dumps(blocked), json.dumps(PROCESSOR_MODULES),
                        str(REPO / "examples" / "finance-llm-adapter.yaml")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["loaded"] == []
    assert "v1-fraud-score" in out["routes"] and "v1-analyze" in out["routes"]  # a tensor route and an llm route
    assert {"onnxruntime", "triton", "vllm", "openai", "rest"} <= set(out["adapters"])


# --------------------------------------------------------------------------------------------------
# (c) one tenant model: the agent refuses what the config refuses, with the same message

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: t}}
spec:
  routes: [{{path: /v1/x, target: "b:80"}}]
  tenants: [{{id: {tid}, cpu: {{limit: 500m}}}}]
"""


@pytest.mark.parametrize("tid", ["acme_eu", "acme.eu", "Acme", "-acme", "a" * 64])
def test_the_agent_refuses_a_tenant_id_the_config_refuses_with_the_same_message(tmp_path, tid):
    from ebpf.cgroups import QuotaError, TenantSpec, validate
    from ebpf.tenants import load_tenants
    from extproc.config.loader import ConfigError, load_text

    text = CONFIG.format(tid=tid)
    with pytest.raises(ConfigError) as cfg:
        load_text(text, "gateway.yaml")
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    with pytest.raises(QuotaError) as agent:
        load_tenants(str(path))
    (problem,) = agent.value.problems
    reason = problem.split(": id: ", 1)[1]
    assert f"spec.tenants[0].id: {reason}" in str(cfg.value), (problem, str(cfg.value))
    with pytest.raises(QuotaError) as inline:  # the agent's command line: the same rule and message
        load_tenants(f"{tid}=0.5")
    assert inline.value.problems[0].endswith(f"id: {reason}")
    assert validate([TenantSpec(tid, 0.5)]) == [f"tenant {tid!r}: id: {reason}"]  # Agent([...]) directly


def test_the_agent_accepts_what_the_config_accepts(tmp_path):
    from ebpf.cgroups import TenantSpec
    from ebpf.tenants import load_tenants
    from extproc.config.loader import load_text

    text = CONFIG.format(tid="acme-eu-1")
    load_text(text, "gateway.yaml")  # the processor accepts it
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    assert load_tenants(str(path)) == [TenantSpec("acme-eu-1", 0.5)]
