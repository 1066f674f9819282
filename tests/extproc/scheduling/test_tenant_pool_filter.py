"""Filter `tenant-pool-filter`: tenant -> allowed endpoint pools (label selectors), `default` for the others."""

from __future__ import annotations

import pytest

from extproc.config.loader import ConfigError, load_text
from extproc.scheduling import Filter, NoCapacity
from extproc.scheduling.tenant_pool_filter import TenantPoolFilter, TenantPoolFilterParameters
from tests.extproc.scheduling.fleet import A185, BARE, FLEET, G0, G1, built, ctx, fleet, plugin, state

POOLS = ("{tenants: {acme: {matchLabels: {pool: gold}}, "
         "globex: {anyOf: [{matchLabels: {pool: gold}}, {matchLabels: {pool: code}}]}, "
         "initech: {matchLabels: {pool: platinum}}}")


def pools(params: str):
    return built(f"    - {{name: f, type: tenant-pool-filter, parameters: {params}}}\n"
                 "    - {type: random-picker, parameters: {fallbacks: 4}}\n",
                 "[{pluginRef: f}, {pluginRef: random-picker}]")


def kept(b, tenant):
    return set(plugin(b, "f").filter(ctx(b, state(b, tenant=tenant)), FLEET))


def test_is_a_filter():
    p = TenantPoolFilterParameters(tenants={"acme": {"matchLabels": {"pool": "gold"}}})
    assert isinstance(TenantPoolFilter("f", p, None), Filter)


def test_each_tenant_keeps_its_pools_and_others_the_default():
    b = pools(POOLS + ", default: {matchLabels: {pool: shared}}}")
    assert kept(b, "acme") == {G0}
    assert kept(b, "globex") == {G0, A185}  # anyOf: either pool
    assert kept(b, "hooli") == {G1}  # not listed: the default
    assert kept(b, None) == {G1}  # no tenant: the default too
    assert {e for _ in range(30) for e in b.decide(state(b, tenant="acme"))} == {G0}


def test_without_a_default_unlisted_requests_are_not_restricted():
    b = pools(POOLS + "}")
    assert kept(b, "hooli") == set(FLEET) and kept(b, None) == set(FLEET) and BARE in kept(b, None)
    assert kept(b, "acme") == {G0}


def test_the_tenant_is_the_processors_never_the_body():
    b = pools(POOLS + ", default: {matchLabels: {pool: shared}}}")
    st = state(b)
    st.request.tenant = "acme"  # what a body could claim; the tenancy set no tenant
    assert set(plugin(b, "f").filter(ctx(b, st), FLEET)) == {G1}


def test_a_tenant_whose_pool_is_empty_is_refused_not_sent_elsewhere():
    b = pools(POOLS + "}")
    with pytest.raises(NoCapacity) as e:
        b.decide(state(b, tenant="initech"))
    assert e.value.filter == "f" and not e.value.sheddable
    with pytest.raises(NoCapacity) as e:
        b.decide(state(b, tenant="initech", priority=-2))
    assert e.value.sheddable and e.value.priority == -2


@pytest.mark.parametrize("params, message", [
    ("{}", "spec.plugins[0].parameters.tenants: required parameter is missing"),
    ("{tenants: {}}", "spec.plugins[0].parameters.tenants: Dictionary should have at least 1 item"),
    ("{tenants: {acme: {matchLabels: {pool: gold}}}, defaults: {matchLabels: {}}}",
     "spec.plugins[0].parameters.defaults: unknown parameter"),
    ("{tenants: {acme: {matchlabels: {pool: gold}}}}", "spec.plugins[0].parameters.tenants.acme.matchlabels: unknown parameter"),
    ("{tenants: {acme: {matchLabels: {pool: gold}}}, default: {}}",
     "spec.plugins[0].parameters.default: give exactly one of matchLabels or anyOf"),
    ("{tenants: {acme: {matchLabels: {pool: [gold]}}}}", "spec.plugins[0].parameters.tenants.acme.matchLabels.pool"),
])
def test_parameters_are_strict(params, message):
    with pytest.raises(ConfigError) as e:
        load_text(fleet(f"    - {{name: f, type: tenant-pool-filter, parameters: {params}}}\n", "[{pluginRef: f}]"),
                  "c.yaml")
    assert message in str(e.value)
