"""Config bundles: one validated config generation, published once, loaded the same by every worker.

What: `publish(root, config_path, generation, endpoints)` reads the config file and every file it
names (tool routes' `openapi`, rest routes' `mapping`) once, copies them into an immutable bundle
directory `<root>/<generation>-<digest>/`:

    manifest.json   generation, digest, source (the original file), created, endpoints, files
    config.yaml     the config text exactly as read
    files/0-petstore.yaml ...   copies of the referenced files (`files`: name as written -> copy)

compiles it with `load_bundle` (the same code the workers run), and only then points
`<root>/current` at it by renaming a new symlink over the old one; the last `KEEP` bundles stay.
`load_bundle(dir)` compiles a bundle from its own copies with the manifest's generation, digest
and endpoint overrides; `current_bundle(root)` resolves the link once; `previous_bundles(root, n)`
names the n published before it, newest first (a restarted worker loads them too: Envoy may still
route with their digests while a reload is under way, issue 12).
Why: a worker (re)started at any time serves the last accepted generation, never a file that was
edited since; every worker computes the same digest from the same bytes (`loader.config_digest`).
Limits: an OpenAPI document's relative `$ref`s to *other* files are not copied; they are read from
beside the copy and so fail at publish time (a clear refusal, never a silent divergence).
Cost: one copy of the config's files per accepted reload; milliseconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from extproc.config.loader import (ConfigError, config_digest, load_text, loaded_digest, parse_text, read_config,
                                   referenced_files, relative_to)

if TYPE_CHECKING:
    from extproc.config.snapshot import Snapshot

MANIFEST = "manifest.json"
CONFIG = "config.yaml"
CURRENT = "current"
KEEP = 5
_BUNDLE_NAME = re.compile(r"^(\d+)-([0-9a-f]{16})$")


class BundleError(ConfigError):
    """A bundle directory that cannot be loaded: missing manifest, config or copied file, or
    contents that do not match the digest."""


@dataclass(frozen=True)
class Bundle:
    path: Path
    generation: int
    digest: str
    snapshot: "Snapshot"


def publish(root: str | Path, config_path: str | Path, generation: int,
            endpoints: Mapping[str, tuple[tuple[str, int], ...]] | None = None, keep: int = KEEP,
            unchanged: str | None = None, rollouts: Mapping[str, Mapping[str, Any]] | None = None,
            loaded: tuple[str, ...] = ()) -> Bundle | None:
    """Validate `config_path` and publish it as generation `generation`; `current` then names it.
    Raises `ConfigError` (file:line issues) and changes nothing when the config is refused.
    With `unchanged=DIGEST`, content with that digest (what is published already) is not
    published again: the answer is None. `rollouts`: weight overrides for rollouts (a step plan's
    current weights, `canary/control.py`), kept in the manifest and covered by the digest
    (`extproc.config.compile.with_rollout_overrides`). `loaded`: adapter bundle ZIPs loaded at run
    time (`adapterctl bundle load`, kept in the state directory), oldest first: copied like the
    config's files, listed in the manifest (`loaded`), covered by the digest."""
    from extproc.config.compile import override_digest

    root = Path(root)
    source = str(config_path)
    text = read_config(config_path)
    model, _ = parse_text(text, source)  # YAML and schema errors: refused before anything is written
    original = relative_to(source)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".new-", dir=root))
    os.chmod(staging, 0o755)  # readable like any published file (mkdtemp makes it 0700)
    try:
        (staging / CONFIG).write_bytes(text.encode("utf-8"))
        files: dict[str, str] = {}
        data: dict[str, bytes | None] = {}
        for i, name in enumerate([*referenced_files(model), *loaded]):
            try:
                data[name] = original(name).read_bytes()
            except OSError:
                data[name] = None  # not copied: compiling reports it with file:line
                continue
            rel = f"files/{i}-{Path(name).name}"
            (staging / "files").mkdir(exist_ok=True)
            (staging / rel).write_bytes(data[name])  # type: ignore[arg-type]
            files[name] = rel
        overrides = _endpoints_json(endpoints)
        rollouts = {n: dict(o) for n, o in (rollouts or {}).items()}
        digest = override_digest(loaded_digest(config_digest(text, data, endpoints), loaded), rollouts)
        if digest == unchanged:
            shutil.rmtree(staging, ignore_errors=True)
            return None
        manifest = {"generation": generation, "digest": digest, "source": source,
                    "created": round(time.time(), 3), "endpoints": overrides, "files": files}
        if rollouts:
            manifest["rollouts"] = rollouts
        if loaded:
            manifest["loaded"] = list(loaded)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        if any(b is None for b in data.values()):
            # a referenced file is missing: let the compiler say which route names it, and where
            load_text(text, source, generation, resolve=_resolver(staging, files, original),
                      endpoints=dict(endpoints) if endpoints else None, loaded=tuple(loaded))
        final = root / f"{generation}-{digest}"
        existed = final.exists()
        if existed:  # the same generation and content published before (a reused root)
            shutil.rmtree(staging, ignore_errors=True)
            os.utime(final)
        else:
            os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        snapshot = load_bundle(final)
    except BaseException:
        if not existed:
            shutil.rmtree(final, ignore_errors=True)
        raise
    _point_current(root, final)
    prune(root, keep)
    return Bundle(final, generation, digest, snapshot)


def load_bundle(path: str | Path) -> "Snapshot":
    """Compile a bundle from its own copies; `BundleError` when something in it is missing or
    does not match its digest, `ConfigError` when its config does not compile here."""
    path = Path(path)
    manifest = read_manifest(path)
    try:
        text = (path / CONFIG).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BundleError(f"bundle {path}: cannot read {CONFIG}: {getattr(e, 'strerror', None) or e}") from None
    files: dict[str, str] = manifest["files"]
    missing = [f"{rel} (for {name!r})" for name, rel in files.items() if not (path / rel).is_file()]
    if missing:
        raise BundleError(f"bundle {path}: copied file(s) missing: {', '.join(missing)}")
    source = manifest["source"]
    model, _ = parse_text(text, source)
    absent = [n for n in referenced_files(model) if n not in files]
    if absent:
        raise BundleError(f"bundle {path}: the config names file(s) the bundle does not hold: {', '.join(absent)}")
    endpoints = {n: tuple((h, int(p)) for h, p in eps) for n, eps in manifest["endpoints"].items()}
    loaded = tuple(manifest.get("loaded") or ())
    snap = load_text(text, source, manifest["generation"], resolve=_resolver(path, files, None),
                     endpoints=endpoints or None, loaded=loaded)
    if manifest.get("rollouts"):
        from extproc.config.compile import with_rollout_overrides

        snap = with_rollout_overrides(snap, manifest["rollouts"])
    if snap.digest != manifest["digest"]:
        raise BundleError(f"bundle {path}: contents have digest {snap.digest}, the manifest says {manifest['digest']}")
    return snap


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except OSError as e:
        raise BundleError(f"bundle {path}: cannot read {MANIFEST}: {e.strerror}") from None
    except ValueError as e:
        raise BundleError(f"bundle {path}: {MANIFEST} is not JSON: {e}") from None
    wanted = {"generation": int, "digest": str, "source": str, "endpoints": dict, "files": dict}
    bad = [k for k, t in wanted.items() if not isinstance(manifest.get(k) if isinstance(manifest, dict) else None, t)]
    if bad:
        raise BundleError(f"bundle {path}: {MANIFEST} lacks or mistypes: {', '.join(bad)}")
    return manifest


def current_bundle(root: str | Path) -> Path:
    """The bundle `<root>/current` names now (the link is read once: a concurrent publish cannot
    mix two bundles)."""
    root = Path(root)
    try:
        target = os.readlink(root / CURRENT)
    except OSError as e:
        raise BundleError(f"{root}: no current bundle ({e.strerror})") from None
    return root / target


def bundle_generation(path: str | Path) -> int | None:
    """The generation in a bundle directory's name (for messages when its manifest is unreadable)."""
    m = _BUNDLE_NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def _published(root: Path) -> list[Path]:
    """The bundle directories under `root`, most recently published first (a concurrent prune may
    remove one while this looks: it is left out)."""
    found = []
    for p in root.iterdir():
        m = _BUNDLE_NAME.match(p.name)
        if not m:
            continue
        try:
            if p.is_dir():
                found.append(((p.stat().st_mtime, int(m.group(1))), p))
        except OSError:
            continue
    return [p for _key, p in sorted(found, key=lambda kp: kp[0], reverse=True)]


def previous_bundles(root: str | Path, n: int) -> list[Path]:
    """Up to `n` bundles published before the current one, newest first (not the current one).
    A worker that (re)starts loads them besides the current one, so it knows the digests of the
    routes Envoy may still have: a worker that never restarted still holds those snapshots."""
    root = Path(root)
    if n <= 0:
        return []
    try:
        current = current_bundle(root).name
    except BundleError:
        current = None
    try:
        bundles = _published(root)
    except OSError:
        return []
    return [p for p in bundles if p.name != current][:n]


def prune(root: str | Path, keep: int = KEEP) -> list[Path]:
    """Remove all but the `keep` most recently published bundles (never the current one) and
    staging directories left by a crash; returns what was removed."""
    root = Path(root)
    try:
        current = current_bundle(root).name
    except BundleError:
        current = None
    bundles = _published(root)
    removed = [p for p in bundles[keep:] if p.name != current]
    stale = time.time() - 600
    removed += [p for p in root.glob(".new-*") if p.stat().st_mtime < stale]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def _point_current(root: Path, bundle: Path) -> None:
    tmp = root / f".current-{os.getpid()}-{time.monotonic_ns()}"
    os.symlink(bundle.name, tmp)  # relative: the root can be moved or mounted elsewhere
    os.replace(tmp, root / CURRENT)  # atomic: a reader sees the old bundle or the new one


def _resolver(bundle: Path, files: Mapping[str, str], fallback: Any):
    def resolve(name: str) -> Path:
        if name in files:
            return bundle / files[name]
        if fallback is not None:
            return fallback(name)
        raise BundleError(f"bundle {bundle}: no copy of {name!r}")

    return resolve


def _endpoints_json(endpoints: Mapping[str, tuple[tuple[str, int], ...]] | None) -> dict[str, list[list[Any]]]:
    return {n: [[h, int(p)] for h, p in eps] for n, eps in sorted((endpoints or {}).items())}


__all__ = ["Bundle", "BundleError", "CURRENT", "KEEP", "bundle_generation", "current_bundle", "load_bundle",
           "previous_bundles", "prune", "publish", "read_manifest"]
