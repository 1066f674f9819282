"""Backend adapters: one file per model-server API, selected by the backend's `kind` in config.

`adapter_kinds()` is the explicit list (no import-time registration side effects, no global
mutable registry): adding a backend is one file plus one line here, and the shared contract tests
in `tests/backends/` run every kind listed.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping


def adapter_kinds() -> Mapping[str, type]:
    from backends.kserve import OnnxRuntimeAdapter, TritonAdapter
    from backends.openai import OpenAIAdapter, VllmAdapter
    from backends.rest import RestAdapter

    kinds = (OpenAIAdapter, VllmAdapter, TritonAdapter, OnnxRuntimeAdapter, RestAdapter)
    return MappingProxyType({k.kind: k for k in kinds})
