"""Canary releases (issue 11): what exists so far, each module's docstring its README.

- `canary.assign`: sticky, salted, monotone assignment of requests to a rollout's arms (10,000 buckets,
  weights in basis points), key sources with route trust, `x-canary` forcing, weighted random for
  requests without a key. Called by dispatch's variant slot (`extproc/stages/dispatch.py`) on routes
  with a rollout (`spec.rollouts`); the arm is named in `x-adapter-variant` and counted in
  `adapter_processor_variant_requests_total`.
- `canary.bundle`: adapter bundles: build a SHA256-manifested, optionally ed25519-signed ZIP from a
  directory and verify one (`adapterctl bundle build|verify`); what a route takes from one
  (`bundle.yaml`: templates, schema, plugin parameters) and its golden cases.
- `canary.preload`: the sandbox (rlimits, no network, a wall-clock limit, a temporary directory) and
  the preload that compiles a bundle with the config and runs its golden cases there before the
  supervisor publishes it (`adapterctl bundle load`).
- `canary.judge`: per-arm windows of latency, TTFT and errors; the brief's thresholds with a
  Mann-Whitney U test per latency metric and Fisher's test for errors: pass, fail or inconclusive.
- `canary.plan`: a step plan (1 -> 5 -> 25 -> 50 -> 100 %) with minimum samples and dwell, automatic
  promotion and rollback, operator actions, state saved atomically and refused with file and field
  when corrupt.

- `canary.feed`: every worker's finished requests of a rollout (arm, latency, TTFT, error) as records
  in a per-worker ring file; the supervisor tails them all.
- `canary.control`: the supervisor's controller: per rollout with a `plan:` block, windows fed from
  the feed, the judge and the plan on a schedule, the plan's weights applied by republishing the
  config, state surviving restarts; operator actions. `canary.cli`: `adapterctl canary`,
  `adapterctl bundle load`, `adapterctl restart --rolling`.

Not yet: endpoint arms, control across gateway replicas.
docs/canary.md says what remains. Importing this package imports nothing.
"""
