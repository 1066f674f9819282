"""Quality of service: SLO windows, priority classes, admission and shedding, the glitch breaker and
tenant token budgets, one module per policy (each module's docstring says what it computes, its
formula, its parameters and its cost)."""
