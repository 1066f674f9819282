"""Our ONNX Runtime model server: KServe v2 (HTTP, optional gRPC) with dynamic batching.

What: a standalone server process hosting ONNX models from a repository folder
(``<repo>/<model>/<version>/model[.<precision>].onnx`` + optional ``<repo>/<model>/config.yaml``),
with execution providers by availability (CUDA, then CPU), precision variants with automatic
fallback, run-time tunable dynamic batching and Prometheus metrics.  See README.md here.

One concept per module: :mod:`.config` (config.yaml), :mod:`.tensors` (datatypes, signatures),
:mod:`.codec` (KServe v2 HTTP bodies), :mod:`.repository` (sessions, variants, fallback),
:mod:`.batcher` (dynamic batching), :mod:`.metrics`, :mod:`.service` (operations shared by the
front ends), :mod:`.server` (HTTP), :mod:`.grpc_server` (gRPC), :mod:`.models` (demo models),
``__main__`` (CLI).

Why a package of its own: the gateway talks to it over the network like any model server; nothing
in the processor imports it.  Cost of importing this package: nothing (submodules load lazily).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import BatchingSettings, ModelConfig
    from .server import ServerSettings, serve
    from .service import InferenceService, ServiceError

__all__ = ["BatchingSettings", "InferenceService", "ModelConfig", "ServerSettings", "ServiceError", "serve"]

_LAZY = MappingProxyType({
    "BatchingSettings": ".config", "ModelConfig": ".config",
    "ServerSettings": ".server", "serve": ".server",
    "InferenceService": ".service", "ServiceError": ".service",
})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)
