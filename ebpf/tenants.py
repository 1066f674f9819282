"""Tenant lists for the agent: from an AdapterGateway config, a small YAML file, or a command line.

Accepted forms (`load_tenants(source)`):
  - a YAML file holding an AdapterGateway config: `spec.tenants: [{id, cpu: {limit, burst}, processes}]`
    (the same fields the processor's config has, see docs/config.md);
  - a YAML file with a top-level `tenants:` list, or just the list; items may add `pids: [..]`,
    processes the agent places in the tenant's cgroups (and places again if the cgroup is recreated);
  - an inline string `id[=limit[:burst]],...`: `acme=0.5,beta=500m:0.2,gamma` (gamma: unlimited).
`limit` is CPUs (0.5) or millicores ("500m"); `burst` a share of the limit (0.2 = +20 %).
`tenants_from(objs)` converts already-parsed config objects (anything with `.id` and `.cpu.limit`
/ `.cpu.burst`, e.g. the processor's compiled config) without reading a file.
Errors raise QuotaError listing every problem, before anything is written anywhere.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import yaml

from ebpf.cgroups import QuotaError, TenantSpec, parse_cpu, validate


def _spec(item: Any, where: str, problems: list[str]) -> TenantSpec | None:
    if isinstance(item, dict):
        tid, cpu, pids = item.get("id"), item.get("cpu"), item.get("pids", ())
        processes = item.get("processes", ())
        unknown = set(item) - {"id", "cpu", "pids", "processes"}
        if unknown:
            problems.append(f"{where}: unknown field(s) {sorted(unknown)}")
        limit = burst = None
        if cpu is not None:
            if not isinstance(cpu, dict):
                problems.append(f"{where}: cpu must be a mapping with limit and burst")
                return None
            limit, burst = cpu.get("limit"), cpu.get("burst", 0)
    else:  # an object from a parsed config
        tid, cpu, pids = getattr(item, "id", None), getattr(item, "cpu", None), getattr(item, "pids", ())
        processes = getattr(item, "processes", ())
        limit = getattr(cpu, "limit", None) if cpu is not None else None
        burst = getattr(cpu, "burst", 0) if cpu is not None else 0
    try:
        limit_f = None if limit is None else parse_cpu(limit)
    except ValueError as e:
        problems.append(f"{where} ({tid}): {e}")
        return None
    try:
        burst_f = float(burst or 0)
    except (TypeError, ValueError):
        problems.append(f"{where} ({tid}): invalid burst {burst!r}")
        return None
    if not isinstance(pids, (list, tuple)):
        problems.append(f"{where} ({tid}): pids must be a list")
        return None
    if not isinstance(processes, (list, tuple)) or not all(isinstance(x, str) and x for x in processes):
        problems.append(f"{where} ({tid}): processes must be a list of command-line patterns")
        return None
    return TenantSpec(id=tid, cpu_limit=limit_f, burst=burst_f, pids=tuple(pids), processes=tuple(processes))


def tenants_from(items: Iterable[Any], where: str = "tenants") -> list[TenantSpec]:
    problems: list[str] = []
    specs = [s for i, item in enumerate(items) if (s := _spec(item, f"{where}[{i}]", problems)) is not None]
    problems += validate(specs)
    if problems:
        raise QuotaError(problems)
    return specs


def parse_inline(text: str) -> list[TenantSpec]:
    items = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        tid, _, rest = part.partition("=")
        limit, _, burst = rest.partition(":")
        cpu = None
        if limit and limit not in ("unlimited", "none", "max"):
            cpu = {"limit": limit, "burst": burst or 0}
        items.append({"id": tid.strip(), "cpu": cpu})
    return tenants_from(items, "--tenants")


def load_tenants(source: str) -> list[TenantSpec]:
    """Tenants from a file path (YAML) or an inline `id=limit[:burst],...` string."""
    if not os.path.exists(source):
        if source.endswith((".yaml", ".yml", ".json")) or os.sep in source:
            raise QuotaError([f"{source}: no such file"])
        return parse_inline(source)
    with open(source) as f:
        try:
            doc = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise QuotaError([f"{source}: invalid YAML: {e}"]) from None
    if isinstance(doc, dict) and isinstance(doc.get("spec"), dict):
        items, where = doc["spec"].get("tenants") or [], f"{source}: spec.tenants"
    elif isinstance(doc, dict):
        items, where = doc.get("tenants") or [], f"{source}: tenants"
    elif isinstance(doc, list):
        items, where = doc, source
    elif doc is None:
        items, where = [], source
    else:
        raise QuotaError([f"{source}: expected an AdapterGateway config, a mapping with tenants, or a list"])
    if not isinstance(items, list):
        raise QuotaError([f"{where}: must be a list"])
    return tenants_from(items, where)


def config_snapshot_path(source: str) -> str | None:
    """`spec.tenancy.snapshot` of an AdapterGateway config file (where the processor reads), or None."""
    if not os.path.isfile(source):
        return None
    try:
        with open(source) as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    spec = doc.get("spec") if isinstance(doc, dict) else None
    tenancy = spec.get("tenancy") if isinstance(spec, dict) else None
    path = tenancy.get("snapshot") if isinstance(tenancy, dict) else None
    return path if isinstance(path, str) and path else None
