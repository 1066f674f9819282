"""Policy: fairness between tenants within a priority class, weighted by tokens; Jain's index.

What: when several tenants of one class wait in a pool's queue (`extproc/qos/queue.py`), which
tenant's request goes next. Start-time fair queueing over estimated tokens (a per-tenant virtual
time, the token-weighted form of deficit round robin):
    pick      = the waiting tenant t with the smallest max(vtime[t], V)   (ties: the oldest request)
    on admit  : start = max(vtime[t], V);  V = start;  vtime[t] = start + tokens / weight[t]
`V` is the class's virtual clock (the start of the last admitted request), so a tenant that was idle
starts at `V`, banking no credit for the time it sent nothing; a tenant sending 10x its share waits
behind the others' cheaper requests instead of filling the pool. `tokens` is the request's estimate
(prompt characters / 4 + max_tokens, the token budget's estimate; 1 when unknown), `weight` the
tenant's `spec.qos.tenants[].weight` (default 1; requests without a tenant share one flow).
Jain's fairness index over the weighted tokens x_t admitted from the queue per tenant that waited in
it during a window: J = (sum x)^2 / (n * sum x^2), 1 when equal, 1/n when one tenant got everything.
Cost: a pick is O(waiting tenants of the class) (a handful); the index O(tenants) once per window.
"""

from __future__ import annotations

from typing import Iterable


def jain(values: Iterable[float]) -> float | None:
    """Jain's fairness index of `values` (None for no values; 1.0 when all are zero)."""
    xs = [float(v) for v in values]
    if not xs:
        return None
    sq = sum(x * x for x in xs)
    if sq == 0:
        return 1.0
    total = sum(xs)
    return total * total / (len(xs) * sq)


class FairShare:
    """One class's virtual clock and tenants' virtual times (in a pool's queue)."""

    __slots__ = ("vtime", "clock")

    def __init__(self) -> None:
        self.vtime: dict[str | None, float] = {}
        self.clock = 0.0  # V

    def key(self, tenant: str | None) -> float:
        """The tenant's virtual start if it were picked now (smaller goes first)."""
        v = self.vtime.get(tenant, 0.0)
        return v if v > self.clock else self.clock

    def charge(self, tenant: str | None, tokens: float, weight: float) -> None:
        start = self.key(tenant)
        self.clock = start
        self.vtime[tenant] = start + max(tokens, 1.0) / (weight if weight > 0 else 1.0)
        if len(self.vtime) > 4096:  # tenants long idle are at or below V: forgetting them changes nothing
            self.vtime = {t: v for t, v in self.vtime.items() if v > self.clock}


class JainWindow:
    """Weighted tokens admitted from the queue per tenant that waited during the current window."""

    __slots__ = ("served", "last")

    def __init__(self) -> None:
        self.served: dict[str | None, float] = {}
        self.last: float | None = None

    def waiting(self, tenant: str | None) -> None:
        self.served.setdefault(tenant, 0.0)

    def admitted(self, tenant: str | None, tokens: float, weight: float) -> None:
        self.served[tenant] = self.served.get(tenant, 0.0) + max(tokens, 1.0) / (weight if weight > 0 else 1.0)

    def close(self) -> float | None:
        """The window's index (None when no tenant waited: there was no contention to be fair about)."""
        value = jain(self.served.values()) if len(self.served) > 0 else None
        self.served = {}
        if value is not None:
            self.last = value
        return value


__all__ = ["jain", "FairShare", "JainWindow"]
