"""`adapterctl bundle build|verify`: exit 0 when built or verified, 1 when refused with FILE: FIELD: REASON
on stderr; the command imports canary only when run (extproc/ stays light at import time)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from extproc.cli import main
from tests.canary.test_bundle import FILES, rezip, write_keypair
from tests.conftest import REPO


def make_src(tmp_path):
    root = tmp_path / "adapter"
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_build_and_verify_a_signed_bundle(tmp_path, capsys):
    priv, pub = write_keypair(tmp_path, "k")
    out = tmp_path / "adapter.zip"
    assert main(["bundle", "build", str(make_src(tmp_path)), "-o", str(out), "--version", "2.0.1",
                 "--sign-key", str(priv)]) == 0
    assert f"built {out}: adapter 2.0.1" in capsys.readouterr().out
    assert main(["bundle", "verify", str(out), "--public-key", str(pub)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"ok {out}: adapter 2.0.1") and "4 files, signature verified" in printed
    assert main(["bundle", "verify", str(out)]) == 0
    assert "signature not checked (no --public-key)" in capsys.readouterr().out


def test_refusals_exit_1_and_name_file_field_and_reason(tmp_path, capsys):
    priv, pub = write_keypair(tmp_path, "k")
    _, other = write_keypair(tmp_path, "other")
    out = tmp_path / "adapter.zip"
    assert main(["bundle", "build", str(make_src(tmp_path)), "-o", str(out), "--sign-key", str(priv)]) == 0
    capsys.readouterr()

    tampered = rezip(out, tmp_path / "t.zip", replace={"plugins.yaml": b"- {type: evil}\n"})
    assert main(["bundle", "verify", str(tampered)]) == 1
    err = capsys.readouterr().err
    assert f"adapterctl bundle verify: refused {tampered}:" in err
    assert "  plugins.yaml: sha256: content hashes to " in err

    assert main(["bundle", "verify", str(out), "--public-key", str(other)]) == 1
    assert "  manifest.sig: signature: does not verify with the given public key" in capsys.readouterr().err

    slip = rezip(out, tmp_path / "s.zip", add={"../../etc/evil": b"x"})
    assert main(["bundle", "verify", str(slip)]) == 1
    assert "  ../../etc/evil: path: has a '..' part" in capsys.readouterr().err

    assert main(["bundle", "build", str(tmp_path / "absent"), "-o", str(tmp_path / "x.zip")]) == 1
    assert "absent: directory: does not exist" in capsys.readouterr().err

    unsigned = tmp_path / "u.zip"
    assert main(["bundle", "build", str(make_src(tmp_path)), "-o", str(unsigned)]) == 0
    assert main(["bundle", "verify", str(unsigned), "--require-signature"]) == 1
    assert "manifest.sig: signature: is missing" in capsys.readouterr().err


def test_the_installed_adapterctl_runs_it(tmp_path):
    exe = REPO / ".venv" / "bin" / "adapterctl"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "extproc"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = tmp_path / "b.zip"
    p = subprocess.run([*cmd, "bundle", "build", str(make_src(tmp_path)), "-o", str(out), "--version", "1"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert zipfile.ZipFile(out).namelist()[0] == "manifest.json"
    p = subprocess.run([*cmd, "bundle", "verify", str(out)], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and p.stdout.startswith(f"ok {out}"), p.stderr
    bad = rezip(out, tmp_path / "bad.zip", replace={"schemas/input.json": None})
    p = subprocess.run([*cmd, "bundle", "verify", str(bad)], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1
    assert "schemas/input.json: files: listed in the manifest but missing from the bundle" in p.stderr
    p = subprocess.run([*cmd, "bundle"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2  # usage error: build or verify


def test_importing_the_cli_does_not_import_canary():
    code = "import sys, extproc.cli; print(sorted(m for m in sys.modules if m.startswith(('canary', 'cryptography'))))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
