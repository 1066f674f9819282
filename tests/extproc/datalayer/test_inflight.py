"""The shared in-flight table: per-worker files summed by readers, stable keys, restarts, a full table."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from extproc.datalayer import inflight
from extproc.datalayer.inflight import InflightTable, endpoint_key
from tests.conftest import REPO

EP = "10.0.0.7:8000"
OTHER = "10.0.0.8:8000"


class Clock:
    """A fake `time` for the module: `monotonic()` returns `now`, moved by the test."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(inflight, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


def bump(table: InflightTable, ep: str, started: int = 0, finished: int = 0) -> None:
    for _ in range(started):
        table.started(ep)
    for _ in range(finished):
        table.finished(ep)


# --- one process -----------------------------------------------------------------------------------


def test_private_table_counts_started_minus_finished():
    t = InflightTable()
    assert t.directory is None and t.get(EP) == 0
    bump(t, EP, started=3, finished=1)
    assert t.get(EP) == 2 and t.own(EP) == 2 and t.get(OTHER) == 0


def test_without_directory_tables_are_private_to_each_instance(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = InflightTable(None, 0), InflightTable("", 1)
    assert a.directory is None and b.directory is None
    bump(a, EP, started=2)
    assert a.get(EP) == 2 and b.get(EP) == 0
    assert list(tmp_path.iterdir()) == []  # no file anywhere


def test_count_is_never_negative():
    t = InflightTable()
    bump(t, EP, finished=2)
    assert t.get(EP) == 0
    bump(t, EP, started=1)
    assert t.get(EP) == 0  # still one more finish than start


# --- workers on one directory ----------------------------------------------------------------------


def test_workers_sum_each_others_counts(tmp_path, clock):
    w0, w1 = InflightTable(tmp_path, 0), InflightTable(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inflight2-0.bin", "inflight2-1.bin"]
    assert (tmp_path / "inflight2-0.bin").stat().st_size == inflight.SLOTS * 56
    bump(w0, EP, started=2)
    bump(w1, EP, started=3, finished=1)
    bump(w1, OTHER, started=1)
    assert w0.get(EP) == 4 and w1.get(EP) == 4
    assert w0.get(OTHER) == 1 and w1.get(OTHER) == 1
    assert w0.own(EP) == 2 and w1.own(EP) == 2
    # a request's own increment is visible to the next read in the other worker, no waiting
    w1.started(EP)
    assert w0.get(EP) == 5
    w0.finished(EP)
    assert w1.get(EP) == 4


def test_sum_over_workers_is_never_negative(tmp_path, clock):
    w0, w1 = InflightTable(tmp_path, 0), InflightTable(tmp_path, 1)
    bump(w0, EP, started=1)
    bump(w1, EP, finished=3)  # e.g. releases for picks counted by a previous run of worker 1
    assert w0.get(EP) == 0 and w1.get(EP) == 0


def test_counts_reads_every_worker_once_and_agrees_with_get(tmp_path, clock):
    w0, w1 = InflightTable(tmp_path, 0), InflightTable(tmp_path, 1)
    third = "10.0.0.9:8000"
    bump(w0, EP, started=2)
    bump(w1, EP, started=3, finished=1)
    bump(w1, OTHER, finished=2)  # more releases than starts: 0, not -2
    assert w0.counts((EP, OTHER, third)) == {EP: 4, OTHER: 0, third: 0}
    # `third` was absent from w1's table at that read: its slot is found once w1 inserts it
    bump(w1, third, started=5)
    bump(w0, third, started=1)
    got = w0.counts([EP, third])
    assert got == {EP: 4, third: 6} == {e: w0.get(e) for e in (EP, third)}
    # a restarted peer maps a new file whose slots may sit elsewhere: offsets are per mapped file
    w1b = InflightTable(tmp_path, 1)
    bump(w1b, third, started=1)
    clock.now += 1.1
    assert w0.counts([EP, third]) == {EP: 2, third: 2}


def test_a_worker_added_later_is_seen_after_the_relisting(tmp_path, clock):
    w0 = InflightTable(tmp_path, 0)
    assert w0.get(EP) == 0  # lists the directory now: no peers
    w2 = InflightTable(tmp_path, 2)
    bump(w2, EP, started=2)
    clock.now += 0.5
    assert w0.get(EP) == 0  # the list is refreshed once a second
    clock.now += 0.5
    assert w0.get(EP) == 2


def test_other_files_in_the_directory_are_ignored(tmp_path, clock):
    (tmp_path / "inflight2-x.bin").write_bytes(b"\xff" * 64)
    (tmp_path / "inflight2-7.tmp123").write_bytes(b"\xff" * 64)
    (tmp_path / "notes.txt").write_text("hi")
    w0 = InflightTable(tmp_path, 0)
    bump(w0, EP, started=1)
    assert w0.get(EP) == 1 and w0._peer_indexes() == ()


def test_a_replaced_worker_file_resets_that_workers_share(tmp_path, clock):
    w0, w1 = InflightTable(tmp_path, 0), InflightTable(tmp_path, 1)
    bump(w0, EP, started=1)
    bump(w1, EP, started=4)
    assert w0.get(EP) == 5
    ino = (tmp_path / "inflight2-1.bin").stat().st_ino
    w1b = InflightTable(tmp_path, 1)  # worker 1 restarted: a new file, zeroed
    assert (tmp_path / "inflight2-1.bin").stat().st_ino != ino
    assert w1b.get(EP) == 1  # the restarted worker reads w0's count and its own zero
    clock.now += 0.9
    assert w0.get(EP) == 5  # w0 still maps the old file until its once-a-second re-check
    clock.now += 0.2
    assert w0.get(EP) == 1  # re-mapped: the old worker's requests ended with it
    bump(w1b, EP, started=2)
    assert w0.get(EP) == 3


def test_a_removed_worker_file_stops_counting(tmp_path, clock):
    w0, w1 = InflightTable(tmp_path, 0), InflightTable(tmp_path, 1)
    bump(w1, EP, started=2)
    assert w0.get(EP) == 2
    os.unlink(tmp_path / "inflight2-1.bin")
    clock.now += 1.5
    assert w0.get(EP) == 0


def test_a_restarted_worker_starts_from_zero_itself(tmp_path, clock):
    w1 = InflightTable(tmp_path, 1)
    bump(w1, EP, started=3)
    again = InflightTable(tmp_path, 1)
    assert again.own(EP) == 0 and again.get(EP) == 0


# --- across processes ------------------------------------------------------------------------------

_CHILD_ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _python(code: str, hashseed: str) -> str:
    env = {**_CHILD_ENV, "PYTHONHASHSEED": hashseed}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip()


def test_keys_agree_across_processes_with_different_hash_seeds():
    code = ("from extproc.datalayer.inflight import endpoint_key; "
            f"print(endpoint_key({EP!r}), endpoint_key('[::1]:80'), hash({EP!r}))")
    a = _python(code, "1").split()
    b = _python(code, "2").split()
    assert a[2] != b[2]  # Python's own hash really differs between the two processes
    assert a[:2] == b[:2] == [str(endpoint_key(EP)), str(endpoint_key("[::1]:80"))]


def test_endpoint_key_is_blake2b_and_never_zero():
    import hashlib

    assert endpoint_key(EP) == int.from_bytes(hashlib.blake2b(EP.encode(), digest_size=8).digest(), "little")
    assert endpoint_key(EP) != 0 and endpoint_key(EP) != endpoint_key(OTHER)
    assert 0 < endpoint_key("") < 2 ** 64


def test_another_process_counts_are_summed(tmp_path, clock):
    w0 = InflightTable(tmp_path, 0)
    bump(w0, EP, started=1)
    code = ("from extproc.datalayer.inflight import InflightTable\n"
            f"t = InflightTable({str(tmp_path)!r}, 3)\n"
            f"for _ in range(4): t.started({EP!r})\n"
            f"t.finished({EP!r})\n"
            f"print(t.get({EP!r}))\n")
    assert _python(code, "12345") == "4"  # the child sees worker 0's count plus its own 3
    clock.now += 1.0
    assert w0.get(EP) == 4


# --- a full table ----------------------------------------------------------------------------------


def test_full_table_makes_started_a_no_op(monkeypatch):
    # `find` probes SLOTS slots; fewer slots make the table fill with a handful of endpoints
    monkeypatch.setattr(inflight, "SLOTS", 8)
    t = InflightTable()
    eps = [f"10.0.1.{i}:8000" for i in range(8)]
    for ep in eps:
        t.started(ep)
    assert all(t.get(ep) == 1 for ep in eps)
    t.started("10.0.2.1:8000")  # no free slot: not counted, no error
    t.finished("10.0.2.1:8000")
    assert t.get("10.0.2.1:8000") == 0 and t.own("10.0.2.1:8000") == 0
    t.finished(eps[3])  # the endpoints already there keep counting
    t.started(eps[5])
    assert t.get(eps[3]) == 0 and t.get(eps[5]) == 2


def test_colliding_keys_probe_to_the_next_slot(monkeypatch):
    monkeypatch.setattr(inflight, "SLOTS", 4)
    home = endpoint_key(EP) % 4
    other = next(ep for ep in (f"10.0.3.{i}:80" for i in range(1000)) if endpoint_key(ep) % 4 == home)
    t = InflightTable()
    bump(t, EP, started=2)
    bump(t, other, started=1)  # same home slot: stored in the next one, counted apart
    assert t.get(EP) == 2 and t.get(other) == 1
    assert t._own.find(endpoint_key(EP), insert=False) == home * inflight._SLOT.size
    assert t._own.find(endpoint_key(other), insert=False) == ((home + 1) % 4) * inflight._SLOT.size
    t.finished(other)
    assert t.get(EP) == 2 and t.get(other) == 0


def test_counts_reads_slot_zero_and_the_struct_path_of_big_endian_hosts(tmp_path, clock, monkeypatch):
    monkeypatch.setattr(inflight, "SLOTS", 4)
    at_zero = next(ep for ep in (f"10.0.4.{i}:80" for i in range(1000)) if endpoint_key(ep) % 4 == 0)
    w0, w1 = InflightTable(tmp_path, 0), InflightTable(tmp_path, 1)
    bump(w0, at_zero, started=3, finished=1)
    bump(w1, at_zero, started=2)
    bump(w1, EP, started=1)
    assert w0._own.find(endpoint_key(at_zero), insert=False) == 0  # offset 0 is a slot, not "absent"
    want = {at_zero: 4, EP: 1, OTHER: 0}
    assert w0.counts((at_zero, EP, OTHER)) == want
    # a host whose byte order is not little-endian reads each slot with struct instead of u64 words
    for t in w0._tables():
        t.words = None
    assert w0.counts((at_zero, EP, OTHER)) == want == {e: w0.get(e) for e in want}


# --- tokens and pending prefill --------------------------------------------------------------------


def test_loads_sum_requests_tokens_and_pending_prefill():
    t = InflightTable()
    t.started(EP, tokens=300, prefill=256)
    t.started(EP, tokens=100, prefill=0)
    assert t.loads([EP]) == {EP: (2, 400, 256)}
    t.prefilled(EP, 256)  # the first request's first token
    assert t.loads([EP]) == {EP: (2, 400, 0)}
    t.finished(EP, tokens=300)
    assert t.loads([EP]) == {EP: (1, 100, 0)} and t.get(EP) == 1 and t.counts([EP]) == {EP: 1}
    t.started(EP, tokens=50, prefill=40)
    t.finished(EP, tokens=50, prefill=40)  # ended before its first token: its prefill leaves with it
    t.finished(EP, tokens=100)
    assert t.loads([EP, "10.9.9.9:1"]) == {EP: (0, 0, 0), "10.9.9.9:1": (0, 0, 0)}


def test_loads_never_go_negative_and_ignore_nonpositive_amounts():
    t = InflightTable()
    t.finished(EP, tokens=10, prefill=5)  # an end without its start (a reload's race): clamped at 0
    assert t.loads([EP]) == {EP: (0, 0, 0)}
    t.started(EP, tokens=-5, prefill=-1)
    t.prefilled(EP, -3)
    assert t.loads([EP]) == {EP: (0, 0, 0)}  # the earlier finish still outweighs the one start


def test_loads_are_summed_over_workers(tmp_path):
    a, b = InflightTable(tmp_path, 0), InflightTable(tmp_path, 1)
    a.started(EP, tokens=10, prefill=8)
    b.started(EP, tokens=20, prefill=16)
    b.prefilled(EP, 16)
    assert a.loads([EP]) == b.loads([EP]) == {EP: (2, 30, 8)}


def test_loads_on_the_struct_path_equal_the_word_path(monkeypatch):
    t = InflightTable()
    t.started(EP, tokens=7, prefill=3)
    words = t.loads([EP])
    monkeypatch.setattr(t._own, "words", None)  # a big-endian host's path
    t.started(EP, tokens=5, prefill=2)
    t.prefilled(EP, 3)
    assert words == {EP: (1, 7, 3)} and t.loads([EP]) == {EP: (2, 12, 2)} and t.get(EP) == 2


def test_a_reader_creates_no_file_and_sums_every_worker(tmp_path):
    a, b = InflightTable(tmp_path, 0), InflightTable(tmp_path, 1)
    a.started(EP, tokens=10, prefill=4)
    b.started(EP, tokens=5)
    before = sorted(p.name for p in tmp_path.iterdir())
    r = InflightTable(tmp_path, reader=True)
    assert r.loads([EP]) == {EP: (2, 15, 4)} and r.get(EP) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing of its own
