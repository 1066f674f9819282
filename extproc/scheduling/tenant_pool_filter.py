"""Filter `tenant-pool-filter`: keeps the endpoints of the pools the request's tenant may use.

What: tenants are mapped to endpoint label selectors (a "pool" is whatever labels name it:
`pool: gold`); a tenant listed in `tenants` keeps only the endpoints its selector matches, any
other request (a tenant not listed, or no tenant) the ones `default` matches, or every endpoint
when there is no `default`. The tenant is `state.tenant`, as the processor's tenancy set it from
Envoy's stream metadata and `admit` validated it (an unknown tenant was refused with 403 before
dispatch, so a client cannot name someone else's pool); the request body's fields are never read.
When nothing is left the profile refuses the request (503 `no_capacity`, 429 for sheddable ones):
a tenant is never sent to a pool it is not allowed.
Formula: sel = tenants.get(tenant, default); keep e iff sel is None or sel matches labels(e).
Parameters: `tenants` ({tenant id: {matchLabels: {...}} | {anyOf: [{matchLabels: {...}}, ...]}},
at least one); `default` (a selector, optional: without it unlisted requests are not restricted).
```yaml
- {type: tenant-pool-filter, parameters: {tenants: {acme: {matchLabels: {pool: gold}}},
                                          default: {matchLabels: {pool: shared}}}}
```
Data consumed: `state.tenant`, endpoint labels. Cost: a dict lookup, then one per label per candidate.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin
from extproc.scheduling.selectors import Selector


class TenantPoolFilterParameters(Parameters):
    tenants: dict[str, Selector] = Field(min_length=1)
    default: Selector | None = None


class TenantPoolFilter(Plugin):
    type: ClassVar[str] = "tenant-pool-filter"
    slot: ClassVar[str] = "filter"
    Parameters: ClassVar[type] = TenantPoolFilterParameters

    def selector(self, tenant: str | None) -> Selector | None:
        p = self.params
        sel = p.tenants.get(tenant) if tenant else None
        return sel if sel is not None else p.default

    def filter(self, ctx: Any, candidates: tuple[str, ...]) -> list[str] | tuple[str, ...]:
        sel = self.selector(ctx.state.tenant)
        return candidates if sel is None else sel.keep(ctx.labels, candidates)
