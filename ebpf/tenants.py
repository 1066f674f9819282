"""Tenant lists for the agent: from an AdapterGateway config, a small YAML file, or a command line.

Accepted forms (`load_tenants(source)`):
  - a YAML file holding an AdapterGateway config: `spec.tenants: [{id, cpu: {limit, burst}, processes}]`
    (the processor's config, see docs/config.md);
  - a YAML file with a top-level `tenants:` list, or just the list; items may add `pids: [..]`,
    processes the agent places in the tenant's cgroups (and places again if the cgroup is recreated);
  - an inline string `id[=limit[:burst]],...`: `acme=0.5,beta=500m:0.2,gamma` (gamma: unlimited).
`limit` is CPUs (0.5) or millicores ("500m"); `burst` a share of the limit (0.2 = +20 %).
`tenants_from(objs)` converts already-parsed config objects (the processor's
`extproc.config.schema.TenantSpec`, or anything with `.id` and `.cpu.limit` / `.cpu.burst`) without
reading a file.
One tenant model: every form is validated by the config's own `extproc.config.schema.TenantSpec`
(id a DNS label, CPU quantities, burst range, unknown fields refused), so the agent accepts exactly the
tenants the processor accepts and refuses the others with the config's message; `pids` is the only
field of the agent's own (not in `spec.tenants`: the processor would refuse it there).
Errors raise QuotaError listing every problem, before anything is written anywhere.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from ebpf.cgroups import QuotaError, TenantSpec, config_problems, validate
from extproc.config.schema import TenantSpec as ConfigTenantSpec

AGENT_FIELDS = ("pids",)  # accepted in tenants files and lists, on top of the config's fields


def _spec(item: Any, where: str, problems: list[str], allow_pids: bool = True) -> TenantSpec | None:
    if isinstance(item, ConfigTenantSpec):  # already validated by the processor's config
        return TenantSpec.from_config(item)
    if isinstance(item, dict):
        fields = dict(item)
        pids = fields.pop("pids", ()) if allow_pids else ()
    else:  # an object from a parsed config
        cpu = getattr(item, "cpu", None)
        fields = {"id": getattr(item, "id", None), "processes": getattr(item, "processes", ())}
        if cpu is not None:
            fields["cpu"] = {k: v for k in ("limit", "burst") if (v := getattr(cpu, k, None)) is not None}
        pids = getattr(item, "pids", ())
    tid = fields.get("id")
    try:
        tenant = ConfigTenantSpec.model_validate(fields)
    except ValidationError as e:
        extra = AGENT_FIELDS if allow_pids else ()
        problems.extend(f"{where} ({tid}): {p}" for p in config_problems(e, ConfigTenantSpec, extra))
        return None
    if not isinstance(pids, (list, tuple)):
        problems.append(f"{where} ({tid}): pids must be a list")
        return None
    return TenantSpec.from_config(tenant, pids)


def tenants_from(items: Iterable[Any], where: str = "tenants", allow_pids: bool = True) -> list[TenantSpec]:
    """Validate tenants with the config's model and build the agent's specs; QuotaError lists every problem.
    `allow_pids=False`: exactly the config's fields (an AdapterGateway config's `spec.tenants`)."""
    problems: list[str] = []
    specs = [s for i, item in enumerate(items)
             if (s := _spec(item, f"{where}[{i}]", problems, allow_pids)) is not None]
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
    allow_pids = True
    if isinstance(doc, dict) and isinstance(doc.get("spec"), dict):  # the processor's config: its fields only
        items, where, allow_pids = doc["spec"].get("tenants") or [], f"{source}: spec.tenants", False
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
    return tenants_from(items, where, allow_pids)


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
