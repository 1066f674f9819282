"""The model repository: folder scanning, ONNX Runtime sessions, precision variants and fallback.

What: ``<root>/<model>/<version>/model.onnx`` (fp32) plus optional ``model.fp16.onnx``,
``model.int8.onnx`` (any ``model.<tag>.onnx``) and an optional ``<root>/<model>/config.yaml``
(:mod:`.config`).  Every integer-named version folder is loaded.  :class:`ModelVersion` is one
loaded (or failed) version: its signature (inputs and outputs as KServe metadata shows them), the
active precision variant and its ONNX Runtime session, and :meth:`ModelVersion.run`.
Execution providers: CUDA, then CPU, whichever ``onnxruntime.get_available_providers()`` offers;
the session's real providers (ORT drops CUDA when its libraries are missing) are reported.

Precision fallback: variants are tried in the model's ``precision_order`` (default int8, fp16,
fp32; missing files are skipped).  A variant that fails to load, whose inputs or outputs differ
from the first one loaded (``signature_mismatch``), or that fails its warm-up run, is skipped for
the next.  A run that raises at serving time tries the next variant on the same input: when that
one succeeds it becomes the active variant (``run_error``); when it fails too, the input is the
likelier culprit, so the active variant stays and the error goes to the caller.  Every step is a
:class:`FallbackEvent` given to ``on_fallback`` (metrics) and kept in the model's metadata.
A version whose variants all fail is UNAVAILABLE with the reasons; the server stays up.

Why: the server process must survive a bad file, and a cheaper variant (int8 on CPU, fp16 on GPU)
should serve when it works while fp32 remains the safety net, with the switch visible to operators.
Cost: a session load per variant tried (milliseconds for the demo models); at serving time a
``session.run`` call plus a lock-free read of the active session; the fallback path takes a lock
and loads a session, once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from .config import ConfigError, ModelConfig, load_model_config, variant_filename
from .tensors import TensorError, TensorSpec, numpy_dtype, spec_from_node_arg

__all__ = ["FallbackEvent", "ModelRepository", "ModelVersion", "RunError", "choose_providers"]

log = logging.getLogger("backends.onnxruntime.repository")

PREFERRED_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
READY, UNAVAILABLE = "READY", "UNAVAILABLE"
_KEPT_FALLBACKS = 32  # events kept per version for metadata (metrics count them all)


def choose_providers(available: Sequence[str] | None = None) -> list[str]:
    """CUDA then CPU, as far as this onnxruntime build offers them."""
    offered = ort.get_available_providers() if available is None else list(available)
    chosen = [p for p in PREFERRED_PROVIDERS if p in offered]
    return chosen or ["CPUExecutionProvider"]


class RunError(RuntimeError):
    """Every variant tried failed to run this input (HTTP 500)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FallbackEvent:
    """One step down the precision order: ``from_precision`` failed, ``to_precision`` is tried next
    (``"none"`` when nothing is left).  ``reason`` is one of load_error, signature_mismatch,
    warmup_error, run_error; ``detail`` is the error text."""

    model: str
    version: str
    from_precision: str
    to_precision: str
    reason: str
    detail: str
    at: float

    def as_dict(self) -> dict[str, Any]:
        return {"from": self.from_precision, "to": self.to_precision, "reason": self.reason,
                "detail": self.detail, "at": self.at}


def _short(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _VariantFailure(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class ModelVersion:
    """One version of one model: state, signature, active precision variant, and ``run``.

    Thread-safe: ``run`` is called from the server's worker threads, concurrently when the model
    has more than one instance (an ORT session runs concurrent calls safely).
    """

    def __init__(self, name: str, version: str, path: Path, config: ModelConfig | None,
                 providers: Sequence[str], on_fallback: Callable[[FallbackEvent], None]) -> None:
        self.name, self.version, self.path = name, version, path
        self.config = config or ModelConfig()
        self.requested_providers = list(providers)
        self.state = UNAVAILABLE
        self.reason = "not loaded"
        self.inputs: tuple[TensorSpec, ...] = ()
        self.outputs: tuple[TensorSpec, ...] = ()
        self.providers: list[str] = []
        self.precision: str | None = None
        self.variants: dict[str, dict[str, str]] = {}  # precision -> {"file", "status", "detail"}
        self.fallbacks: deque[FallbackEvent] = deque(maxlen=_KEPT_FALLBACKS)
        self._on_fallback = on_fallback
        self._session: ort.InferenceSession | None = None
        self._output_names: list[str] = []
        self._switch_lock = threading.Lock()
        self._spares: dict[str, ort.InferenceSession] = {}  # fallback sessions already opened

    # -- loading -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == READY

    @property
    def batchable(self) -> bool:
        """Requests can be stacked along the first dimension of every input and output."""
        return bool(self.inputs) and all(t.batch_dynamic for t in (*self.inputs, *self.outputs))

    def fail(self, reason: str) -> None:
        self.state, self.reason, self._session = UNAVAILABLE, reason, None

    def load(self) -> None:
        """Load the first working variant in precision order (blocking; call from a thread)."""
        order = self.config.precision_order
        present = []
        for precision in order:
            file = self.path / variant_filename(precision)
            if file.is_file():
                present.append(precision)
                self.variants[precision] = {"file": file.name, "status": "standby", "detail": ""}
            else:
                self.variants[precision] = {"file": file.name, "status": "missing", "detail": ""}
        if not present:
            files = ", ".join(variant_filename(p) for p in order)
            self.fail(f"no model file in {self.path} (looked for {files})")
            return
        for index, precision in enumerate(present):
            try:
                session, inputs, outputs = self._open(precision, reference=None)
            except _VariantFailure as failure:
                nxt = present[index + 1] if index + 1 < len(present) else "none"
                self._record(precision, nxt, failure.reason, failure.detail)
                continue
            self.inputs, self.outputs = inputs, outputs
            self._activate(precision, session)
            self.state, self.reason = READY, ""
            return
        tried = "; ".join(f"{p}: {self.variants[p]['detail']}" for p in present)
        self.fail(f"every precision variant failed ({tried})")

    def _open(self, precision: str,
              reference: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None):
        file = self.path / variant_filename(precision)
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.config.intra_op_threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 4  # ORT's own error lines duplicate the exceptions we log
        try:
            session = ort.InferenceSession(str(file), options, providers=self.requested_providers)
            inputs = tuple(spec_from_node_arg(a) for a in session.get_inputs())
            outputs = tuple(spec_from_node_arg(a) for a in session.get_outputs())
        except Exception as exc:  # ORT raises its own exception types, all Exception subclasses
            raise _VariantFailure("load_error", _short(exc)) from exc
        if reference is not None and (inputs, outputs) != reference:
            raise _VariantFailure("signature_mismatch",
                                  f"{file.name} has inputs {[t.as_dict() for t in inputs]} and outputs "
                                  f"{[t.as_dict() for t in outputs]}, unlike the active variant")
        if self.config.warmup:
            try:
                session.run(None, _warmup_feeds(inputs))
            except Exception as exc:
                raise _VariantFailure("warmup_error", _short(exc)) from exc
        return session, inputs, outputs

    def _activate(self, precision: str, session: ort.InferenceSession) -> None:
        if self.precision is not None and self.precision in self.variants:
            self.variants[self.precision]["status"] = "failed"
        self.variants[precision]["status"] = "active"
        self._output_names = [o.name for o in self.outputs]
        self.providers = list(session.get_providers())
        self.precision = precision
        self._session = session  # published last: readers take the session without the lock

    def _record(self, failed: str, nxt: str, reason: str, detail: str) -> None:
        self.variants[failed]["status"] = "failed"
        self.variants[failed]["detail"] = f"{reason}: {detail}"
        event = FallbackEvent(self.name, self.version, failed, nxt, reason, detail, time.time())
        self.fallbacks.append(event)
        log.warning("model %s version %s: precision %s failed (%s: %s); next: %s",
                    self.name, self.version, failed, reason, detail, nxt)
        self._on_fallback(event)

    # -- serving -------------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """All outputs, in the order of :attr:`outputs`; falls back on a failing variant."""
        session, precision = self._session, self.precision
        if session is None:
            raise RunError(f"model {self.name} version {self.version} is not ready: {self.reason}")
        try:
            return session.run(self._output_names, dict(feeds))
        except Exception as exc:
            return self._run_fallback(precision, feeds, exc)

    def _run_fallback(self, failed: str | None, feeds: Mapping[str, np.ndarray],
                      error: Exception) -> list[np.ndarray]:
        with self._switch_lock:
            if self.precision != failed and self._session is not None:  # another thread switched
                return self._session.run(self._output_names, dict(feeds))
            order = [p for p in self.config.precision_order if self.variants.get(p, {}).get("status") == "standby"]
            reference = (self.inputs, self.outputs)
            for precision in order:
                session = self._spares.get(precision)
                if session is None:
                    try:
                        session, _, _ = self._open(precision, reference)
                    except _VariantFailure as failure:
                        rest = order[order.index(precision) + 1:]
                        self._record(precision, rest[0] if rest else "none", failure.reason, failure.detail)
                        continue
                    self._spares[precision] = session  # a bad input must not reload it every time
                try:
                    result = session.run(self._output_names, dict(feeds))
                except Exception:
                    # The next variant fails on this input too: blame the input, keep serving.
                    break
                self._spares.pop(precision, None)
                self._activate(precision, session)
                self._record(failed or "none", precision, "run_error", _short(error))
                return result
        raise RunError(f"model {self.name} version {self.version} ({failed}) failed to run: "
                       f"{_short(error)}") from error

    # -- reporting -----------------------------------------------------------------------------

    def served_precision(self) -> tuple[str | None, str]:
        """The active variant (what a run now computes in) and why it is not the first of
        ``precision_order``: ``"<precision>:<reason>"`` for each variant before it, comma-separated
        (reason: missing, load_error, signature_mismatch, warmup_error, run_error); "" when the
        preferred variant is active.  Read after a request's run, it names the variant that ran it
        (a fallback activates the variant before returning its result); a concurrent switch by another
        request between the two can make it name the newer variant."""
        active = self.precision
        if active is None:
            return None, ""
        steps = []
        for p in self.config.precision_order:
            if p == active:
                break
            v = self.variants.get(p)
            if v is None:
                continue
            steps.append(f"{p}:{'missing' if v['status'] == 'missing' else v['detail'].split(':', 1)[0] or v['status']}")
        return active, ",".join(steps)

    def precision_report(self) -> dict[str, Any]:
        return {
            "active": self.precision,
            "order": list(self.config.precision_order),
            "variants": {p: dict(v) for p, v in self.variants.items()},
            "fallbacks": [e.as_dict() for e in self.fallbacks],
        }


def _warmup_feeds(inputs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    feeds = {}
    for spec in inputs:
        shape = tuple(1 if d < 0 else d for d in spec.shape)
        dtype = numpy_dtype(spec.datatype)
        if spec.datatype == "BYTES":
            array = np.empty(shape, dtype=object)
            array.fill("")
        else:
            array = np.zeros(shape, dtype=dtype)
        feeds[spec.name] = array
    return feeds


class ModelRepository:
    """A model repository folder: lists model names and loads all versions of one model.

    Holds no loaded models itself (the service owns those), so a reload is simply a new load.
    """

    def __init__(self, root: Path, providers: Sequence[str] | None = None,
                 on_fallback: Callable[[FallbackEvent], None] | None = None) -> None:
        self.root = Path(root)
        self.providers = list(providers) if providers is not None else choose_providers()
        self._on_fallback = on_fallback or (lambda event: None)

    def model_names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def model_dir(self, name: str) -> Path:
        """The folder of model ``name``; ``KeyError`` when it is not a model folder of this repository."""
        if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
            raise KeyError(name)
        path = self.root / name
        if not path.is_dir():
            raise KeyError(name)
        return path

    def load_model(self, name: str) -> list[ModelVersion]:
        """Load every version of ``name`` (blocking). Failures are UNAVAILABLE versions, never raised.

        A model folder with no version folder, or with a bad ``config.yaml``, gives one UNAVAILABLE
        entry with version ``""`` (an index entry with the reason).
        """
        model_dir = self.model_dir(name)
        versions = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                          key=lambda p: int(p.name))
        try:
            config = load_model_config(model_dir)
        except ConfigError as exc:
            config, config_error = None, str(exc)
        else:
            config_error = ""
        if not versions or config_error:
            entry = ModelVersion(name, "", model_dir, config, self.providers, self._on_fallback)
            entry.fail(config_error or f"no version folder (an integer-named folder) in {model_dir}")
            return [entry]
        loaded = []
        for path in versions:
            version = ModelVersion(name, path.name, path, config, self.providers, self._on_fallback)
            started = time.perf_counter()
            try:
                version.load()
            except (TensorError, OSError) as exc:
                version.fail(_short(exc))
            log.info("model %s version %s: %s%s in %.1f ms", name, path.name, version.state,
                     f" ({version.precision}, {','.join(version.providers)})" if version.ready
                     else f": {version.reason}", (time.perf_counter() - started) * 1000)
            loaded.append(version)
        return loaded
