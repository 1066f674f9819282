"""Tenant token budgets: the arithmetic (windows, estimates, reconciliation, OpenAI's rate-limit headers).

What: a tenant's `budget` (`spec.tenants[].budget`: requestsPerMinute, tokensPerMinute, requestsPerDay,
tokensPerDay, any subset) is counted in fixed wall-clock windows, the UTC minute and the UTC day:
window index i = floor(unix_time / L) for L = 60 s and 86400 s, reset at (i + 1) * L. A request is
admitted at its admission point when, in every window that has a limit,

    requests + 1 <= requests limit   and   tokens + estimate <= tokens limit,

and is then charged 1 request and `estimate` tokens in the current minute and day windows, atomically
with the check (`extproc/qos/budget_store.py`: one lock across the gateway's workers, or one Lua script
on a Redis shared by replicas). The estimate, before the request runs:

    estimate = prompt tokens (prompt characters / 4, `InferenceRequest.prompt_tokens_estimate`)
             + completion tokens (the request's max_tokens / max_completion_tokens, else the budget's
               `estimatedCompletionTokens`, 256 by default; 0 for embeddings)

on token-counting kinds (`openai`, `llm`, `anthropic-messages`, `openai-responses`); other kinds count requests only (estimate 0). When the
request ends (`on_done`) the charge is reconciled to what it really used, in the windows it was admitted
in (if they are still current: a window that has ended is not rewritten):

    actual = usage.prompt_tokens + usage.completion_tokens      when the backend reported usage
             (the response's `usage`, streamed responses' final usage chunk, extproc/stages/openai_api.py)
           = 0                                                   when the processor answered itself
           = prompt estimate + output estimate                   otherwise (extproc/genai.estimate_output_tokens:
             the SSE events the stream saw, else the answer's characters / 4)
    tokens += actual - estimate

so a window's tokens are exactly the sum of its admitted requests' usage once they have ended.
Headers: every admitted request's response carries OpenAI's `x-ratelimit-limit-requests`,
`-limit-tokens`, `-remaining-requests`, `-remaining-tokens`, `-reset-requests`, `-reset-tokens` for the
units that have a limit, from the binding window (the one with the least remaining; its reset as a Go
duration: "12s", "1m30s", "5h3m0s"). Remaining tokens are `limit - peak`, where peak is the highest
the window's count has been: a refund from reconciliation is admitted against at once but never
makes a later response's remaining go up, so within a window remaining decreases monotonically
(the min of monotone sequences is monotone; it resets with its window). A refused request gets 429,
`Retry-After` = ceil(seconds until the refusing window resets), and an error in the route's dialect
naming the tenant and the budget (`tenant_over_budget`); one whose estimate alone exceeds a tokens
limit can never fit and gets 429 `request_over_budget`, without Retry-After.
Cost: nothing for tenants without a budget (one dict lookup and a None check); with one, building the
estimate (the prompt text is joined once and cached on the request) plus the store's check-and-charge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MINUTE = 60
DAY = 86400
WINDOWS = (("minute", MINUTE), ("day", DAY))  # the order of every per-window tuple below
TOKEN_KINDS = frozenset({"openai", "llm", "anthropic-messages", "openai-responses"})  # counted in tokens
NO_COMPLETION_APIS = frozenset({"openai.embeddings"})
# budget field names, in the config's spelling (what errors and metrics name)
FIELDS = {("minute", "requests"): "requestsPerMinute", ("minute", "tokens"): "tokensPerMinute",
          ("day", "requests"): "requestsPerDay", ("day", "tokens"): "tokensPerDay"}
HEADER_PREFIX = "x-ratelimit-"
METADATA_NAMESPACE = "adapter"  # dynamic metadata adapter.ratelimit_*: Envoy's route adds the headers from it


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits per window, `None` where unlimited: ((requests, tokens) per minute, per day)."""

    minute: tuple[int | None, int | None]
    day: tuple[int | None, int | None]
    estimated_completion_tokens: int = 256

    @classmethod
    def of(cls, budget) -> "Limits":
        """From a `extproc.config.schema.TenantBudget`."""
        return cls((budget.requests_per_minute, budget.tokens_per_minute),
                   (budget.requests_per_day, budget.tokens_per_day), budget.estimated_completion_tokens)

    def window(self, i: int) -> tuple[int | None, int | None]:
        return self.minute if i == 0 else self.day

    @property
    def counts_tokens(self) -> bool:
        return self.minute[1] is not None or self.day[1] is not None


def window_indexes(now: float) -> tuple[int, int]:
    """(minute index, day index) of unix time `now`."""
    return int(now // MINUTE), int(now // DAY)


def reset_after(now: float, i: int) -> float:
    """Seconds from `now` until window `i` (0 minute, 1 day) resets (in (0, L])."""
    length = WINDOWS[i][1]
    return (math.floor(now / length) + 1) * length - now


def go_duration(seconds: float) -> str:
    """OpenAI's reset format (a Go duration): 0.25 -> "250ms", 12 -> "12s", 90 -> "1m30s", 3700.5 -> "1h1m40.5s"."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    ms = round(seconds * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"


def estimate(request, kind: str, limits: Limits) -> tuple[int, int]:
    """(prompt tokens, completion tokens) a request is charged at admission (see the module docstring)."""
    if kind not in TOKEN_KINDS or request is None:
        return 0, 0
    prompt = request.prompt_tokens_estimate()
    if request.api in NO_COMPLETION_APIS:
        return prompt, 0
    completion = request.max_tokens if request.max_tokens is not None else limits.estimated_completion_tokens
    return prompt, max(0, completion)


@dataclass(frozen=True, slots=True)
class WindowState:
    """One window after a check: requests and tokens counted, the tokens peak, seconds to reset."""

    requests: int
    tokens: int
    peak: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    """The store's answer: admitted or not, the windows' state after it, the window indexes charged, and
    when refused which window and unit refused (`refused` = (window index, "requests" | "tokens"))."""

    admitted: bool
    windows: tuple[WindowState, WindowState]
    indexes: tuple[int, int]
    refused: tuple[int, str] | None = None
    too_large: bool = False


def remaining(limits: Limits, windows: tuple[WindowState, WindowState]) -> dict[str, tuple[int, int, float]]:
    """Per unit with a limit ("requests", "tokens"): (limit, remaining, reset seconds) of the binding window,
    the one with the least remaining (ties: the one that resets first)."""
    out: dict[str, tuple[int, int, float]] = {}
    for u, unit in enumerate(("requests", "tokens")):
        best = None
        for i, w in enumerate(windows):
            limit = limits.window(i)[u]
            if limit is None:
                continue
            used = w.requests if u == 0 else max(w.peak, w.tokens)
            cand = (max(0, limit - used), w.reset_s, limit)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is not None:
            out[unit] = (best[2], best[0], best[1])
    return out


def header_values(limits: Limits, windows: tuple[WindowState, WindowState],
                  rem: dict[str, tuple[int, int, float]] | None = None) -> dict[str, str]:
    """OpenAI's rate-limit headers, without the `x-ratelimit-` prefix: {"limit-requests": "60", ...}
    (`rem`: `remaining(limits, windows)` when the caller has it already)."""
    out: dict[str, str] = {}
    for unit, (limit, left, reset) in (rem if rem is not None else remaining(limits, windows)).items():
        out[f"limit-{unit}"] = str(limit)
        out[f"remaining-{unit}"] = str(left)
        out[f"reset-{unit}"] = go_duration(reset)
    return out


HEADER_NAMES = tuple(f"{k}-{u}" for k in ("limit", "remaining", "reset") for u in ("requests", "tokens"))


def metadata_key(name: str) -> str:
    """The dynamic-metadata key (namespace `adapter`) Envoy's route reads header `x-ratelimit-<name>` from."""
    return "ratelimit_" + name.replace("-", "_")


def reconciled_tokens(state, prompt_estimate: int) -> int:
    """What a finished request really used (the module docstring's `actual`)."""
    usage = state.usage
    if usage is not None and (usage.prompt_tokens or usage.completion_tokens):
        return int(usage.prompt_tokens or 0) + int(usage.completion_tokens or 0)
    if state.reply_status is not None:  # the processor answered: no backend saw it
        return 0
    from extproc.genai import estimate_output_tokens

    return prompt_estimate + (estimate_output_tokens(state) or 0)


__all__ = ["Limits", "Decision", "WindowState", "WINDOWS", "FIELDS", "TOKEN_KINDS", "window_indexes", "reset_after",
           "go_duration", "estimate", "remaining", "header_values", "HEADER_NAMES", "metadata_key",
           "reconciled_tokens", "METADATA_NAMESPACE", "HEADER_PREFIX"]
