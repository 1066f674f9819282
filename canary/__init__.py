"""Canary releases (issue 11): what exists so far, each module's docstring its README.

- `canary.assign`: sticky, salted, monotone assignment of requests to a rollout's arms (10,000 buckets,
  weights in basis points), key sources with route trust, `x-canary` forcing, weighted random for
  requests without a key.
- `canary.bundle`: adapter bundles: build a SHA256-manifested, optionally ed25519-signed ZIP from a
  directory and verify one (`adapterctl bundle build|verify`).

Not yet: the request-path integration (dispatch's variant slot, `x-adapter-variant`, per-arm metrics),
the judge, step plans, rollout state, sandboxed preload of bundles. docs/canary.md says what remains.
Nothing here is imported by the processor yet, and importing this package imports nothing.
"""
