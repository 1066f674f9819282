"""Canary assignment: which arm of a rollout serves a request, sticky by key, monotone in the weights.

What: a `Rollout` names a baseline arm (`stable`) and 0..n canary arms with weights in basis points
(1 bp = 0.01 %); `assign(rollout, key)` maps a key (a user, session or tenant id) to one arm, the same
arm for the same key in every worker process and every gateway replica. `extract_key(policy, facts)`
finds the key in a request from the configured sources (a trusted header, a verified JWT claim, the
tenant) and refuses a header the route does not trust; `decide(rollout, policy, facts)` is the one call
the request path (the dispatch variant slot) needs: key, `x-canary` forcing, assignment, with reasons.

Formula:
  bucket(salt, key) = u64_be(blake2b(len(salt) ":" salt key, digest 8 bytes)) mod 10,000
  arms' ranges, in declared order: canary_1 [0, w_1), canary_2 [w_1, w_1 + w_2), ...,
  baseline [Σ w_i, 10,000)
  arm(key) = the arm whose range holds bucket(salt, key);  no key: the same ranges at
  rng.randrange(10,000) (weighted random, seedable).
Why this layout: the first canary takes buckets [0, w), so raising w only adds keys to it (a key in the
canary at 5 % is in it at 10 %, 25 %, ...) and lowering w (a rollback to 0) only moves keys back to the
baseline; a key never flips between canary and baseline twice on a monotone plan, so sticky users do
not drift (Flagger #1532 is the counter-example: affinity cookies set while the split moved). With
several canaries the ranges are cumulative: changing canary k's weight shifts the ranges of the
canaries after it, so keys would move between canaries; `moves(old, new)` lists exactly which buckets
change arm and `monotone(old, new)` says whether a weight change moves keys only between a canary and
the baseline (a step plan should refuse, or at least log, a step that is not). The salt is per rollout
(default: its name) so two rollouts split users independently; a new salt reshuffles everyone, which
`moves` refuses to hide (it raises). Nothing here depends on the process: no `hash()`, no time, no
counters; blake2b of the same bytes is the same everywhere.
Trust: a header is a key or forcing source only if the route lists it in `trusted_headers` (Envoy, or
an auth filter before the processor, sets it and strips the client's copy); a client-chosen header on
a route that does not trust it is refused (no key, a reason), never hashed. JWT claims must be the
verified payload (Envoy jwt_authn's metadata), never a decoded-but-unchecked token. The tenant comes
from admission. `x-canary: true` (or an arm name) forces an arm only when the forcing source is
trusted and the rollout allows it (`allow_force`, which a rollback turns off).
Parameters: `Rollout(name, canaries=(Arm(name, weight_bp), ...), baseline="stable", salt=None,
allow_force=True)`; `KeyPolicy(sources, trusted_headers, force=TrustedHeader("x-canary"),
max_key_len=1024)`.
Cost: one blake2b of a short key plus a scan of the arms (n + 1 comparisons): `assign` about 1.5 us;
`extract_key` a dict lookup per source (headers are expected lower-case, as Envoy sends them; other
cases cost a scan of the headers). No state, no I/O, no locks: safe to call from any worker.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

BUCKETS = 10_000
"""Buckets (and basis points): weights are integers in [0, BUCKETS]."""

_RNG = random.Random()  # keyless requests when the caller passes no rng; seeded from os.urandom


class RolloutError(ValueError):
    """A rollout or key policy that cannot be used; `field` names what is wrong (config-ready)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# --------------------------------------------------------------------------------------------------
# rollouts and arms


@dataclass(frozen=True)
class Arm:
    """A canary arm and its share of traffic in basis points (500 = 5 %)."""

    name: str
    weight: int = 0


@dataclass(frozen=True)
class Rollout:
    """A baseline and its canaries. The baseline gets what the canaries leave: 10,000 - Σ weights."""

    name: str
    canaries: tuple[Arm, ...] = ()
    baseline: str = "stable"
    salt: str | None = None
    allow_force: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "canaries", tuple(self.canaries))
        if not isinstance(self.name, str) or not self.name:
            raise RolloutError("name", "must be a non-empty string")
        if not isinstance(self.baseline, str) or not self.baseline:
            raise RolloutError("baseline", "must be a non-empty string")
        seen = {self.baseline}
        total = 0
        for i, arm in enumerate(self.canaries):
            where = f"canaries[{i}]"
            if not isinstance(arm, Arm):
                raise RolloutError(where, f"must be an Arm, not {type(arm).__name__}")
            if not isinstance(arm.name, str) or not arm.name:
                raise RolloutError(f"{where}.name", "must be a non-empty string")
            if arm.name in seen:
                raise RolloutError(f"{where}.name", f"{arm.name!r} is used twice (arm names are unique, "
                                   f"the baseline's included)")
            seen.add(arm.name)
            if isinstance(arm.weight, bool) or not isinstance(arm.weight, int) or not 0 <= arm.weight <= BUCKETS:
                raise RolloutError(f"{where}.weight", f"must be an integer number of basis points in "
                                   f"[0, {BUCKETS}], not {arm.weight!r}")
            total += arm.weight
        if total > BUCKETS:
            raise RolloutError("canaries", f"weights add up to {total} basis points, more than {BUCKETS}")
        if self.salt is not None and (not isinstance(self.salt, str) or not self.salt):
            raise RolloutError("salt", "must be a non-empty string (or absent: the rollout's name)")

    @property
    def hash_salt(self) -> str:
        return self.name if self.salt is None else self.salt

    @property
    def arm_names(self) -> tuple[str, ...]:
        return (self.baseline, *(a.name for a in self.canaries))

    def weight(self, arm: str) -> int:
        """The arm's share in basis points (the baseline's is the remainder)."""
        if arm == self.baseline:
            return BUCKETS - sum(a.weight for a in self.canaries)
        for a in self.canaries:
            if a.name == arm:
                return a.weight
        raise KeyError(arm)

    def ranges(self) -> tuple[tuple[str, int, int], ...]:
        """(arm, lo, hi) bucket ranges [lo, hi) in order: the canaries from 0 up, then the baseline."""
        out, lo = [], 0
        for a in self.canaries:
            out.append((a.name, lo, lo + a.weight))
            lo += a.weight
        out.append((self.baseline, lo, BUCKETS))
        return tuple(out)

    def with_weight(self, arm: str, weight: int) -> Rollout:
        """The same rollout with one canary at a new weight (a ramp step, a promotion to 10,000, a
        rollback to 0). Salt and arm order are kept, so the step moves only that arm's edge."""
        if arm not in {a.name for a in self.canaries}:
            raise RolloutError("canaries", f"no canary arm {arm!r} (arms: {', '.join(self.arm_names)})")
        return replace(self, canaries=tuple(replace(a, weight=weight) if a.name == arm else a
                                            for a in self.canaries))

    def rolled_back(self) -> Rollout:
        """Every canary at 0 and forcing off: everyone on the baseline."""
        return replace(self, canaries=tuple(replace(a, weight=0) for a in self.canaries), allow_force=False)


UNIT_BITS = 24


def _digest(salt: str, key: str) -> int:
    s = salt.encode()
    return int.from_bytes(hashlib.blake2b(b"%d:%s%s" % (len(s), s, key.encode()), digest_size=8).digest(), "big")


def bucket(salt: str, key: str) -> int:
    """The key's bucket in [0, 10,000) under this salt; the same in every process and replica."""
    return _digest(salt, key) % BUCKETS  # modulo bias: < 10,000 / 2**64


def _unit_of(digest: int) -> int:
    return (digest >> (64 - UNIT_BITS)) or 1


def unit(salt: str, key: str) -> int:
    """The key's id for the judge, in [1, 2**24): the top 24 bits of the bucket's digest (0 taken as 1).
    Requests with one key are one cluster (a user's requests are alike); two keys sharing an id (about
    one pair among 5,800 keys) are judged as one, which only makes the judge more cautious."""
    return _unit_of(_digest(salt, key))


def arm_at(rollout: Rollout, b: int) -> str:
    """The arm whose range holds bucket `b`."""
    lo = 0
    for a in rollout.canaries:
        lo += a.weight
        if b < lo:
            return a.name
    return rollout.baseline


How = Literal["hash", "random", "forced"]


@dataclass(frozen=True)
class Assignment:
    """Which arm serves, and how it was chosen. `variant` is the `x-adapter-variant` header's value."""

    rollout: str
    arm: str
    how: How
    bucket: int | None = None  # the key's bucket (hash) or the drawn one (random); None when forced
    source: str | None = None  # where the key (or the forcing) came from: "header:x-user-id", "claim:sub", "tenant"
    reasons: tuple[str, ...] = ()  # sources refused or ignored on the way (untrusted header, bad claim, ...)
    unit: int | None = None  # the key's id (`unit`), hash only: the judge counts a key's requests as one cluster

    @property
    def variant(self) -> str:
        return f"{self.rollout}/{self.arm}"


def assign(rollout: Rollout, key: str | None, *, rng: random.Random | None = None) -> Assignment:
    """The arm for `key` (sticky), or for a keyless request a weighted random draw from `rng`."""
    if key is None:
        b = (rng or _RNG).randrange(BUCKETS)
        return Assignment(rollout.name, arm_at(rollout, b), "random", b)
    v = _digest(rollout.hash_salt, key)
    b = v % BUCKETS
    return Assignment(rollout.name, arm_at(rollout, b), "hash", b, unit=_unit_of(v))


@dataclass(frozen=True)
class Move:
    """Buckets [lo, hi) (hi - lo basis points of keys) that change from one arm to another."""

    lo: int
    hi: int
    old: str
    new: str


def moves(old: Rollout, new: Rollout) -> tuple[Move, ...]:
    """Which buckets change arm between two versions of a rollout. Raises RolloutError when the salt
    differs (every key would be re-hashed: not a ramp, a new rollout)."""
    if old.hash_salt != new.hash_salt:
        raise RolloutError("salt", f"changes from {old.hash_salt!r} to {new.hash_salt!r}: every key is "
                           f"reassigned (a new rollout, not a step)")
    edges = sorted({0, BUCKETS, *(e for r in (old, new) for _, lo, hi in r.ranges() for e in (lo, hi))})
    out: list[Move] = []
    for lo, hi in zip(edges, edges[1:]):
        if lo == hi:
            continue
        a, b = arm_at(old, lo), arm_at(new, lo)
        if a == b:
            continue
        if out and out[-1].hi == lo and (out[-1].old, out[-1].new) == (a, b):
            out[-1] = Move(out[-1].lo, hi, a, b)
        else:
            out.append(Move(lo, hi, a, b))
    return tuple(out)


def monotone(old: Rollout, new: Rollout) -> bool:
    """True when the step moves keys only between a canary and the baseline (never canary to canary),
    with the same salt: what a ramp or a rollback should be."""
    try:
        ms = moves(old, new)
    except RolloutError:
        return False
    return all(m.old == old.baseline or m.new == new.baseline for m in ms) and old.baseline == new.baseline


# --------------------------------------------------------------------------------------------------
# key sources and trust


@dataclass(frozen=True)
class TrustedHeader:
    """A request header set by the gateway (an auth filter, Envoy's jwt_authn claim_to_headers) after
    stripping the client's copy. It is used only on routes listing it in `KeyPolicy.trusted_headers`."""

    header: str
    kind: Literal["header"] = field(default="header", init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.header, str) or not self.header.strip():
            raise RolloutError("header", "must be a non-empty header name")
        object.__setattr__(self, "header", self.header.strip().lower())

    @property
    def label(self) -> str:
        return f"header:{self.header}"


@dataclass(frozen=True)
class JwtClaim:
    """A claim of the request's verified JWT (dotted path into nested objects: `sub`, `org.id`)."""

    claim: str
    kind: Literal["claim"] = field(default="claim", init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.claim, str) or not self.claim or any(not p for p in self.claim.split(".")):
            raise RolloutError("claim", f"must be a dotted claim path like 'sub' or 'org.id', not {self.claim!r}")

    @property
    def label(self) -> str:
        return f"claim:{self.claim}"


@dataclass(frozen=True)
class TenantKey:
    """The tenant admission resolved for the request (`x-adapter-tenant` set by the route)."""

    kind: Literal["tenant"] = field(default="tenant", init=False)

    @property
    def label(self) -> str:
        return "tenant"


KeySource = TrustedHeader | JwtClaim | TenantKey


@dataclass(frozen=True)
class KeyPolicy:
    """Where a route's requests get their assignment key, first source with a value wins, and which
    headers the route trusts. `force` is where `x-canary` comes from (None: no forcing)."""

    sources: tuple[KeySource, ...] = ()
    trusted_headers: frozenset[str] = frozenset()
    force: TrustedHeader | JwtClaim | None = TrustedHeader("x-canary")
    max_key_len: int = 1024

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        if isinstance(self.trusted_headers, str):
            raise RolloutError("trusted_headers", "must be a collection of header names, not one string")
        object.__setattr__(self, "trusted_headers", frozenset(h.strip().lower() for h in self.trusted_headers))
        for i, s in enumerate(self.sources):
            if not isinstance(s, (TrustedHeader, JwtClaim, TenantKey)):
                raise RolloutError(f"sources[{i}]", f"must be a TrustedHeader, JwtClaim or TenantKey, not "
                                   f"{type(s).__name__}")
        if self.force is not None and not isinstance(self.force, (TrustedHeader, JwtClaim)):
            raise RolloutError("force", f"must be a TrustedHeader or JwtClaim, not {type(self.force).__name__}")
        if isinstance(self.max_key_len, bool) or not isinstance(self.max_key_len, int) or self.max_key_len < 1:
            raise RolloutError("max_key_len", f"must be a positive integer, not {self.max_key_len!r}")

    def untrusted(self) -> list[int]:
        """Indexes in `sources` of the header sources the route does not trust (they never give a key)."""
        return [i for i, s in enumerate(self.sources)
                if isinstance(s, TrustedHeader) and s.header not in self.trusted_headers]

    def problems(self) -> list[str]:
        """Config-time check (for file:line errors at load): header sources the route does not trust
        would never give a key. The forcing header is allowed to be untrusted (it is then ignored)."""
        return [f"sources[{i}]: {untrusted_reason(self.sources[i].header)}" for i in self.untrusted()]


def untrusted_reason(header: str, trusted: str = "trusted_headers") -> str:
    """Why an untrusted header source is refused (`trusted`: how the caller names the trusted list)."""
    return f"header {header!r} is not in {trusted}: a client could choose it, so it is never used as a key on this route"


@dataclass(frozen=True)
class RequestFacts:
    """What a request offers for assignment: its headers (names lower-case, as Envoy sends them), the
    verified JWT claims (None when the route verifies none) and the tenant admission resolved."""

    headers: Mapping[str, str] = field(default_factory=dict)
    claims: Mapping[str, Any] | None = None
    tenant: str | None = None


@dataclass(frozen=True)
class KeyResult:
    key: str | None
    source: str | None = None  # the label of the source that gave the key
    reasons: tuple[str, ...] = ()  # why earlier (or all) sources gave nothing


def _header(headers: Mapping[str, str], name: str) -> str | None:
    v = headers.get(name)
    if v is None:
        for k, val in headers.items():  # a caller that kept the client's casing
            if k.lower() == name:
                return val
    return v


def _claim(claims: Mapping[str, Any] | None, path: str) -> Any:
    v: Any = claims
    for part in path.split("."):
        if not isinstance(v, Mapping) or part not in v:
            return None
        v = v[part]
    return v


def _value(policy: KeyPolicy, source: KeySource, facts: RequestFacts) -> tuple[str | None, str | None]:
    """(value, None) or (None, reason)."""
    if isinstance(source, TrustedHeader):
        if source.header not in policy.trusted_headers:
            present = _header(facts.headers, source.header) is not None
            return None, (f"{source.label}: refused, the route does not trust this header (a client could "
                          f"choose it){'; the value sent was ignored' if present else ''}")
        raw: Any = _header(facts.headers, source.header)
    elif isinstance(source, JwtClaim):
        if facts.claims is None:
            return None, f"{source.label}: no verified JWT on this request"
        raw = _claim(facts.claims, source.claim)
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, (str, int))):
            return None, f"{source.label}: is a {type(raw).__name__}, not a string or integer"
        raw = None if raw is None else str(raw)
    else:
        raw = facts.tenant
    if raw is None:
        return None, f"{source.label}: absent"
    value = raw.strip()
    if not value:
        return None, f"{source.label}: empty"
    if len(value) > policy.max_key_len:
        return None, f"{source.label}: {len(value)} characters, more than max_key_len {policy.max_key_len}"
    return value, None


def extract_key(policy: KeyPolicy, facts: RequestFacts) -> KeyResult:
    """The request's key from the first source that has one; None (with every reason) when none has.
    A header the route does not trust is refused, whatever the request sent."""
    reasons = []
    for source in policy.sources:
        value, reason = _value(policy, source, facts)
        if value is not None:
            return KeyResult(value, source.label, tuple(reasons))
        reasons.append(reason)
    return KeyResult(None, None, tuple(reasons))


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def forced_arm(rollout: Rollout, policy: KeyPolicy, facts: RequestFacts) -> tuple[str | None, str | None]:
    """(arm, None) when the request forces an arm from a trusted source; (None, reason) when it tried
    and was ignored; (None, None) when it did not try. `true` forces the first canary, `false` the
    baseline, an arm's name that arm."""
    source = policy.force
    if source is None:
        return None, None
    if isinstance(source, TrustedHeader):
        raw = _header(facts.headers, source.header)
        if raw is None:
            return None, None
        if source.header not in policy.trusted_headers:
            return None, f"{source.label}: ignored, the route does not trust this header"
    else:
        raw = _claim(facts.claims, source.claim) if facts.claims is not None else None
        if raw is None:
            return None, None
        raw = str(raw).lower() if isinstance(raw, bool) else raw
        if not isinstance(raw, str):
            return None, f"{source.label}: ignored, a {type(raw).__name__}, not a string"
    if not rollout.allow_force:
        return None, f"{source.label}: ignored, forcing is off for rollout {rollout.name!r}"
    value = raw.strip()
    if value.lower() in _TRUE:
        if not rollout.canaries:
            return None, f"{source.label}: ignored, rollout {rollout.name!r} has no canary arm"
        return rollout.canaries[0].name, None
    if value.lower() in _FALSE:
        return rollout.baseline, None
    if value in rollout.arm_names:
        return value, None
    return None, f"{source.label}: ignored, {value[:64]!r} is neither true/false nor an arm of {rollout.name!r}"


def decide(rollout: Rollout, policy: KeyPolicy, facts: RequestFacts, *,
           rng: random.Random | None = None) -> Assignment:
    """The request path's one call: forced arm (trusted only), else the key's sticky arm, else a
    weighted random arm. Every source refused or ignored on the way is in `reasons` (for a debug
    header or a log line; never an error: the request is served either way)."""
    arm, force_reason = forced_arm(rollout, policy, facts)
    if arm is not None:
        return Assignment(rollout.name, arm, "forced", None, policy.force.label)
    key = extract_key(policy, facts)
    reasons = key.reasons + ((force_reason,) if force_reason else ())
    a = assign(rollout, key.key, rng=rng)
    return replace(a, source=key.source, reasons=reasons)


__all__ = [
    "BUCKETS", "Arm", "Assignment", "JwtClaim", "KeyPolicy", "KeyResult", "KeySource", "Move", "RequestFacts",
    "Rollout", "RolloutError", "TenantKey", "TrustedHeader", "UNIT_BITS", "arm_at", "assign", "bucket", "decide",
    "extract_key", "forced_arm", "monotone", "moves", "unit",
]
