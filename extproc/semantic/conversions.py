"""Value conversions between two contracts, each with its inverse.

What: `make_conversion(kind, params)` returns a `Conversion` whose ``forward`` turns a legacy
value into the adapter's form and whose ``inverse`` turns it back. Kinds:

=====================  =======================================  ==================================
kind                   forward (legacy -> adapter)              lossless for
=====================  =======================================  ==================================
``iso8601_to_unix``    ``"2024-05-01T12:00:00Z"`` -> 1714564800  canonical text: UTC ``Z``, no
                       (``unit: s|ms``, ``form: datetime|date``)  fraction for ``s``, exactly 3
                                                                  digits for ``ms``; ``date``:
                                                                  ``YYYY-MM-DD``
``unix_to_iso8601``    1714564800 -> ``"2024-05-01T12:00:00Z"``   every integer in years 1-9999
                       (same params; the inverse kind)           (``date``: multiples of a day)
``string_to_number``   ``"12.5"`` -> 12.5 (``type: number|      canonical numerals: ``str(int)``,
                       integer``)                                 ``repr(float)``
``number_to_string``   12.5 -> ``"12.5"`` (the inverse kind)      every finite number
``enum_map``           by a table of ``pairs`` ``[[legacy,        every listed value, when the table
                       adapter], ...]``                          is one-to-one
=====================  =======================================  ==================================

``null`` passes through both directions unchanged (an optional field stays null). A value a
conversion cannot take raises `ConversionError` naming the value and the kind; at run time the
gateway turns it into a 400 (request) or 502 (response) naming the field.

Field renames and nesting are not conversions: they are the mapping's templates
(`extproc.template`), which have no functions. `extproc.semantic.mapping` applies both.

Why: a legacy service and the adapter schema often hold the same datum in different shapes
(Unix seconds vs ISO 8601, numbers as strings, enum spellings). Keeping each conversion paired
with its inverse lets one mapping serve both directions, and `Conversion.lossless` tells the
aligner when a round trip returns the original (a hypothesis property test checks it).

Cost: each call is a few microseconds at most (datetime parsing dominates the time kinds; see
perf/RESULTS.md). Params are checked once, in `make_conversion`.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

__all__ = ["KINDS", "Conversion", "ConversionError", "make_conversion"]

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
_NAIVE_EPOCH = _dt.datetime(1970, 1, 1)
_DAY = 86_400
_ISO_RE = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})(?:[Tt ](\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d{1,9}))?)?"
    r"([Zz]|[+-]\d{2}:?\d{2})?)?\Z")
_INT_RE = re.compile(r"-?(?:0|[1-9][0-9]*)\Z")
_NUM_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_MIN_UNIX = -62135596800  # 0001-01-01T00:00:00Z
_MAX_UNIX = 253402300799  # 9999-12-31T23:59:59Z
_YEAR_1000 = -30610224000  # 1000-01-01T00:00:00Z


class ConversionError(ValueError):
    """A conversion's params are wrong, or a value cannot be converted (``value``, ``kind``)."""

    def __init__(self, kind: str, message: str, value: Any = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.value = value
        self.message = message


@dataclass(frozen=True)
class Conversion:
    """A pair of functions between a legacy value and its adapter form.

    ``lossless`` is true when ``inverse(forward(x)) == x`` for every ``x`` in the kind's lossless
    domain (see the module table) and ``forward(inverse(y)) == y`` likewise.
    """

    kind: str
    params: Mapping[str, Any]
    forward: Callable[[Any], Any]
    inverse: Callable[[Any], Any]
    lossless: bool

    def to_dict(self) -> dict:
        """``{"kind", "params"}`` as written in a mapping file."""
        return {"kind": self.kind, "params": dict(self.params)}


def _nullsafe(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def run(v: Any) -> Any:
        return None if v is None else fn(v)

    run.__name__ = fn.__name__
    return run


# --------------------------------------------------------------------------
# Time
# --------------------------------------------------------------------------


def _time_params(kind: str, params: Mapping[str, Any]) -> tuple[str, str]:
    unknown = set(params) - {"unit", "form"}
    if unknown:
        raise ConversionError(kind, f"unknown param(s) {', '.join(sorted(unknown))}; expected unit, form")
    unit = params.get("unit", "s")
    form = params.get("form", "datetime")
    if unit not in ("s", "ms"):
        raise ConversionError(kind, f"unit must be 's' or 'ms', not {unit!r}")
    if form not in ("datetime", "date"):
        raise ConversionError(kind, f"form must be 'datetime' or 'date', not {form!r}")
    return unit, form


def _iso_to_unix(kind: str, unit: str, form: str) -> Callable[[Any], Any]:
    scale = 1000 if unit == "ms" else 1

    def iso_to_unix(v: Any) -> int | float:
        if not isinstance(v, str):
            raise ConversionError(kind, f"expected an ISO 8601 string, got {v!r}", v)
        if len(v) == 20 and v[19] in "Zz" and v[10] in "Tt ":  # fast path: YYYY-MM-DDTHH:MM:SSZ
            try:
                delta = _dt.datetime.fromisoformat(v[:19]) - _NAIVE_EPOCH
            except ValueError:
                pass
            else:
                return (delta.days * _DAY + delta.seconds) * scale
        m = _ISO_RE.match(v.strip())
        if not m:
            raise ConversionError(kind, f"{v!r} is not an ISO 8601 date-time", v)
        y, mo, d, hh, mm, ss, frac, tz = m.groups()
        try:
            if hh is None:
                when = _dt.datetime(int(y), int(mo), int(d), tzinfo=_dt.timezone.utc)
            else:
                if tz is None or tz in "Zz":
                    offset = _dt.timezone.utc  # no offset: taken as UTC (documented)
                else:
                    sign = -1 if tz[0] == "-" else 1
                    digits = tz[1:].replace(":", "")
                    offset = _dt.timezone(sign * _dt.timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
                when = _dt.datetime(int(y), int(mo), int(d), int(hh), int(mm), int(ss or 0), tzinfo=offset)
        except ValueError as e:
            raise ConversionError(kind, f"{v!r} is not a valid date-time ({e})", v) from None
        delta = when - _EPOCH
        whole = delta.days * _DAY + delta.seconds
        if frac:
            # exact: integer nanoseconds, no float rounding until the very end
            nanos = int(frac.ljust(9, "0")[:9])
            if unit == "ms":
                total_ns = whole * 1_000_000_000 + nanos
                return total_ns // 1_000_000 if total_ns % 1_000_000 == 0 else total_ns / 1_000_000
            return whole + nanos / 1_000_000_000 if nanos else whole
        return whole * scale

    return iso_to_unix


def _unix_to_iso(kind: str, unit: str, form: str) -> Callable[[Any], Any]:
    per_second = 1000 if unit == "ms" else 1

    def unix_to_iso(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            raise ConversionError(kind, f"expected a Unix time number, got {v!r}", v)
        if isinstance(v, int):
            whole, rem = divmod(v, per_second)
            micro = rem * (1_000_000 // per_second)
        else:
            whole, micro = divmod(round(v * (1_000_000 // per_second)), 1_000_000)
        if not _MIN_UNIX <= whole <= _MAX_UNIX:
            raise ConversionError(kind, f"{v!r} is outside years 1-9999", v)
        if form == "datetime" and whole >= _YEAR_1000:
            try:  # fast path (about 1 µs): C gmtime/strftime; %Y is 4 digits from year 1000 on
                text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
            except (OSError, OverflowError, ValueError):
                text = (_EPOCH + _dt.timedelta(seconds=whole)).isoformat()[:19]
        else:
            when = _EPOCH + _dt.timedelta(seconds=whole)
            if form == "date":
                return when.date().isoformat()
            text = when.isoformat()[:19]  # YYYY-MM-DDTHH:MM:SS (isoformat pads the year to 4 digits)
        if not micro:
            return text + (".000Z" if unit == "ms" else "Z")
        digits = f"{micro:06d}".rstrip("0")
        if unit == "ms":
            text += "." + digits.ljust(3, "0")
        elif digits:
            text += "." + digits
        return text + "Z"

    return unix_to_iso


def _make_iso8601_to_unix(params: Mapping[str, Any]) -> Conversion:
    unit, form = _time_params("iso8601_to_unix", params)
    fwd = _iso_to_unix("iso8601_to_unix", unit, form)
    inv = _unix_to_iso("iso8601_to_unix", unit, form)
    return Conversion("iso8601_to_unix", MappingProxyType({"unit": unit, "form": form}),
                      _nullsafe(fwd), _nullsafe(inv), True)


def _make_unix_to_iso8601(params: Mapping[str, Any]) -> Conversion:
    unit, form = _time_params("unix_to_iso8601", params)
    fwd = _unix_to_iso("unix_to_iso8601", unit, form)
    inv = _iso_to_unix("unix_to_iso8601", unit, form)
    return Conversion("unix_to_iso8601", MappingProxyType({"unit": unit, "form": form}),
                      _nullsafe(fwd), _nullsafe(inv), True)


# --------------------------------------------------------------------------
# Numbers as text
# --------------------------------------------------------------------------


def _num_params(kind: str, params: Mapping[str, Any]) -> str:
    unknown = set(params) - {"type"}
    if unknown:
        raise ConversionError(kind, f"unknown param(s) {', '.join(sorted(unknown))}; expected type")
    t = params.get("type", "number")
    if t not in ("number", "integer"):
        raise ConversionError(kind, f"type must be 'number' or 'integer', not {t!r}")
    return t


def _str_to_num(kind: str, t: str) -> Callable[[Any], Any]:
    def string_to_number(v: Any) -> int | float:
        if not isinstance(v, str):
            raise ConversionError(kind, f"expected a string holding a number, got {v!r}", v)
        s = v.strip()
        if t == "integer":
            if not _INT_RE.match(s):
                raise ConversionError(kind, f"{v!r} is not an integer numeral", v)
            return int(s)
        if not _NUM_RE.match(s):
            raise ConversionError(kind, f"{v!r} is not a decimal numeral", v)
        if _INT_RE.match(s):
            return int(s)
        f = float(s)
        if not math.isfinite(f):
            raise ConversionError(kind, f"{v!r} is out of range", v)
        return f

    return string_to_number


def _num_to_str(kind: str, t: str) -> Callable[[Any], Any]:
    def number_to_string(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConversionError(kind, f"expected a number, got {v!r}", v)
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ConversionError(kind, f"{v!r} has no decimal spelling", v)
            if t == "integer":
                if not v.is_integer():
                    raise ConversionError(kind, f"{v!r} is not an integer", v)
                return str(int(v))
            return repr(v)
        return str(v)

    return number_to_string


def _make_string_to_number(params: Mapping[str, Any]) -> Conversion:
    t = _num_params("string_to_number", params)
    return Conversion("string_to_number", MappingProxyType({"type": t}),
                      _nullsafe(_str_to_num("string_to_number", t)),
                      _nullsafe(_num_to_str("string_to_number", t)), True)


def _make_number_to_string(params: Mapping[str, Any]) -> Conversion:
    t = _num_params("number_to_string", params)
    return Conversion("number_to_string", MappingProxyType({"type": t}),
                      _nullsafe(_num_to_str("number_to_string", t)),
                      _nullsafe(_str_to_num("number_to_string", t)), True)


# --------------------------------------------------------------------------
# Enums
# --------------------------------------------------------------------------


def _key(v: Any) -> tuple:
    """Hashable identity of a JSON scalar that keeps 1, 1.0 and True apart."""
    return (type(v).__name__ if not isinstance(v, bool) else "bool", v)


def _make_enum_map(params: Mapping[str, Any]) -> Conversion:
    kind = "enum_map"
    unknown = set(params) - {"pairs"}
    if unknown:
        raise ConversionError(kind, f"unknown param(s) {', '.join(sorted(unknown))}; expected pairs")
    pairs = params.get("pairs")
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ConversionError(kind, "pairs must be a non-empty list of [legacy, adapter] pairs")
    fwd: dict[tuple, Any] = {}
    inv: dict[tuple, Any] = {}
    clean = []
    injective = True
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ConversionError(kind, f"pairs[{i}] must be [legacy, adapter], not {pair!r}")
        a, b = pair
        for v in (a, b):
            if isinstance(v, (dict, list)) or (isinstance(v, float) and not math.isfinite(v)):
                raise ConversionError(kind, f"pairs[{i}]: enum values must be scalars, not {v!r}")
        if _key(a) in fwd:
            raise ConversionError(kind, f"pairs[{i}]: legacy value {a!r} is listed twice")
        fwd[_key(a)] = b
        if _key(b) in inv:
            injective = False  # two legacy values map to one adapter value: the inverse picks the first
        else:
            inv[_key(b)] = a
        clean.append([a, b])

    def forward(v: Any) -> Any:
        try:
            return fwd[_key(v)]
        except (KeyError, TypeError):
            raise ConversionError(kind, f"{v!r} is not one of the mapped legacy values", v) from None

    def inverse(v: Any) -> Any:
        try:
            return inv[_key(v)]
        except (KeyError, TypeError):
            raise ConversionError(kind, f"{v!r} is not one of the mapped adapter values", v) from None

    return Conversion(kind, MappingProxyType({"pairs": clean}), _nullsafe(forward), _nullsafe(inverse),
                      injective)


KINDS: Mapping[str, Callable[[Mapping[str, Any]], Conversion]] = MappingProxyType({
    "iso8601_to_unix": _make_iso8601_to_unix,
    "unix_to_iso8601": _make_unix_to_iso8601,
    "string_to_number": _make_string_to_number,
    "number_to_string": _make_number_to_string,
    "enum_map": _make_enum_map,
})
"""Conversion kind -> factory."""


def make_conversion(kind: str, params: Mapping[str, Any] | None = None) -> Conversion:
    """The `Conversion` of ``kind`` with ``params``; `ConversionError` for a bad kind or params."""
    try:
        factory = KINDS[kind]
    except (KeyError, TypeError):
        raise ConversionError(str(kind), f"unknown conversion kind; expected one of {', '.join(KINDS)}") from None
    if params is not None and not isinstance(params, Mapping):
        raise ConversionError(kind, f"params must be a mapping, not {type(params).__name__}")
    return factory(params or {})
