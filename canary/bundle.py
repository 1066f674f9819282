"""Adapter bundles: a directory as one versioned, SHA256-checked (optionally ed25519-signed) ZIP.

What: `build(directory, output, version=..., sign_key=...)` writes a ZIP holding every regular file of
the directory, a `manifest.json` and, when signed, `manifest.sig`; `load(zip, public_key=...)` checks it
and returns the verified contents (a `Bundle`: manifest plus every file's bytes, read once, so what is
extracted or compiled later is exactly what was hashed); `verify` is `load` without keeping the bytes.
A bundle is what issue 11 canaries besides a model version: a route's templates, schemas and the
parameters of its scheduling plugins as one versioned unit. `adapter_contents(bundle)` reads what a route takes from it:
  bundle.yaml    routes: {ROUTE: {request | requestFile, transform | transformFile,
                                  outputSchema | outputSchemaFile, plugins: {PLUGIN: {PARAM: VALUE}}}}
                 (extproc.config.schema.BundleDocSpec:
                 the route-level fields of a config, strict, errors as `bundle.yaml:LINE`, field, reason;
                 a *File names a file in the bundle)
  golden/*.yaml  (or .json) golden requests the sandboxed preload runs (canary/preload.py) through the
                 route's compiled encode-request and decode-response stages, no backend:
                 {route, request: CLIENT JSON, backendRequest?: the expected backend body (subset match:
                 every key given must be equal), output | backendResponse: the model's output document
                 (wrapped as an OpenAI chat answer: llm routes) or the backend's raw answer (a
                 tensor route's KServe response), response: the expected
                 client body (exact), status?: expected status (default 200)}
Loading into a running gateway (verify here, preload in canary/preload.py, publish by the supervisor)
is `adapterctl bundle load FILE.zip` (canary/cli.py; docs/canary.md).
Format:
  manifest.json  {"format": 1, "name": str, "version": str, "created": "YYYY-MM-DDTHH:MM:SSZ",
                  "files": {"relative/posix/path": "<sha256 hex>", ...}}   (sorted keys, indent 2)
  manifest.sig   64 raw bytes: ed25519 over the exact bytes of manifest.json (which names every file's
                 SHA256, so it covers every file); checkable with openssl:
                 openssl pkeyutl -verify -pubin -inkey key.pub -rawin -in manifest.json -sigfile manifest.sig
  every other entry is a file listed in `files`, stored under its path (deflated, dated 1980-01-01 so the
  ZIP depends only on the contents, the version and `created`).
What verification refuses (each a `Problem(file, field, reason)`, all of them collected into one
`BundleError`): a ZIP that does not open or is over `max_zip_bytes`; an entry whose path is absolute,
has `..`, `.` or empty parts, a backslash, a drive letter or a NUL (zip-slip), is a symlink, is
encrypted, appears twice, or collides with another path ignoring case; more than `max_files` files, a
file over `max_file_bytes`, more than `max_total_bytes` in all (declared or actually read: a lying
header is caught by the size count and zipfile's CRC check: `content`); a manifest that is missing, not JSON, or
has a missing or mistyped field; a file the manifest lists but the ZIP lacks, or the ZIP holds but the
manifest does not list; a file whose SHA256 differs from the manifest's; with a public key, a missing,
malformed or non-verifying signature (`require_signature` refuses an unsigned bundle without a key).
Building takes every regular file, hidden ones included (there are no excludes: build from a clean
directory, not a checkout with `.git`), and refuses symlinks, special files, unreadable files or
directories, reserved names at the top (`manifest.json`, `manifest.sig`) and the same limits, so what
`build` writes `load` accepts.
Keys: ed25519 only. Private keys PEM (PKCS#8, `openssl genpkey -algorithm ed25519`, unencrypted);
public keys PEM (SubjectPublicKeyInfo, `openssl pkey -pubout`) or OpenSSH (`ssh-ed25519 AAAA...`).
Signing and checking need the `cryptography` package, imported only then (it is a test dependency of
this project today, not a core one); an unsigned bundle needs nothing beyond the standard library.
Parameters: `Limits(max_files=1000, max_file_bytes=16 MiB, max_total_bytes=64 MiB, max_zip_bytes=64 MiB,
max_path_len=255, max_manifest_bytes=1 MiB)`.
Cost: one pass over the contents: SHA256 at about 1 GB/s plus inflate; the verified contents are held
in memory (bounded by `max_total_bytes`). No network, no code from the bundle is run.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import stat
import time
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
RESERVED = frozenset({MANIFEST, SIGNATURE})
FORMAT = 1
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CREATED = "%Y-%m-%dT%H:%M:%SZ"
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Limits:
    max_files: int = 1000
    max_file_bytes: int = 16 << 20
    max_total_bytes: int = 64 << 20
    max_zip_bytes: int = 64 << 20
    max_path_len: int = 255
    max_manifest_bytes: int = 1 << 20


@dataclass(frozen=True)
class Problem:
    """One reason a bundle is refused: `file` (a path in the bundle, the ZIP or a key file), `field`
    (the manifest field or property: `sha256`, `path`, `files`, `signature`, `size`, ...), `reason`."""

    file: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.reason}"


class BundleError(Exception):
    """A bundle refused (or not built): every `Problem` found, each naming file, field and reason."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    @classmethod
    def one(cls, file: str, field: str, reason: str) -> BundleError:
        return cls([Problem(file, field, reason)])


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    created: str
    files: dict[str, str]  # path -> sha256 hex

    def to_bytes(self) -> bytes:
        doc = {"format": FORMAT, "name": self.name, "version": self.version, "created": self.created,
               "files": dict(sorted(self.files.items()))}
        return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


@dataclass(frozen=True)
class Bundle:
    """A verified bundle: its manifest, every file's bytes (exactly what was hashed) and whether it
    carried a signature and whether that signature was checked against a key."""

    manifest: Manifest
    files: dict[str, bytes] = field(repr=False)
    signed: bool
    signature_checked: bool
    digest: str  # sha256 of manifest.json: names this exact content (what a rollout arm should point at)

    def extract(self, dest: str | os.PathLike) -> Path:
        """Write the verified files under `dest` (created; must be empty or absent). Only the paths
        checked at load are written, each resolved and checked to stay under `dest`."""
        root = Path(dest)
        root.mkdir(parents=True, exist_ok=True)
        if any(root.iterdir()):
            raise BundleError.one(str(root), "destination", "is not empty")
        base = root.resolve()
        for rel, data in sorted(self.files.items()):
            target = (base / rel).resolve()
            if base not in target.parents:  # belt and braces: the path was checked at load
                raise BundleError.one(rel, "path", f"resolves outside {base}")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return base


# --------------------------------------------------------------------------------------------------
# paths


def path_problem(path: str, limits: Limits = Limits()) -> str | None:
    """Why `path` may not be a bundle entry (zip-slip and friends), or None."""
    if not path:
        return "is empty"
    if "\x00" in path:
        return "has a NUL character"
    if "\\" in path:
        return "has a backslash (paths are POSIX, '/'-separated)"
    if path.startswith("/"):
        return "is absolute"
    if re.match(r"^[A-Za-z]:", path):
        return "starts with a drive letter"
    if len(path.encode()) > limits.max_path_len:
        return f"is longer than {limits.max_path_len} bytes"
    parts = path.split("/")
    if ".." in parts:
        return "has a '..' part (it would escape the bundle)"
    if any(p in ("", ".") for p in parts):
        return "has an empty or '.' part"
    if any(ord(c) < 32 for c in path):
        return "has a control character"
    return None


# --------------------------------------------------------------------------------------------------
# keys (cryptography imported only here)


def _crypto(file: str):
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # pragma: no cover - the test environment has it
        raise BundleError.one(file, "signature", "signing and checking need the `cryptography` package "
                              "(pip install cryptography)") from None
    return serialization, ed25519, InvalidSignature


def _key_bytes(path: str | os.PathLike) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise BundleError.one(str(path), "key", f"cannot be read: {e.strerror or e}") from None


def load_private_key(path: str | os.PathLike):
    """An ed25519 private key from a PEM file (unencrypted PKCS#8)."""
    serialization, ed25519, _ = _crypto(str(path))
    data = _key_bytes(path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise BundleError.one(str(path), "key", "is encrypted; use an unencrypted PKCS#8 PEM key") from None
    except ValueError as e:
        raise BundleError.one(str(path), "key", f"is not a PEM private key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise BundleError.one(str(path), "key", f"is a {type(key).__name__.lstrip('_')}, not an ed25519 key")
    return key


def load_public_key(path: str | os.PathLike):
    """An ed25519 public key from a PEM (SubjectPublicKeyInfo) or OpenSSH (`ssh-ed25519 ...`) file."""
    serialization, ed25519, _ = _crypto(str(path))
    data = _key_bytes(path)
    try:
        if data.lstrip().startswith(b"ssh-"):
            key = serialization.load_ssh_public_key(data.strip())
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise BundleError.one(str(path), "key", f"is not a PEM or OpenSSH public key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise BundleError.one(str(path), "key", f"is a {type(key).__name__.lstrip('_')}, not an ed25519 key")
    return key


def _as_private_key(key):
    return load_private_key(key) if isinstance(key, (str, os.PathLike)) else key


def _as_public_key(key):
    return load_public_key(key) if isinstance(key, (str, os.PathLike)) else key


# --------------------------------------------------------------------------------------------------
# build


def _created(created: str | datetime | None) -> str:
    if isinstance(created, str):
        _parse_created(created, "created")
        return created
    if isinstance(created, datetime):
        return created.astimezone(timezone.utc).strftime(_CREATED)
    epoch = os.environ.get("SOURCE_DATE_EPOCH")  # reproducible builds
    seconds = int(epoch) if epoch and epoch.isdigit() else int(time.time())
    return datetime.fromtimestamp(seconds, timezone.utc).strftime(_CREATED)


def _parse_created(value: str, file: str) -> None:
    try:
        datetime.strptime(value, _CREATED)
    except (TypeError, ValueError):
        raise BundleError.one(file, "created", f"{value!r} is not a UTC time like 2026-01-31T12:00:00Z") from None


def _walk(root: Path, limits: Limits) -> tuple[dict[str, Path], list[Problem]]:
    files: dict[str, Path] = {}
    problems: list[Problem] = []
    folded: dict[str, str] = {}
    def unreadable(e: OSError) -> None:  # os.walk would otherwise skip the directory silently
        where = Path(e.filename).relative_to(root).as_posix() if e.filename else str(root)
        problems.append(Problem(where, "file", f"cannot be listed: {e.strerror or e}"))

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=False):
        d = Path(dirpath)
        for name in sorted(dirnames):
            if (d / name).is_symlink():
                problems.append(Problem((d / name).relative_to(root).as_posix(), "path",
                                        "is a symlink (bundles hold regular files only)"))
        dirnames[:] = sorted(n for n in dirnames if not (d / n).is_symlink())
        for name in sorted(filenames):
            p = d / name
            rel = p.relative_to(root).as_posix()
            mode = p.lstat().st_mode
            if stat.S_ISLNK(mode):
                problems.append(Problem(rel, "path", "is a symlink (bundles hold regular files only)"))
                continue
            if not stat.S_ISREG(mode):
                problems.append(Problem(rel, "path", "is not a regular file"))
                continue
            if rel in RESERVED:
                problems.append(Problem(rel, "path", f"is reserved: the bundle writes its own {rel}"))
                continue
            why = path_problem(rel, limits)
            if why:
                problems.append(Problem(rel, "path", why))
                continue
            if rel.casefold() in folded:
                problems.append(Problem(rel, "path", f"differs from {folded[rel.casefold()]!r} only in case"))
                continue
            folded[rel.casefold()] = rel
            files[rel] = p
    return files, problems


def build(directory: str | os.PathLike, output: str | os.PathLike, *, version: str | None = None,
          name: str | None = None, created: str | datetime | None = None, sign_key=None,
          limits: Limits = Limits()) -> Manifest:
    """Write `output` (a ZIP) from every regular file under `directory`. `name` defaults to the
    directory's name, `version` to the creation time as YYYYMMDD.HHMMSS, `created` to now (or
    SOURCE_DATE_EPOCH). `sign_key`: a path to a PEM private key or an Ed25519PrivateKey."""
    root = Path(directory)
    if not root.is_dir():
        raise BundleError.one(str(root), "directory", "does not exist or is not a directory")
    key = _as_private_key(sign_key) if sign_key is not None else None
    stamp = _created(created)
    name = name if name is not None else root.resolve().name
    version = version if version is not None else datetime.strptime(stamp, _CREATED).strftime("%Y%m%d.%H%M%S")
    problems = [Problem(MANIFEST, f, "must be a non-empty string") for f, v in (("name", name), ("version", version))
                if not isinstance(v, str) or not v.strip()]
    files, walk_problems = _walk(root, limits)
    problems += walk_problems
    if len(files) > limits.max_files:
        problems.append(Problem(str(root), "files", f"{len(files)} files, more than max_files {limits.max_files}"))
    contents: dict[str, bytes] = {}
    total = 0
    for rel, p in files.items():
        size = p.stat().st_size
        if size > limits.max_file_bytes:
            problems.append(Problem(rel, "size", f"{size} bytes, more than max_file_bytes {limits.max_file_bytes}"))
            continue
        total += size
        if total > limits.max_total_bytes:
            problems.append(Problem(str(root), "size", f"more than max_total_bytes {limits.max_total_bytes} in all"))
            break
        try:
            contents[rel] = p.read_bytes()
        except OSError as e:
            problems.append(Problem(rel, "file", f"cannot be read: {e.strerror or e}"))
    if problems:
        raise BundleError(problems)
    manifest = Manifest(name, version, stamp, {rel: hashlib.sha256(b).hexdigest() for rel, b in contents.items()})
    body = manifest.to_bytes()
    out = Path(output)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(_info(MANIFEST), body)
            if key is not None:
                z.writestr(_info(SIGNATURE, zipfile.ZIP_STORED), key.sign(body))
            for rel in sorted(contents):
                z.writestr(_info(rel), contents[rel])
        if tmp.stat().st_size > limits.max_zip_bytes:
            raise BundleError.one(str(out), "size", f"the ZIP is over max_zip_bytes {limits.max_zip_bytes}")
        os.replace(tmp, out)  # never a half-written bundle under the output name
    except OSError as e:
        raise BundleError.one(str(out), "output", f"cannot be written: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return manifest


def _info(name: str, compress: int = zipfile.ZIP_DEFLATED) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, _ZIP_DATE)
    info.compress_type = compress
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    return info


# --------------------------------------------------------------------------------------------------
# verify


def _read(z: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, budget: list[int]) -> bytes:
    """The entry's bytes, refusing past `limit` or the remaining total `budget` whatever the header said."""
    buf = io.BytesIO()
    with z.open(info) as f:
        while chunk := f.read(_CHUNK):
            buf.write(chunk)
            budget[0] -= len(chunk)
            if buf.tell() > limit:
                raise BundleError.one(info.filename, "size", f"more than {limit} bytes when inflated")
            if budget[0] < 0:
                raise BundleError.one(info.filename, "size", "the bundle inflates to more than max_total_bytes")
    return buf.getvalue()


def _manifest(data: bytes) -> tuple[Manifest | None, list[Problem]]:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, [Problem(MANIFEST, "json", f"is not valid UTF-8 JSON ({e})")]
    if not isinstance(doc, dict):
        return None, [Problem(MANIFEST, "json", f"is a JSON {type(doc).__name__}, not an object")]
    problems = []
    if doc.get("format", FORMAT) != FORMAT:
        problems.append(Problem(MANIFEST, "format", f"is {doc.get('format')!r}; this version reads format {FORMAT}"))
    for f in ("name", "version", "created"):
        if f not in doc:
            problems.append(Problem(MANIFEST, f, "is missing"))
        elif not isinstance(doc[f], str) or not doc[f].strip():
            problems.append(Problem(MANIFEST, f, f"must be a non-empty string, not {doc[f]!r}"))
    if isinstance(doc.get("created"), str):
        try:
            _parse_created(doc["created"], MANIFEST)
        except BundleError as e:
            problems += e.problems
    files = doc.get("files")
    if files is None:
        problems.append(Problem(MANIFEST, "files", "is missing"))
        files = {}
    elif not isinstance(files, dict):
        problems.append(Problem(MANIFEST, "files", f"must be an object of path: sha256, not a {type(files).__name__}"))
        files = {}
    for path, digest in files.items():
        if not isinstance(digest, str) or not _SHA256.match(digest):
            problems.append(Problem(path, f"files[{path!r}]",
                                    f"must be a lower-case SHA256 hex digest, not {digest!r}"))
    if problems:
        return None, problems
    return Manifest(doc["name"], doc["version"], doc["created"], dict(files)), []


def load(bundle: str | os.PathLike, *, public_key=None, require_signature: bool = False,
         limits: Limits = Limits()) -> Bundle:
    """Check the ZIP and return its verified contents, or raise BundleError with every problem.
    `public_key` (a path or an Ed25519PublicKey): the signature must be present and verify with it."""
    zpath = str(bundle)
    key = _as_public_key(public_key) if public_key is not None else None
    try:
        size = os.stat(zpath).st_size
    except OSError as e:
        raise BundleError.one(zpath, "bundle", f"cannot be read: {e.strerror or e}") from None
    if size > limits.max_zip_bytes:
        raise BundleError.one(zpath, "size", f"{size} bytes, more than max_zip_bytes {limits.max_zip_bytes}")
    try:
        z = zipfile.ZipFile(zpath)
    except (zipfile.BadZipFile, OSError) as e:
        raise BundleError.one(zpath, "bundle", f"is not a ZIP file ({e})") from None
    with z:
        return _load(z, zpath, key, require_signature, limits)


def _load(z: zipfile.ZipFile, zpath: str, key, require_signature: bool, limits: Limits) -> Bundle:
    problems: list[Problem] = []
    entries: dict[str, zipfile.ZipInfo] = {}
    folded: dict[str, str] = {}
    for info in z.infolist():
        n = info.filename
        if n.endswith("/"):
            why = path_problem(n.rstrip("/"), limits)  # directory entries (other tools write them): path only
            if why:
                problems.append(Problem(n, "path", why))
            continue
        why = path_problem(n, limits)
        if why:
            problems.append(Problem(n, "path", why))
            continue
        mode = info.external_attr >> 16
        if mode and stat.S_ISLNK(mode):
            problems.append(Problem(n, "path", "is a symlink entry (bundles hold regular files only)"))
            continue
        if info.flag_bits & 0x1:
            problems.append(Problem(n, "path", "is encrypted"))
            continue
        if n in entries:
            problems.append(Problem(n, "path", "appears twice in the ZIP (the second would shadow the first)"))
            continue
        if n.casefold() in folded:
            problems.append(Problem(n, "path", f"differs from {folded[n.casefold()]!r} only in case"))
            continue
        folded[n.casefold()] = n
        entries[n] = info
    payload = {n: i for n, i in entries.items() if n not in RESERVED}
    if len(payload) > limits.max_files:
        problems.append(Problem(zpath, "files", f"{len(payload)} files, more than max_files {limits.max_files}"))
    declared = sum(i.file_size for i in payload.values())
    if declared > limits.max_total_bytes:
        problems.append(Problem(zpath, "size", f"declares {declared} bytes, more than max_total_bytes "
                                f"{limits.max_total_bytes}"))
    for n, i in payload.items():
        if i.file_size > limits.max_file_bytes:
            problems.append(Problem(n, "size",
                                    f"{i.file_size} bytes, more than max_file_bytes {limits.max_file_bytes}"))
    if MANIFEST not in entries:
        problems.append(Problem(MANIFEST, "manifest", "is missing: not a bundle"))
    if problems:
        raise BundleError(problems)

    budget = [limits.max_total_bytes]
    try:
        body = _read(z, entries[MANIFEST], limits.max_manifest_bytes, [limits.max_manifest_bytes])
        sig = _read(z, entries[SIGNATURE], 4096, [4096]) if SIGNATURE in entries else None
    except zipfile.BadZipFile as e:
        raise BundleError.one(MANIFEST, "bundle", f"is corrupt ({e})") from None
    manifest, problems = _manifest(body)
    if manifest is None:
        raise BundleError(problems)

    for path in manifest.files:
        why = path_problem(path, limits)
        if why:
            problems.append(Problem(path, "path", f"listed in the manifest: {why}"))
        elif path in RESERVED:
            problems.append(Problem(path, "path", "listed in the manifest, but the name is reserved"))
        elif path not in payload:
            problems.append(Problem(path, "files", "listed in the manifest but missing from the bundle"))
    for path in payload:
        if path not in manifest.files:
            problems.append(Problem(path, "files", "in the bundle but not listed in the manifest"))

    contents: dict[str, bytes] = {}
    for path in sorted(set(payload) & set(manifest.files)):
        try:
            data = _read(z, payload[path], limits.max_file_bytes, budget)
        except BundleError as e:
            problems += e.problems
            continue
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:  # CRC mismatch, truncated entry
            problems.append(Problem(path, "content", f"cannot be read: {e}"))
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != manifest.files[path]:
            problems.append(Problem(path, "sha256", f"content hashes to {digest}, the manifest says "
                                    f"{manifest.files[path]} (the file was changed after the bundle was built)"))
            continue
        contents[path] = data

    checked = False
    if key is not None:
        if sig is None:
            problems.append(Problem(SIGNATURE, "signature", "is missing: the bundle is unsigned and a public key "
                                    "was given"))
        else:
            _, _, invalid = _crypto(SIGNATURE)
            if len(sig) != 64:
                problems.append(Problem(SIGNATURE, "signature", f"is {len(sig)} bytes, an ed25519 signature is 64"))
            else:
                try:
                    key.verify(sig, body)
                    checked = True
                except invalid:
                    problems.append(Problem(SIGNATURE, "signature", "does not verify with the given public key "
                                            "(a different key signed it, or manifest.json was changed)"))
    elif require_signature:
        problems.append(Problem(SIGNATURE, "signature", "a signed bundle is required but no public key was given"
                                if sig is not None else "is missing: a signed bundle is required"))
    if problems:
        raise BundleError(problems)
    return Bundle(manifest, contents, sig is not None, checked, hashlib.sha256(body).hexdigest())


def verify(bundle: str | os.PathLike, *, public_key=None, require_signature: bool = False,
           limits: Limits = Limits()) -> Bundle:
    """`load`, for callers that only want the verdict (the contents are dropped)."""
    b = load(bundle, public_key=public_key, require_signature=require_signature, limits=limits)
    return Bundle(b.manifest, {}, b.signed, b.signature_checked, b.digest)


# --------------------------------------------------------------------------------------------------
# adapter contents: bundle.yaml and golden/


ADAPTER_DOC = "bundle.yaml"
GOLDEN_DIR = "golden/"


@dataclass(frozen=True)
class RoutePart:
    """One route's part as written: template texts (files read), the schema, and where each came from
    (`bundle.yaml:LINE` or the file's name), for compile errors."""

    request: str | None = None
    transform: str | None = None
    output_schema: dict | None = None
    where: dict[str, tuple[str, int]] = field(default_factory=dict)  # field -> (file, first line of the text)
    plugins: dict[str, dict] = field(default_factory=dict)  # plugin name -> parameters (merged over the declared)


@dataclass(frozen=True)
class GoldenCase:
    name: str  # the file under golden/
    route: str
    request: object
    response: object
    backend_request: object = None
    output: object = None
    backend_response: object = None
    status: int = 200


@dataclass(frozen=True)
class AdapterContents:
    routes: dict[str, RoutePart]
    golden: tuple[GoldenCase, ...]


def adapter_contents(bundle: Bundle) -> AdapterContents:
    """`bundle.yaml` and `golden/` of a verified bundle, validated; BundleError with every problem."""
    from pydantic import ValidationError

    from extproc.config.schema import BundleDocSpec
    from extproc.config.yamlsource import YamlError, format_path, load_yaml

    problems: list[Problem] = []
    raw = bundle.files.get(ADAPTER_DOC)
    if raw is None:
        raise BundleError.one(ADAPTER_DOC, "bundle.yaml", "is missing: an adapter bundle names its routes' templates "
                              "there (routes: {ROUTE: {request, transform, outputSchema}})")
    text = _text(raw, ADAPTER_DOC)
    try:
        data, smap = load_yaml(text, ADAPTER_DOC)
        doc = BundleDocSpec.model_validate(data if data is not None else {})
    except YamlError as e:
        raise BundleError.one(ADAPTER_DOC, "yaml", str(e).removeprefix(ADAPTER_DOC + ":")) from None
    except ValidationError as e:
        for err in e.errors(include_url=False):
            loc = tuple(x for x in err["loc"] if isinstance(x, int) or "[" not in str(x))
            cause = (err.get("ctx") or {}).get("error")
            if getattr(cause, "field", None):
                from pydantic.alias_generators import to_camel
                loc = (*loc, to_camel(cause.field))
            msg = "unknown field" if err["type"] == "extra_forbidden" else (
                "required field is missing" if err["type"] == "missing" else err["msg"].removeprefix("Value error, "))
            problems.append(Problem(smap.where(loc), format_path(loc) or "<document>", msg))
        raise BundleError(problems) from None
    routes: dict[str, RoutePart] = {}
    for name, part in doc.routes.items():
        base = ("routes", name)
        values: dict[str, object] = {}
        where: dict[str, tuple[str, int]] = {}
        for f, camel in (("request", "request"), ("transform", "transform"), ("output_schema", "outputSchema")):
            inline, ref = getattr(part, f), getattr(part, f + "_file")
            if inline is not None:
                values[f] = inline
                where[f] = (ADAPTER_DOC, smap.content_lines.get(base + (camel,)) or smap.line_of(base + (camel,)) or 1)
            elif ref is not None:
                at = f"{smap.where(base + (camel + 'File',))}"
                if ref not in bundle.files:
                    problems.append(Problem(at, format_path(base + (camel + "File",)), f"{ref!r} is not a file in the "
                                            "bundle"))
                    continue
                body = bundle.files[ref]
                if f == "output_schema":
                    try:
                        values[f] = json.loads(body.decode("utf-8"))
                    except (UnicodeDecodeError, ValueError) as e:
                        problems.append(Problem(ref, "json", f"is not UTF-8 JSON ({e})"))
                        continue
                    if not isinstance(values[f], dict):
                        problems.append(Problem(ref, "json", "must be a JSON Schema object"))
                        continue
                else:
                    try:
                        values[f] = body.decode("utf-8")
                    except UnicodeDecodeError as e:
                        problems.append(Problem(ref, "text", f"is not UTF-8 (byte {e.start})"))
                        continue
                where[f] = (ref, 1)
        routes[name] = RoutePart(values.get("request"), values.get("transform"), values.get("output_schema"), where,
                                 {n: dict(p) for n, p in part.plugins.items()})
    golden = []
    for path in sorted(p for p in bundle.files if p.startswith(GOLDEN_DIR)):
        if not path.endswith((".yaml", ".yml", ".json")):
            problems.append(Problem(path, "golden", "golden cases are .yaml or .json files"))
            continue
        try:
            case = _golden(path, bundle.files[path], routes)
        except BundleError as e:
            problems += e.problems
            continue
        golden.append(case)
    if problems:
        raise BundleError(problems)
    return AdapterContents(routes, tuple(golden))


_GOLDEN_FIELDS = {"route", "request", "response", "backendRequest", "output", "backendResponse", "status"}


def _golden(path: str, raw: bytes, routes: dict[str, RoutePart]) -> GoldenCase:
    from extproc.config.yamlsource import YamlError, load_yaml

    try:
        data, smap = load_yaml(_text(raw, path), path)
    except YamlError as e:
        raise BundleError.one(path, "yaml", str(e).removeprefix(path + ":")) from None
    if not isinstance(data, dict):
        raise BundleError.one(path, "<document>", "a golden case is a mapping: {route, request, output, response}")
    problems = [Problem(smap.where((k,)), k, f"unknown field (allowed: {', '.join(sorted(_GOLDEN_FIELDS))})")
                for k in data if k not in _GOLDEN_FIELDS]
    for k in ("route", "request", "response"):
        if k not in data:
            problems.append(Problem(path, k, "required field is missing"))
    if "route" in data and data["route"] not in routes:
        problems.append(Problem(smap.where(("route",)), "route", f"{data['route']!r} is not a route of bundle.yaml "
                                f"({', '.join(routes)})"))
    if ("output" in data) == ("backendResponse" in data):
        problems.append(Problem(path, "output", "exactly one of output (the model's output document) or "
                                "backendResponse (the backend's raw answer)"))
    status = data.get("status", 200)
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
        problems.append(Problem(smap.where(("status",)), "status", f"must be an HTTP status, not {status!r}"))
    if problems:
        raise BundleError(problems)
    return GoldenCase(path, data["route"], data["request"], data["response"], data.get("backendRequest"),
                      data.get("output"), data.get("backendResponse"), status)


def _text(raw: bytes, file: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BundleError.one(file, "text", f"is not UTF-8 (byte {e.start})") from None


def public_key_fingerprint(key) -> str:
    """sha256 of the raw 32-byte ed25519 public key, base64 (for logs: which key checked a bundle)."""
    serialization, _, _ = _crypto("public key")
    raw = _as_public_key(key).public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")


__all__ = [
    "ADAPTER_DOC", "FORMAT", "GOLDEN_DIR", "MANIFEST", "RESERVED", "SIGNATURE", "AdapterContents", "Bundle",
    "BundleError", "GoldenCase", "Limits", "Manifest", "Problem", "RoutePart", "adapter_contents", "build", "load", "load_private_key", "load_public_key", "path_problem", "public_key_fingerprint", "verify",
]
