"""The inference service: loaded models, their batchers, and the KServe v2 operations on them.

What: :class:`InferenceService` loads every model of a repository at :meth:`start` (a model that
fails is kept, UNAVAILABLE, with its reason), then answers the protocol-neutral operations the
HTTP and gRPC front ends share: liveness, readiness, server and model metadata, Triton-style model
config, the repository index, load/unload, inference (validate, queue into the model's
:class:`DynamicBatcher`, return named outputs), and run-time batching changes
(:meth:`set_batching`, for the QoS engine).  Errors are :class:`ServiceError` carrying the HTTP
status KServe v2 prescribes: 400 for a tensor that does not fit (naming the input), 404 for an
unknown model or version, 503 for a model that is not ready or a full queue, 500 when the model
fails to run in every precision variant.

Why: one implementation behind both protocols, so HTTP and gRPC give the same answers; the front
ends only translate wire formats.
Cost: per request a dict lookup for the model, a shape/datatype check per input, and the batcher's
queueing; ``session.run`` runs in a thread pool (ORT releases the GIL), never on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import onnxruntime as ort

from .batcher import DynamicBatcher, QueueFull
from .config import ConfigError
from .metrics import UNKNOWN_MODEL, ModelBatchObserver, OrtMetrics
from .repository import FallbackEvent, ModelRepository, ModelVersion, RunError
from .tensors import TensorError, check_input

__all__ = ["InferenceService", "SERVER_NAME", "SERVER_VERSION", "ServiceError"]

log = logging.getLogger("backends.onnxruntime.service")

SERVER_NAME = "adapter-gateway-onnxruntime"
SERVER_VERSION = "0.1.0"
PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ("binary_tensor_data", "model_repository", "model_configuration", "dynamic_batching_admin")
_STATUS_LABELS = MappingProxyType({400: "bad_request", 404: "not_found", 503: "unavailable"})
_TRITON_TYPES = MappingProxyType({"BYTES": "TYPE_STRING"})


class ServiceError(Exception):
    """An error answered as KServe v2's ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    @property
    def label(self) -> str:
        return _STATUS_LABELS.get(self.status, "error")


@dataclasses.dataclass(slots=True)
class _Served:
    model: ModelVersion
    batcher: DynamicBatcher | None  # None when the version is not ready


class InferenceService:
    """Models of one repository, served; create, :meth:`start` and :meth:`stop` in one event loop."""

    def __init__(self, repository: Path | str, *, threads: int | None = None, strict_readiness: bool = False,
                 max_queue: int = 4096, providers: Sequence[str] | None = None,
                 metrics: OrtMetrics | None = None) -> None:
        self.metrics = metrics or OrtMetrics()
        self.repository = ModelRepository(Path(repository), providers, on_fallback=self._on_fallback)
        self.strict_readiness = strict_readiness
        self._max_queue = max_queue
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads or max(2, os.cpu_count() or 2), thread_name_prefix="ort-run")
        self._models: dict[str, dict[str, _Served]] = {}
        self._started = False
        self._admin_lock = asyncio.Lock()
        self.metrics.providers_available(ort.get_available_providers())

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every model in the repository (failures leave that model UNAVAILABLE)."""
        async with self._admin_lock:
            for name in self.repository.model_names():
                await self._load(name)
        self._started = True

    async def stop(self) -> None:
        """Close every batcher (queued requests fail) and the thread pool, without waiting on runs."""
        self._started = False
        for versions in self._models.values():
            for served in versions.values():
                if served.batcher is not None:
                    await served.batcher.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _load(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        versions = await loop.run_in_executor(self._executor, self.repository.load_model, name)
        old = self._models.get(name, {})
        served: dict[str, _Served] = {}
        for model in versions:
            batcher = None
            if model.ready:
                batcher = DynamicBatcher(model.run, self._executor, model.config.batching,
                                         instances=model.config.instances, batchable=model.batchable,
                                         max_queue=self._max_queue,
                                         observer=ModelBatchObserver(self.metrics, name),
                                         name=f"{name}/{model.version}")
                self.metrics.batching(name, model.version, batcher.settings)
                self.metrics.queue_depth.labels(name, model.version).set_function(
                    lambda b=batcher: b.queue_depth)
            served[model.version] = _Served(model, batcher)
            self._publish_state(model)
        self._models[name] = served
        for version, previous in old.items():
            if previous.batcher is not None:
                await previous.batcher.close()
            if version not in served:
                self.metrics.forget_version(name, version)

    def _publish_state(self, model: ModelVersion) -> None:
        if model.version:
            self.metrics.model_state(model.name, model.version, model.ready, model.precision,
                                     model.config.precision_order, model.providers)

    def _on_fallback(self, event: FallbackEvent) -> None:
        # Called from worker threads too; prometheus_client is thread-safe.
        self.metrics.fallback(event.model, event.from_precision, event.to_precision, event.reason)
        model = self._models.get(event.model, {}).get(event.version)
        if model is not None and event.reason == "run_error":
            self._publish_state(model.model)

    # -- health and metadata ---------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        if not self._started:
            return False
        if not self.strict_readiness:
            return True
        return all(s.model.ready for versions in self._models.values() for s in versions.values())

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": list(EXTENSIONS),
                "execution_providers": list(self.repository.providers)}

    def _versions(self, name: str) -> dict[str, _Served]:
        versions = self._models.get(name)
        if versions is None:
            raise ServiceError(404, f"unknown model '{name}'")
        return versions

    def resolve(self, name: str, version: str | None = None) -> _Served:
        """The served version (the highest ready one when ``version`` is None); 404 or 503 otherwise."""
        versions = self._versions(name)
        if version:
            served = versions.get(version)
            if served is None:
                raise ServiceError(404, f"unknown version '{version}' of model '{name}' "
                                        f"(versions: {', '.join(v for v in versions if v) or 'none'})")
            if not served.model.ready:
                raise ServiceError(503, f"model '{name}' version {version} is not ready: {served.model.reason}")
            return served
        ready = [s for v, s in versions.items() if s.model.ready]
        if not ready:
            reasons = "; ".join(f"{s.model.version or '-'}: {s.model.reason}" for s in versions.values())
            raise ServiceError(503, f"model '{name}' is not ready ({reasons})")
        return max(ready, key=lambda s: int(s.model.version))

    def model_ready(self, name: str, version: str | None = None) -> bool:
        try:
            self.resolve(name, version)
        except ServiceError as exc:
            if exc.status == 404:
                raise
            return False
        return True

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        served = self.resolve(name, version)
        model = served.model
        versions = [version] if version else sorted(
            (v for v, s in self._versions(name).items() if s.model.ready), key=int)
        return {
            "name": name,
            "versions": versions,
            "platform": PLATFORM,
            "inputs": [t.as_dict() for t in model.inputs],
            "outputs": [t.as_dict() for t in model.outputs],
            "version": model.version,
            "state": model.state,
            "execution_providers": list(model.providers),
            "precision": model.precision_report(),
            "batching": {**served.batcher.settings.as_dict(), "batchable": model.batchable,
                         "instances": model.config.instances},
        }

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """A Triton-style model configuration (``GET /v2/models/{m}/config``)."""
        served = self.resolve(name, version)
        model, settings = served.model, served.batcher.settings
        batching = model.batchable

        def tensor(spec):
            dims = list(spec.shape[1:] if batching else spec.shape)
            return {"name": spec.name, "data_type": _TRITON_TYPES.get(spec.datatype, f"TYPE_{spec.datatype}"),
                    "dims": dims}

        config: dict[str, Any] = {
            "name": name, "platform": PLATFORM, "backend": "onnxruntime",
            "max_batch_size": settings.max_batch_size if batching else 0,
            "input": [tensor(t) for t in model.inputs], "output": [tensor(t) for t in model.outputs],
            "instance_group": [{"count": model.config.instances,
                                "kind": "KIND_GPU" if "CUDAExecutionProvider" in model.providers else "KIND_CPU"}],
        }
        if batching and settings.enabled:
            config["dynamic_batching"] = {"max_queue_delay_microseconds": settings.max_queue_delay_us}
        return config

    def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        for name in sorted(set(self.repository.model_names()) | set(self._models)):
            versions = self._models.get(name)
            if versions is None:
                if not ready_only:
                    entries.append({"name": name, "state": "UNAVAILABLE", "reason": "unloaded"})
                continue
            for version in sorted(versions, key=lambda v: int(v) if v else -1):
                model = versions[version].model
                if ready_only and not model.ready:
                    continue
                entry: dict[str, Any] = {"name": name}
                if version:
                    entry["version"] = version
                entry["state"] = model.state
                if model.reason:
                    entry["reason"] = model.reason
                entries.append(entry)
        return entries

    # -- repository control ----------------------------------------------------------------------

    async def load_model(self, name: str) -> None:
        """(Re)load a model from the repository folder; the old versions serve until it is done."""
        try:
            self.repository.model_dir(name)
        except KeyError:
            raise ServiceError(404, f"no model folder '{name}' in the repository") from None
        async with self._admin_lock:
            await self._load(name)
        if not any(s.model.ready for s in self._models[name].values()):
            reasons = "; ".join(s.model.reason for s in self._models[name].values())
            raise ServiceError(400, f"failed to load '{name}': {reasons}")

    async def unload_model(self, name: str) -> None:
        async with self._admin_lock:
            versions = self._models.pop(name, None)
            if versions is None:
                raise ServiceError(404, f"unknown model '{name}'")
            for version, served in versions.items():
                if served.batcher is not None:
                    await served.batcher.close()
                if version:
                    self.metrics.model_state(name, version, False, None, served.model.config.precision_order,
                                             served.model.providers)
                    self.metrics.forget_version(name, version)

    # -- batching control ------------------------------------------------------------------------

    def batching(self, name: str, version: str | None = None) -> dict[str, dict[str, Any]]:
        """The batching settings in force, per ready version (all versions when ``version`` is None)."""
        return {s.model.version: {**s.batcher.settings.as_dict(), "batchable": s.model.batchable}
                for s in self._targets(name, version)}

    def set_batching(self, name: str, version: str | None = None, **changes: int) -> dict[str, dict[str, Any]]:
        """Change ``max_batch_size`` and/or ``max_queue_delay_us`` at run time (all versions when
        ``version`` is None); effective for the next batch formed.  A model reload reverts to
        config.yaml.  Raises :class:`ServiceError` 400 for invalid values."""
        targets = self._targets(name, version)
        try:
            new = {s.model.version: s.batcher.settings.replace(changes) for s in targets}
        except ConfigError as exc:
            raise ServiceError(400, str(exc)) from None
        for served in targets:
            settings = new[served.model.version]
            served.batcher.configure(settings)
            self.metrics.batching(name, served.model.version, settings)
            log.info("model %s version %s: batching now %s", name, served.model.version, settings)
        return self.batching(name, version)

    def _targets(self, name: str, version: str | None) -> list[_Served]:
        if version:
            return [self.resolve(name, version)]
        targets = [s for s in self._versions(name).values() if s.model.ready]
        if not targets:
            self.resolve(name)  # raises the 503 with reasons
        return targets

    # -- inference -------------------------------------------------------------------------------

    def record_request(self, name: str, status: str, seconds: float | None = None) -> None:
        """Count one inference request (front ends call this once per request)."""
        label = name if name in self._models else UNKNOWN_MODEL
        self.metrics.count_request(label, status)
        if seconds is not None and status == "success":
            self.metrics.request_duration.labels(label).observe(seconds)

    async def infer(self, name: str, version: str | None, inputs: Mapping[str, tuple[str, np.ndarray]],
                    outputs: Sequence[str] | None = None) -> tuple[ModelVersion, list[tuple[str, np.ndarray]]]:
        """Run one request: ``inputs`` maps input name to (KServe datatype, array).

        Returns the model version that ran and ``(name, array)`` for the requested outputs (all
        outputs, in model order, when ``outputs`` is None).
        """
        served = self.resolve(name, version)
        model = served.model
        expected = {spec.name: spec for spec in model.inputs}
        for input_name in inputs:
            if input_name not in expected:
                raise ServiceError(400, f"unknown input '{input_name}' for model '{name}' "
                                        f"(inputs: {', '.join(expected)})")
        feeds: dict[str, np.ndarray] = {}
        for spec in model.inputs:
            if spec.name not in inputs:
                raise ServiceError(400, f"input '{spec.name}' is missing (model '{name}' expects "
                                        f"{', '.join(expected)})")
            datatype, array = inputs[spec.name]
            try:
                check_input(spec, datatype, array.shape)
            except TensorError as exc:
                raise ServiceError(400, str(exc)) from None
            feeds[spec.name] = array
        if model.batchable and len({a.shape[0] for a in feeds.values()}) > 1:
            sizes = ", ".join(f"'{n}': {a.shape[0]}" for n, a in feeds.items())
            raise ServiceError(400, f"inputs disagree on the batch (first) dimension ({sizes})")
        out_index = {spec.name: i for i, spec in enumerate(model.outputs)}
        if outputs is not None:
            for out in outputs:
                if out not in out_index:
                    raise ServiceError(400, f"unknown output '{out}' for model '{name}' "
                                            f"(outputs: {', '.join(out_index)})")
        try:
            results = await served.batcher.submit(feeds)
        except QueueFull as exc:
            raise ServiceError(503, str(exc)) from None
        except RunError as exc:
            raise ServiceError(500, str(exc)) from None
        except RuntimeError as exc:  # unloading
            raise ServiceError(503, str(exc)) from None
        names = outputs if outputs is not None else list(out_index)
        return model, [(n, results[out_index[n]]) for n in names]
