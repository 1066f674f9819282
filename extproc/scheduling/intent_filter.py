"""Filter `intent-filter`: sends a request to the endpoint pool of its task intent (code, chat, extraction, ...).

What: each intent names an endpoint label selector (its pool). The request's intent is, in order:
1. the client's `x-task-intent` header, when it names one of `intents` (compared lower-cased; the
   stream keeps this header at request headers in `state.attrs`, `extproc/types.HINT_HEADERS`,
   since the headers themselves are not kept to the body where dispatch decides);
2. else, with `classifier: true`, the label of the small ONNX text classifier
   (`extproc/intent/classifier.py`: `intent_of`) over the first characters of the prompt, when its
   confidence reaches `minConfidence` (a header value it does not know is ignored there too);
3. else no intent.
A request with an intent listed in `intents` keeps the endpoints that intent's selector matches;
any other (no intent, or one without a pool) keeps those `default` matches, or every endpoint
without a `default`. When nothing is left the profile refuses (503 `no_capacity`, 429 sheddable).
The classifier is loaded once per worker on first use (onnxruntime is the optional `[ort]` extra);
when it cannot be (onnxruntime missing, model not built, no classifier module) the filter logs
the reason once and works from the header alone: "no intent", never a failed request. The intent
found is kept in `state.attrs["task_intent"]` (with `explain: true` the decision shows what was kept).
Formula: i = header if header in intents else classify(prompt[:N]) if confident else None;
sel = intents.get(i, default); keep e iff sel is None or sel matches labels(e).
Parameters: `intents` ({intent: {matchLabels: {...}} | {anyOf: [...]}}, at least one); `default`
(a selector, optional); `classifier` (default true); `modelPath` (default the built
`extproc/intent/model/`); `minConfidence` (0..1, default 0).
```yaml
- {type: intent-filter, parameters: {intents: {code: {matchLabels: {pool: code}},
                                               extraction: {matchLabels: {pool: json}}}}}
```
Data consumed: the `x-task-intent` header, the prompt (`request.prompt_text()`, first N characters
only), endpoint labels. Cost: with the header, a dict lookup; else one classification (about
20-40 us, see the classifier's docstring), plus a dict lookup per label per candidate.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin
from extproc.scheduling.selectors import Selector
from extproc.types import HINT_HEADERS

log = logging.getLogger(__name__)

INTENT_HEADER = HINT_HEADERS[0]  # x-task-intent


class IntentFilterParameters(Parameters):
    intents: dict[str, Selector] = Field(min_length=1)
    default: Selector | None = None
    classifier: bool = True
    model_path: str | None = Field(default=None, alias="modelPath", min_length=1)
    min_confidence: float = Field(default=0.0, alias="minConfidence", ge=0.0, le=1.0)


_UNLOADED = object()


class IntentFilter(Plugin):
    type: ClassVar[str] = "intent-filter"
    slot: ClassVar[str] = "filter"
    Parameters: ClassVar[type] = IntentFilterParameters

    def __init__(self, name: str, params: Any, runtime: Any):
        super().__init__(name, params, runtime)
        self._classifier: Any = _UNLOADED
        self._intent_of: Any = None
        self.unavailable: str | None = None  # why there is no classifier (logged once)
        self._pools = {k.lower(): v for k, v in params.intents.items()}

    def configure(self, old: Any, new: Any) -> None:
        super().configure(old, new)
        self._pools = {k.lower(): v for k, v in new.intents.items()}
        if (old.model_path, old.classifier) != (new.model_path, new.classifier):
            self._classifier, self.unavailable = _UNLOADED, None  # reloaded on next use

    def classifier(self) -> Any:
        """The loaded classifier, or None (off, or unavailable: the reason is logged once)."""
        if self._classifier is _UNLOADED:
            self._classifier = None
            if self.params.classifier:
                try:
                    from extproc.intent.classifier import IntentClassifier, IntentUnavailable, intent_of
                except ImportError as e:  # the classifier module is not part of this build
                    self.unavailable = f"intent classifier module unavailable ({e})"
                else:
                    try:
                        self._classifier = IntentClassifier.load(self.params.model_path)
                        self._intent_of = intent_of
                    except IntentUnavailable as e:
                        self.unavailable = e.reason
                if self.unavailable is not None:
                    log.warning("intent-filter %r: %s; routing by the %s header only", self.name,
                                self.unavailable, INTENT_HEADER)
        return self._classifier

    def intent(self, ctx: Any) -> str | None:
        hint = ctx.state.attrs.get(INTENT_HEADER)
        if hint is not None:
            hint = hint.strip().lower()
            if hint in self._pools:
                return hint
        clf = self.classifier()
        if clf is None or ctx.request is None:
            return None
        text = ctx.request.prompt_text()
        label = self._intent_of(None, text, clf, min_confidence=self.params.min_confidence) if text else None
        return label.lower() if isinstance(label, str) else label  # intents are keyed lower-cased

    def filter(self, ctx: Any, candidates: tuple[str, ...]) -> list[str] | tuple[str, ...]:
        intent = self.intent(ctx)
        ctx.state.attrs["task_intent"] = intent
        sel = self._pools.get(intent) if intent is not None else None
        if sel is None:
            sel = self.params.default
        return candidates if sel is None else sel.keep(ctx.labels, candidates)
