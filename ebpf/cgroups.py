"""Per-tenant cgroups: create, limit, place processes, diff-apply changes, repair removals.

What: `CgroupManager` keeps one cgroup per tenant under a root named `adapter-gateway`:
  - cgroup v2 `<v2>/adapter-gateway/<tenant>`: attribution. The eBPF CPU program keys on-CPU time
    by v2 cgroup id (= the inode number of this directory); on a pure v2 host it also holds the limit.
  - cgroup v1 `cpu` `<cpu>/adapter-gateway/<tenant>`: the limit, `cpu.cfs_quota_us` /
    `cpu.cfs_period_us` (hybrid hosts such as this one, where the v1 cpu controller is bound).
  - cgroup v1 `cpuacct` `<cpuacct>/adapter-gateway/<tenant>` when cpuacct is its own hierarchy: the
    kernel's own CPU counter (`cpuacct.usage`), used by the polling fallback and to check eBPF.
A tenant's processes are placed in every one of these.
Limits: `limit` CPUs -> quota = limit * period (0.5 CPU = 50000/100000 us); unlimited -> -1 (v1) or
`max` (v2). Limits under 0.01 CPU lengthen the period (up to 1 s) so the quota stays >= 1 ms, the
kernel's minimum; below 0.001 CPU, or above 1024 CPUs, a limit is refused. The config's `burst` is
not written to the kernel: it is the gateway's admission allowance, carried in the snapshot.
Why: no BPF program can enforce a CPU quota; CFS bandwidth control written from user space does.
Cost: a few small file writes per tenant on apply; `check()` is a few stat calls per tenant.
Needs root (writes under /sys/fs/cgroup). `root` and `mounts` can point elsewhere for tests.
Tenant model: the config's (`extproc.config.schema.TenantSpec`: the id is a DNS label, the same rule
and message as the processor's config); `TenantSpec` here is what the agent applies, built from it
by `ebpf.tenants`.
"""

from __future__ import annotations

import errno
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError

from extproc.config import schema

log = logging.getLogger("ebpf.cgroups")

ROOT_NAME = "adapter-gateway"
DEFAULT_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # kernel minimum for cfs_quota_us / cpu.max
MAX_PERIOD_US = 1_000_000
MIN_CPU = 0.001
MAX_CPU = 1024.0


class QuotaError(ValueError):
    """Invalid tenants or limits; nothing was written. `problems` lists every one."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class TenantSpec:
    """A tenant as the agent applies it: id, CPU limit (None = unlimited), burst share, pids to place,
    and `processes`: command-line glob patterns of processes to place (found by scanning /proc).
    Parsed tenants come from the config's model (`from_config`); only `pids` is the agent's own."""

    id: str
    cpu_limit: float | None = None
    burst: float = 0.0
    pids: tuple[int, ...] = ()
    processes: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, tenant: schema.TenantSpec, pids: Iterable[int] = ()) -> "TenantSpec":
        cpu = tenant.cpu
        return cls(id=tenant.id, cpu_limit=None if cpu is None else cpu.limit, burst=0.0 if cpu is None else cpu.burst,
                   pids=tuple(pids), processes=tuple(tenant.processes))


def config_problems(err: ValidationError, model: type[BaseModel] = schema.TenantSpec,
                    extra_fields: Iterable[str] = ()) -> list[str]:
    """A config-schema validation error as `field.path: reason` lines, worded as the processor's config
    loader words them (so the agent and the processor refuse a tenant with the same message)."""
    out = []
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if isinstance(p, int) or not ("[" in p or p in ("int", "str", "float", "none")))
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "<tenant>"
        if e["type"] == "extra_forbidden":
            allowed = _fields_at(model, loc[:-1]) + (list(extra_fields) if len(loc) == 1 else [])
            reason = "unknown field" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
        elif e["type"] == "missing":
            reason = "required field is missing"
        else:
            reason = e["msg"]
            for prefix in ("Value error, ", "Assertion failed, "):
                if reason.startswith(prefix):
                    reason = reason[len(prefix):]
        out.append(f"{path}: {reason}")
    return out


def _fields_at(model: Any, loc: tuple) -> list[str]:
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model is not None else None
        args = (field.annotation, *getattr(field.annotation, "__args__", ())) if field is not None else ()
        model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return [f.alias or n for n, f in model.model_fields.items()]


def id_problem(tenant_id: Any) -> str | None:
    """The config's rule for a tenant id (`schema.TenantSpec.id`), with its message; None when valid."""
    try:
        schema.TenantSpec.model_validate({"id": tenant_id})
    except ValidationError as e:
        return "; ".join(config_problems(e))
    return None


def quota_for(cpu_limit: float | None, period_us: int = DEFAULT_PERIOD_US) -> tuple[int, int]:
    """(quota_us, period_us) for a limit in CPUs; (-1, period) when unlimited. Raises ValueError."""
    if cpu_limit is None:
        return -1, period_us
    if not isinstance(cpu_limit, (int, float)) or isinstance(cpu_limit, bool) or not math.isfinite(cpu_limit):
        raise ValueError(f"CPU limit must be a finite number, got {cpu_limit!r}")
    if not MIN_CPU <= cpu_limit <= MAX_CPU:
        raise ValueError(f"CPU limit must be between {MIN_CPU} and {MAX_CPU:g} CPUs, got {cpu_limit!r}")
    quota = round(cpu_limit * period_us)
    if quota < MIN_QUOTA_US:  # small limits: a longer period keeps the quota at the kernel's 1 ms minimum
        period_us = min(MAX_PERIOD_US, math.ceil(MIN_QUOTA_US / cpu_limit))
        quota = max(MIN_QUOTA_US, round(cpu_limit * period_us))
    return quota, period_us


def validate(tenants: Iterable[TenantSpec], period_us: int = DEFAULT_PERIOD_US) -> list[str]:
    """Every problem with a set of tenants, as 'tenant X: reason' strings (empty when valid)."""
    problems: list[str] = []
    seen: set[str] = set()
    for t in tenants:
        if (why := id_problem(t.id)) is not None:
            problems.append(f"tenant {t.id!r}: {why}")
        elif t.id in seen:
            problems.append(f"tenant {t.id!r}: duplicate id")
        seen.add(t.id)
        try:
            quota_for(t.cpu_limit, period_us)
        except ValueError as e:
            problems.append(f"tenant {t.id!r}: {e}")
        if not isinstance(t.burst, (int, float)) or not math.isfinite(t.burst) or not 0 <= t.burst <= 10:
            problems.append(f"tenant {t.id!r}: burst must be between 0 and 10 (a share of the limit), got {t.burst!r}")
        for pid in t.pids:
            if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                problems.append(f"tenant {t.id!r}: invalid pid {pid!r}")
    return problems


# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CgroupLayout:
    """Where the hierarchies are mounted. `detect()` reads /proc/self/mounts."""

    v2: Path | None = None          # cgroup2 mount (unified or hybrid "unified" dir)
    cpu: Path | None = None         # v1 hierarchy with the cpu controller
    cpuacct: Path | None = None     # v1 hierarchy with cpuacct (may equal cpu when co-mounted)
    v2_cpu: bool = False            # the v2 root offers the cpu controller (pure v2 host)

    @property
    def kind(self) -> str:
        if self.cpu is not None:
            return "hybrid" if self.v2 is not None else "v1"
        return "v2" if self.v2 is not None else "none"

    @property
    def limit_via(self) -> str:
        """Which interface holds limits: 'v1' (cfs_quota_us), 'v2' (cpu.max) or 'none'."""
        if self.cpu is not None:
            return "v1"
        return "v2" if self.v2 is not None and self.v2_cpu else "none"

    @classmethod
    def detect(cls, mounts: str = "/proc/self/mounts") -> "CgroupLayout":
        v2 = cpu = cpuacct = None
        try:
            lines = Path(mounts).read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            parts = line.split()
            if len(parts) < 4:
                continue
            mnt, fstype, opts = parts[1], parts[2], set(parts[3].split(","))
            if fstype == "cgroup2" and v2 is None:
                v2 = Path(mnt)
            elif fstype == "cgroup":
                if "cpu" in opts and cpu is None:
                    cpu = Path(mnt)
                if "cpuacct" in opts and cpuacct is None:
                    cpuacct = Path(mnt)
        v2_cpu = False
        if v2 is not None:
            try:
                v2_cpu = "cpu" in (v2 / "cgroup.controllers").read_text().split()
            except OSError:
                pass
        return cls(v2=v2, cpu=cpu, cpuacct=cpuacct, v2_cpu=v2_cpu and cpu is None)


@dataclass
class TenantCgroup:
    """The directories of one tenant (None where that hierarchy is absent)."""

    v2: Path | None
    cpu: Path | None
    cpuacct: Path | None

    def dirs(self) -> list[Path]:
        seen: list[Path] = []
        for p in (self.v2, self.cpu, self.cpuacct):
            if p is not None and p not in seen:
                seen.append(p)
        return seen


@dataclass
class ApplyResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.created or self.updated or self.removed)


@dataclass(frozen=True)
class Throttle:
    nr_periods: int = 0
    nr_throttled: int = 0
    throttled_ns: int = 0


class CgroupManager:
    """Owns `<hierarchy>/<name>/<tenant>` cgroups. Not thread-safe; one per agent.

    apply(tenants)    diff-apply: create new tenants, rewrite changed limits, remove dropped tenants
                      (their processes move to the hierarchy root first). Validates everything
                      first: QuotaError, and nothing written, on any invalid tenant.
    check()           recreate tenant cgroups removed underneath us (limit rewritten, configured
                      pids placed again); returns {tenant: [recreated dirs]} and logs a warning.
    place(t, pid)     move a process into all of the tenant's cgroups.
    usage_ns(t)       the kernel's own CPU counter for the tenant (cpuacct.usage, else v2 usage_usec).
    throttle(t)       CFS throttling counters (v1 cpu.stat, or v2 cpu.stat on pure v2 hosts).
    cgroup_id(t)      the v2 cgroup id (inode of the v2 dir), what bpf_get_current_cgroup_id() returns.
    close(remove)     with remove=True: move processes out and delete every tenant cgroup and the root.
    """

    def __init__(self, name: str = ROOT_NAME, layout: CgroupLayout | None = None,
                 period_us: int = DEFAULT_PERIOD_US):
        self.name = name
        self.layout = layout or CgroupLayout.detect()
        self.period_us = period_us
        self.tenants: dict[str, TenantSpec] = {}
        self.recreated: dict[str, int] = {}
        self._paths: dict[str, TenantCgroup] = {}
        if self.layout.kind == "none":
            raise RuntimeError("no cgroup hierarchy with the cpu controller or cgroup2 is mounted")

    # --- paths -------------------------------------------------------------------------------------
    def _base(self, mount: Path | None) -> Path | None:
        return None if mount is None else mount / self.name

    def paths(self, tenant: str) -> TenantCgroup:
        p = self._paths.get(tenant)
        if p is None:
            lay = self.layout
            cpuacct = lay.cpuacct if lay.cpuacct is not None and lay.cpuacct != lay.cpu else None
            p = self._paths[tenant] = TenantCgroup(
                v2=None if lay.v2 is None else lay.v2 / self.name / tenant,
                cpu=None if lay.cpu is None else lay.cpu / self.name / tenant,
                cpuacct=None if cpuacct is None else cpuacct / self.name / tenant,
            )
        return p

    def limit_dir(self, tenant: str) -> Path | None:
        p = self.paths(tenant)
        return p.cpu if self.layout.limit_via == "v1" else (p.v2 if self.layout.limit_via == "v2" else None)

    def cgroup_id(self, tenant: str) -> int:
        p = self.paths(tenant).v2
        if p is None:
            return 0
        try:
            return os.stat(p).st_ino
        except FileNotFoundError:
            return 0

    # --- apply -------------------------------------------------------------------------------------
    def apply(self, tenants: Iterable[TenantSpec]) -> ApplyResult:
        tenants = list(tenants)
        problems = validate(tenants, self.period_us)
        if problems:
            raise QuotaError(problems)
        res = ApplyResult()
        desired = {t.id: t for t in tenants}
        for tid in [t for t in self.tenants if t not in desired]:
            self.remove(tid)
            res.removed.append(tid)
        self._ensure_root()
        for tid, spec in desired.items():
            old = self.tenants.get(tid)
            created = self._ensure_dirs(tid)
            if created or old is None or old.cpu_limit != spec.cpu_limit:
                self._write_limit(tid, spec.cpu_limit)
            for pid in spec.pids:
                self.place(tid, pid, missing_ok=True)
            self.tenants[tid] = spec
            if old is None or created:
                res.created.append(tid)
            elif old != spec:
                res.updated.append(tid)
            else:
                res.unchanged.append(tid)
        if res:
            log.info("cgroups applied: created=%s updated=%s removed=%s", res.created, res.updated, res.removed)
        return res

    def _ensure_root(self) -> None:
        lay = self.layout
        for mount in {lay.v2, lay.cpu, lay.cpuacct} - {None}:
            base = mount / self.name
            base.mkdir(exist_ok=True)
        if lay.limit_via == "v2":  # pure v2: the cpu controller must be enabled down to the tenants
            for d in (lay.v2, lay.v2 / self.name):
                self._enable_cpu(d)

    @staticmethod
    def _enable_cpu(d: Path) -> None:
        try:
            if "cpu" not in (d / "cgroup.subtree_control").read_text().split():
                (d / "cgroup.subtree_control").write_text("+cpu")
        except OSError as e:
            log.warning("cannot enable the cpu controller in %s: %s", d, e)

    def _ensure_dirs(self, tenant: str) -> list[Path]:
        created = []
        for d in self.paths(tenant).dirs():
            if not d.is_dir():
                d.parent.mkdir(exist_ok=True)
                d.mkdir(exist_ok=True)
                created.append(d)
        return created

    def _write_limit(self, tenant: str, cpu_limit: float | None) -> None:
        quota, period = quota_for(cpu_limit, self.period_us)
        d = self.limit_dir(tenant)
        if d is None:
            if cpu_limit is not None:
                log.warning("tenant %s: no cgroup interface for CPU limits on this host; limit not enforced", tenant)
            return
        if self.layout.limit_via == "v1":
            # Lift the quota first so any period change is accepted, then set period, then quota.
            (d / "cpu.cfs_quota_us").write_text("-1")
            (d / "cpu.cfs_period_us").write_text(str(period))
            (d / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (d / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {period}")

    def read_limit(self, tenant: str) -> tuple[int, int] | None:
        """(quota_us, period_us) as the kernel has it; quota -1 = unlimited. None when unavailable."""
        d = self.limit_dir(tenant)
        try:
            if self.layout.limit_via == "v1":
                return (int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text()))
            if self.layout.limit_via == "v2":
                q, p = (d / "cpu.max").read_text().split()
                return (-1 if q == "max" else int(q), int(p))
        except (OSError, ValueError, TypeError):
            pass
        return None

    # --- repair ------------------------------------------------------------------------------------
    def check(self) -> dict[str, list[str]]:
        """Recreate tenant cgroups removed underneath us; report {tenant: [dirs recreated]}."""
        out: dict[str, list[str]] = {}
        for tid, spec in self.tenants.items():
            dirs = self.paths(tid).dirs()
            if all(d.is_dir() for d in dirs):
                continue
            self._ensure_root()
            created = self._ensure_dirs(tid)
            if not created:
                continue
            self._write_limit(tid, spec.cpu_limit)
            for pid in spec.pids:
                self.place(tid, pid, missing_ok=True)
            self.recreated[tid] = self.recreated.get(tid, 0) + 1
            out[tid] = [str(d) for d in created]
            log.warning("tenant %s: cgroup removed underneath the agent; recreated %s (limit re-applied, "
                        "processes outside the configured pids are no longer in it)", tid, ", ".join(out[tid]))
        return out

    # --- processes ---------------------------------------------------------------------------------
    def place(self, tenant: str, pid: int, missing_ok: bool = False) -> bool:
        """Move process `pid` into the tenant's cgroups (v2 first). False if the process is gone."""
        for d in self.paths(tenant).dirs():
            try:
                (d / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                if missing_ok:
                    return False
                raise
            except OSError as e:
                if e.errno == errno.ESRCH and missing_ok:
                    return False
                raise
        return True

    def procs(self, tenant: str) -> list[int]:
        p = self.paths(tenant)
        d = p.v2 or p.cpu
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except (OSError, ValueError, TypeError):
            return []

    # --- counters ----------------------------------------------------------------------------------
    def usage_ns(self, tenant: str) -> int | None:
        """The kernel's cumulative CPU time of the tenant's cgroup in ns, or None if unreadable."""
        p = self.paths(tenant)
        acct = p.cpuacct or (p.cpu if self.layout.cpuacct is not None and self.layout.cpuacct == self.layout.cpu
                             else None)
        if acct is not None:
            try:
                return int((acct / "cpuacct.usage").read_text())
            except (OSError, ValueError):
                pass
        if p.v2 is not None:
            stat = _read_kv(p.v2 / "cpu.stat")
            if "usage_usec" in stat:
                return stat["usage_usec"] * 1000
        return None

    def throttle(self, tenant: str) -> Throttle:
        d = self.limit_dir(tenant)
        if d is None:
            return Throttle()
        s = _read_kv(d / "cpu.stat")
        ns = s.get("throttled_time", s.get("throttled_usec", 0) * 1000)
        return Throttle(s.get("nr_periods", 0), s.get("nr_throttled", 0), ns)

    # --- removal -----------------------------------------------------------------------------------
    def remove(self, tenant: str) -> None:
        """Move the tenant's processes to each hierarchy's root, then delete its cgroups."""
        lay = self.layout
        p = self.paths(tenant)
        for d, mount in ((p.v2, lay.v2), (p.cpu, lay.cpu), (p.cpuacct, lay.cpuacct)):
            if d is None or not d.is_dir():
                continue
            _evacuate(d, mount)
            try:
                d.rmdir()
            except OSError as e:
                log.warning("tenant %s: cannot remove %s: %s", tenant, d, e)
        self.tenants.pop(tenant, None)
        self.recreated.pop(tenant, None)

    def close(self, remove: bool = False) -> None:
        if not remove:
            return
        for tid in list(self.tenants):
            self.remove(tid)
        for mount in {self.layout.v2, self.layout.cpu, self.layout.cpuacct} - {None}:
            base = mount / self.name
            if base.is_dir():
                for child in base.iterdir():  # leftovers of an earlier run with other tenants
                    if child.is_dir():
                        _evacuate(child, mount)
                        try:
                            child.rmdir()
                        except OSError:
                            pass
                try:
                    base.rmdir()
                except OSError as e:
                    log.warning("cannot remove %s: %s", base, e)


def _evacuate(d: Path, mount: Path) -> None:
    try:
        pids = (d / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        try:
            (mount / "cgroup.procs").write_text(pid)
        except OSError:
            pass


def _read_kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        try:
            out[k] = int(v)
        except ValueError:
            pass
    return out
