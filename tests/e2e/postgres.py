"""A throwaway PostgreSQL cluster for tests (not part of the product): Debian's `postgresql` binaries
(`make postgres-setup` installs them), `initdb` in a fresh temp dir, the server on a free port of
127.0.0.1 with its socket in that dir, stopped by its postmaster's PID and the dir removed.

PostgreSQL refuses to run as root; as root (CI) the cluster belongs to `nobody` (`runuser -u nobody`):
its dir is made under /tmp and chowned to it. Trust authentication, user `postgres`, database
`postgres`: a test's own cluster, reachable only from this machine.
Use: `with Postgres() as pg: pg.url` (`skip_reason()` first: None when the binaries are there).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from extproc.stack import free_port


def pg_bin() -> Path | None:
    """The directory of Debian's initdb/pg_ctl/postgres (the newest version installed), or one on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def skip_reason() -> str | None:
    if pg_bin() is None:
        return "PostgreSQL binaries not installed (make postgres-setup: apt-get install postgresql, as root)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: PostgreSQL refuses to run as root"
    return None


class Postgres:
    def __init__(self) -> None:
        self.bin = pg_bin()
        assert self.bin is not None, skip_reason()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="adapter-pg-"))
        self.data = self.dir / "data"
        self.pid: int | None = None
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as: list[str] = []
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.dir, nobody.pw_uid, nobody.pw_gid)
            self._as = ["runuser", "-u", "nobody", "--"]

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as, *args], check=True, cwd=self.dir, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=120)

    def start(self) -> "Postgres":
        try:
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                      "--no-sync", "-E", "UTF8", "--locale=C")
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w",
                      "-t", "60", "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
                      "start")
        except subprocess.CalledProcessError as e:
            log = (self.dir / "server.log").read_text(errors="replace") if (self.dir / "server.log").exists() else ""
            self.stop()
            raise RuntimeError(f"PostgreSQL did not start: {e.stderr.decode(errors='replace')}\n{log}") from None
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])
        return self

    def stop(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGINT)  # the postmaster's "fast" shutdown
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    os.kill(self.pid, 0)
                    time.sleep(0.05)
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.pid = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def execute(self, sql: str) -> None:
        """Run statements as the superuser (test data), committed."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql)

    def __enter__(self) -> "Postgres":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
