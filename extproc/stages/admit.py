"""Stage `admit`: tenant identity and admission control (per-tenant CPU quota) at request headers.

What: when the config declares tenants, every inference request must carry one: the tenant id
arrives as stream metadata (`x-adapter-tenant`), which Envoy fills per route from the tenancy
header (set by Envoy from a verified JWT claim, or by an authenticating proxy in front) or, on a
route that declares `policy.tenantHeader`, from that client header. No tenant is a 401, an unknown
one a 403. A tenant with a CPU quota is refused with 429, `Retry-After` and a JSON error naming the
tenant and the quota while, over the tenant agent's last window, its measured CPU use is above
`limit * (1 + burst)` OR the kernel throttled its cgroup for more than `burst` of the window. The
second test matters because the cgroup's CFS quota caps measured use at the limit: a tenant pinned
at its cap is demanding more than its quota, and shows it only by being throttled. Other tenants
are unaffected. The agent's numbers come from its shared-memory
snapshot (`ebpf/snapshot.py`), read in place without blocking; a snapshot older than
`tenancy.staleAfter` (agent dead or stuck) is marked stale and `tenancy.stalePolicy` applies
(default: admit), as does a missing one.
Why here: the cgroup limit caps what a tenant's workload can burn; admission stops the gateway from
queueing work for a tenant that is already over, before any backend sees it.
The snapshot reader lives in the worker's runtime, so a config reload keeps it (and its warning state).
Cost: a dict lookup; with a quota, one `os.stat` at most every 5 ms plus a FlatBuffers field read.
"""

from __future__ import annotations

import logging
from typing import Any

from extproc.errors import reject
from extproc.types import HttpMessage, RequestState, Verdict

log = logging.getLogger(__name__)


class Admit:
    name = "admit"

    def __init__(self) -> None:
        self._own: dict[str, Any] = {}  # used only without a runtime (unit tests)

    def _memo(self, state: RequestState) -> dict[str, Any]:
        return state.runtime.cache("admit") if state.runtime is not None else self._own

    def _snapshot(self, state: RequestState, tenancy: Any) -> Any:
        memo = self._memo(state)
        key = (tenancy.snapshot, tenancy.stale_after)
        reader = memo.get(key)
        if reader is None:
            from ebpf.snapshot import SnapshotReader

            reader = memo[key] = SnapshotReader(tenancy.snapshot, stale_after_s=tenancy.stale_after)
        return reader.current()

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        snap = state.snapshot
        tenants = snap.tenants_by_id
        if not tenants:
            return None  # tenancy is off
        tenant_id = state.tenant
        route = state.route
        if not tenant_id:
            header = route.tenant_header or snap.tenancy.header
            return reject(401, "tenant_required", f"this route serves tenants: the request carries no tenant "
                          f"(expected from {header})")
        tenant = tenants.get(tenant_id)
        if tenant is None:
            state.tenant = None  # never label metrics with arbitrary client input
            return reject(403, "unknown_tenant", f"tenant {tenant_id!r} is not configured on this gateway")
        if tenant.cpu is None:
            return None
        tenancy = snap.tenancy
        reading = self._snapshot(state, tenancy)
        view = reading.tenant(tenant_id) if reading is not None else None
        memo = self._memo(state)
        if reading is None or reading.stale or view is None:
            state.quota_stale = True
            if not memo.get("warned_stale"):
                memo["warned_stale"] = True
                age = f"{reading.age_s:.1f}s old" if reading is not None else "missing"
                log.warning("tenant agent snapshot %s is %s; applying stalePolicy=%s", tenancy.snapshot, age,
                            tenancy.stale_policy)
            if tenancy.stale_policy == "reject":
                return reject(503, "quota_data_stale", "tenant CPU measurements are unavailable and this gateway "
                              "refuses requests without them", tenant=tenant_id)
            return None
        memo["warned_stale"] = False
        allowance = tenant.cpu.limit * (1.0 + tenant.cpu.burst)
        used = view.cpu_used
        window_ns = max(1, view.window_end_mono_ns - view.window_start_mono_ns)
        throttled = view.throttled_window_ns / window_ns
        if used > allowance or throttled > tenant.cpu.burst:
            return reject(
                429, "tenant_over_quota",
                f"tenant {tenant_id} used {used:.3f} CPU over the last window and was throttled "
                f"{throttled:.0%} of it; its quota is {tenant.cpu.limit:g} CPU (+{tenant.cpu.burst:.0%} burst)",
                retry_after=tenancy.retry_after, tenant=tenant_id, cpu_used=round(used, 4),
                throttled_share=round(throttled, 4), cpu_limit=tenant.cpu.limit, burst=tenant.cpu.burst)
        return None
