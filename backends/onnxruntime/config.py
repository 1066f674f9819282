"""Per-model serving settings: the optional ``config.yaml`` beside a model's version folders.

What: :class:`ModelConfig` (precision preference order, session threading, instance count) and
:class:`BatchingSettings` (``max_batch_size``, ``max_queue_delay_us``), parsed from
``<repository>/<model>/config.yaml`` and validated field by field.  Every field is optional::

    max_batch_size: 16              # rows per session.run; 1 = dynamic batching off
    max_queue_delay_us: 2000        # how long the first queued request waits for company
    precision_order: [int8, fp16, fp32]   # preferred variant first; the rest are fallbacks
    instances: 1                    # concurrent session.run calls for this model
    intra_op_threads: 1             # ORT threads inside one run (0 = ORT's default)
    warmup: true                    # run each variant once on zeros at load (a failure falls back)

Why: batching and precision are per-model decisions (a tiny MLP wants different knobs from a wide
one); a file beside the model keeps the repository self-describing, as Triton's ``config.pbtxt``.
A bad file makes only that model UNAVAILABLE, with the reason naming the field.
Batching settings are a separate immutable value so the QoS engine can swap them at run time.
Cost: parsed once per model load; nothing here runs per request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = ["BatchingSettings", "ConfigError", "ModelConfig", "PRECISIONS", "load_model_config",
           "variant_filename"]

# Known precision tags, lowest cost first. ``fp32`` is the plain ``model.onnx``; any other tag T is
# ``model.T.onnx``.
PRECISIONS = ("int8", "fp16", "fp32")
MAX_BATCH_SIZE_LIMIT = 4096
MAX_QUEUE_DELAY_US_LIMIT = 1_000_000  # one second: longer is a misconfiguration, not a policy


class ConfigError(ValueError):
    """A model's config.yaml (or a run-time batching change) is invalid; the message names the field."""


def variant_filename(precision: str) -> str:
    """The file name of a precision variant inside a version folder."""
    return "model.onnx" if precision == "fp32" else f"model.{precision}.onnx"


def _int_field(data: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{key}: {value} is outside [{low}, {high}]")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class BatchingSettings:
    """Dynamic batching knobs of one model; immutable, replaced whole at run time.

    ``max_batch_size`` counts rows (the first dimension) per ``session.run``; 1 turns batching off
    (every request runs alone, whatever its own batch size).  ``max_queue_delay_us`` is how long
    the oldest queued request may wait for others before its batch runs anyway.
    """

    max_batch_size: int = 8
    max_queue_delay_us: int = 500

    def __post_init__(self) -> None:
        _int_field({"max_batch_size": self.max_batch_size}, "max_batch_size", 1, 1, MAX_BATCH_SIZE_LIMIT)
        _int_field({"max_queue_delay_us": self.max_queue_delay_us}, "max_queue_delay_us", 0, 0,
                   MAX_QUEUE_DELAY_US_LIMIT)

    @property
    def enabled(self) -> bool:
        return self.max_batch_size > 1

    def replace(self, changes: Mapping[str, Any]) -> BatchingSettings:
        """A copy with ``changes`` applied; unknown keys or bad values raise :class:`ConfigError`."""
        unknown = set(changes) - {"max_batch_size", "max_queue_delay_us"}
        if unknown:
            raise ConfigError(f"unknown batching field(s): {', '.join(sorted(unknown))}; "
                              "expected max_batch_size, max_queue_delay_us")
        merged = {"max_batch_size": self.max_batch_size, "max_queue_delay_us": self.max_queue_delay_us}
        merged.update(changes)
        return BatchingSettings(
            max_batch_size=_int_field(merged, "max_batch_size", 1, 1, MAX_BATCH_SIZE_LIMIT),
            max_queue_delay_us=_int_field(merged, "max_queue_delay_us", 0, 0, MAX_QUEUE_DELAY_US_LIMIT))

    def as_dict(self) -> dict[str, int | bool]:
        return {"max_batch_size": self.max_batch_size, "max_queue_delay_us": self.max_queue_delay_us,
                "enabled": self.enabled}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything about how one model is served, except the model file itself."""

    batching: BatchingSettings = BatchingSettings()
    precision_order: tuple[str, ...] = PRECISIONS
    instances: int = 1
    intra_op_threads: int = 1
    warmup: bool = True

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ModelConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a mapping at the top level, got {type(data).__name__}")
        known = {"max_batch_size", "max_queue_delay_us", "precision_order", "instances", "intra_op_threads",
                 "warmup"}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
        defaults = cls()
        batching = defaults.batching.replace(
            {k: data[k] for k in ("max_batch_size", "max_queue_delay_us") if k in data})
        order = data.get("precision_order", list(defaults.precision_order))
        if (not isinstance(order, list) or not order
                or not all(isinstance(p, str) and p and "/" not in p and "." not in p for p in order)):
            raise ConfigError(f"precision_order: expected a non-empty list of tags like int8, fp16, fp32, "
                              f"got {order!r}")
        if len(set(order)) != len(order):
            raise ConfigError(f"precision_order: duplicate tags in {order!r}")
        warmup = data.get("warmup", defaults.warmup)
        if not isinstance(warmup, bool):
            raise ConfigError(f"warmup: expected true or false, got {warmup!r}")
        return cls(
            batching=batching,
            warmup=warmup,
            precision_order=tuple(order),
            instances=_int_field(data, "instances", defaults.instances, 1, 64),
            intra_op_threads=_int_field(data, "intra_op_threads", defaults.intra_op_threads, 0, 256),
        )


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read ``model_dir/config.yaml`` (defaults when absent); :class:`ConfigError` when invalid."""
    path = model_dir / "config.yaml"
    if not path.exists():
        return ModelConfig()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config.yaml: cannot read: {exc}") from exc
    try:
        return ModelConfig.from_mapping({} if data is None else data)
    except ConfigError as exc:
        raise ConfigError(f"config.yaml: {exc}") from exc
