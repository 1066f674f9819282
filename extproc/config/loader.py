"""Load an AdapterGateway file: YAML -> strict schema -> cross-references -> compiled snapshot.

What: `load_file(path)` / `load_text(text, filename)` return an immutable `Snapshot` or raise
`ConfigError` listing every problem found as `file:line: field.path: reason`. `config_digest` is
the one digest of a config (text, referenced files, endpoint overrides) that the supervisor and
the workers agree on (see extproc/config/bundle.py).
Why: a config is refused whole or accepted whole (the running gateway keeps its last good
snapshot on a bad reload); each step is a separate function so each can be tested alone, as in the
endpoint picker's decode -> default -> instantiate -> cross-validate pipeline.
Cost: milliseconds per load (template compilation included); never on the request path.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pydantic import BaseModel, ValidationError
from pydantic.alias_generators import to_camel

from extproc.config.schema import AdapterGateway, FieldError
from extproc.config.yamlsource import Path, SourceMap, YamlError, format_path, load_yaml

if TYPE_CHECKING:
    from extproc.config.snapshot import Snapshot


@dataclass(frozen=True)
class Issue:
    """One reason a config was refused."""

    where: str  # "file:line"
    path: str  # "spec.routes[0].target"
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.path}: {self.reason}"


class ConfigError(ValueError):
    """The config is invalid; `issues` says where and why. Nothing of it was applied."""

    def __init__(self, issues: list[Issue] | str):
        self.issues = [issues] if isinstance(issues, str) else list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


def load_file(path: str | FsPath, generation: int = 1, endpoints: dict | None = None) -> "Snapshot":
    """Load and compile a config file. `endpoints` ({backend: ((host, port), ...)}) replaces the
    named backends' endpoints after validation (the demo stack points backends at simulators)."""
    return load_text(read_config(path), str(path), generation, endpoints=endpoints)


def read_config(path: str | FsPath) -> str:
    """The text of a config file; `ConfigError` when it cannot be read or is not UTF-8."""
    p = FsPath(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: config is not UTF-8 (byte {e.start})") from None


def load_text(text: str, filename: str = "<config>", generation: int = 1, *,
              resolve: Callable[[str], FsPath] | None = None, endpoints: dict | None = None,
              loaded: tuple[str, ...] = ()) -> "Snapshot":
    """Compile config text. `resolve(name)` says where a file the config names (a tool route's
    `openapi`, a rest route's `mapping`, a bundle's ZIP or key) is read from: by default relative to
    `filename`; a config bundle passes its own copies. `loaded`: adapter bundles loaded at run time
    (`adapterctl bundle load`), oldest first, names for `resolve`. The digest covers the text, those
    files and `endpoints`."""
    from extproc.config.compile import compile_snapshot

    model, smap = parse_text(text, filename)
    resolve = resolve or relative_to(filename)
    files: dict[str, bytes | None] = {}
    for name in [*referenced_files(model), *loaded]:
        try:
            files[name] = resolve(name).read_bytes()
        except (OSError, ValueError):  # ValueError: a name with a NUL byte
            files[name] = None  # compile reports it, with file:line
    digest = loaded_digest(config_digest(text, files, endpoints), loaded)
    snap = compile_snapshot(model, smap, generation=generation, digest=digest, resolve=resolve, loaded=tuple(loaded))
    if endpoints:
        unknown = sorted(set(endpoints) - set(snap.backends))
        if unknown:
            raise ConfigError(f"{filename}: endpoint override for unknown backend(s): {', '.join(unknown)}")
        snap = snap.with_endpoints(endpoints)
    return snap


def parse_text(text: str, filename: str = "<config>") -> tuple[AdapterGateway, SourceMap]:
    """YAML with line numbers, then strict schema validation (no cross-references yet)."""
    try:
        data, smap = load_yaml(text, filename)
    except YamlError as e:
        raise ConfigError(str(e)) from None
    return validate_schema(data, smap), smap


def referenced_files(model: AdapterGateway) -> list[str]:
    """The files a config names, as written, in config order: tool routes' `openapi`, rest
    routes' `mapping`, erp routes' `erp.process`, adapter bundles' `path` and `publicKey` (relative
    paths are relative to the config file)."""
    names: dict[str, None] = {}
    for r in model.spec.routes:
        for name in (r.openapi, r.mapping, r.erp.process if r.erp is not None else None):
            if name:
                names.setdefault(name, None)
    for b in model.spec.bundles:
        for name in (b.path, b.public_key):
            if name:
                names.setdefault(name, None)
    return list(names)


def relative_to(filename: str) -> Callable[[str], FsPath]:
    """The default resolver: absolute names as they are, relative ones beside the config file."""
    base = FsPath(filename).resolve().parent

    def resolve(name: str) -> FsPath:
        p = FsPath(name)
        return p if p.is_absolute() else base / p

    return resolve


def config_digest(text: str, files: Mapping[str, bytes | None] | None = None,
                  endpoints: Mapping[str, Any] | None = None) -> str:
    """sha256 (16 hex) of what a snapshot is compiled from: the config text, the bytes of each
    file it references (None: missing) and the endpoint overrides. The supervisor and every
    worker compute it with this one function, so equal digests mean equal configs. Without files
    or overrides it is the digest of the text alone."""
    h = hashlib.sha256(text.encode())
    if files or endpoints:
        extra = {
            "files": {n: (hashlib.sha256(b).hexdigest() if b is not None else None)
                      for n, b in sorted((files or {}).items())},
            "endpoints": {n: [[host, int(port)] for host, port in eps]
                          for n, eps in sorted((endpoints or {}).items())},
        }
        h.update(b"\0" + json.dumps(extra, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()[:16]


def loaded_digest(digest: str, loaded: tuple[str, ...] | list[str] = ()) -> str:
    """The digest with the order of the bundles loaded at run time (their bytes are in `files`; the
    order decides which version is active, so loading an older version again is a new config)."""
    if not loaded:
        return digest
    return hashlib.sha256(f"{digest}\0loaded\0{json.dumps(list(loaded))}".encode()).hexdigest()[:16]


def validate_schema(data: Any, smap: SourceMap) -> AdapterGateway:
    """Strict schema validation; pydantic errors become file:line: path: reason."""
    if not isinstance(data, dict):
        raise ConfigError([Issue(smap.filename, "<document>", "expected a mapping with apiVersion, kind, metadata, spec")])
    try:
        return AdapterGateway.model_validate(data)
    except ValidationError as e:
        issues = []
        for err in e.errors(include_url=False):
            loc = _clean_loc(err["loc"])
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, FieldError):  # a model validator naming the field it is about
                loc = (*loc, to_camel(cause.field))
            issues.append(Issue(smap.where(loc), format_path(loc), _reason(err, loc)))
        raise ConfigError(issues) from None


def _clean_loc(loc: tuple) -> Path:
    # pydantic adds validator/union branch names (e.g. "function-before[...]") to locations.
    return tuple(p for p in loc if isinstance(p, int) or not ("[" in p or p in ("int", "str", "float", "none")))


def _reason(err: dict, loc: Path) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_fields(loc[:-1])
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"unknown field{hint}"
    if kind == "missing":
        return "required field is missing"
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if kind in ("string_pattern_mismatch",) and loc and loc[-1] == "name":
        msg += " (lowercase letters, digits and '-', like a DNS label)"
    return msg


def _allowed_fields(loc: Path) -> list[str]:
    """Aliases of the model at `loc`, for 'unknown field' hints."""
    model: Any = AdapterGateway
    for part in loc:
        if isinstance(part, int):
            continue
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return []
        model = _model_of(field.annotation)
        if model is None:
            return []
    return [f.alias or n for n, f in model.model_fields.items()]


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None
