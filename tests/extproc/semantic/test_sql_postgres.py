"""The SQL adapter on a real PostgreSQL cluster (tests/e2e/postgres.py: initdb + pg_ctl on a free port,
stopped by PID): the schema read from pg_catalog (keys, numeric and timestamp types, views, the
schema named), queries run on a read-only connection with the statement timeout (the database
itself refuses a write the checker never saw), JSON values, and connections kept for reuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.semantic.sql import Checked, Connections, SqlConfigError, SqlFailed, check_sql, compile_sql
from tests.e2e.postgres import Postgres, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

SHOP = """
CREATE TABLE customers (id serial PRIMARY KEY, name text NOT NULL);
CREATE TABLE orders (id serial PRIMARY KEY, customer_id integer REFERENCES customers (id), total numeric(10, 2),
                     placed timestamptz);
CREATE VIEW big_orders AS SELECT id, total FROM orders WHERE total > 5;
CREATE SCHEMA archive;
CREATE TABLE archive.old_orders (id integer PRIMARY KEY);
INSERT INTO customers (name) VALUES ('Ada'), ('Bob');
INSERT INTO orders (customer_id, total, placed) VALUES (1, 10.50, '2026-01-01T00:00:00Z'),
  (1, 4.25, '2026-01-02T00:00:00Z'), (2, 7, '2026-01-03T00:00:00Z');
"""


@pytest.fixture(scope="module")
def pg():
    with Postgres() as pg:
        pg.execute(SHOP)
        yield pg


@pytest.fixture
def cfg(pg):
    return compile_sql(pg.url, base=Path("."), max_rows=2, timeout=0.3)


def test_the_schema_comes_from_pg_catalog(cfg):
    assert cfg.engine == "postgresql" and cfg.schema.dialect == "postgres"
    assert cfg.schema.prompt() == (
        "big_orders(id integer, total numeric(10,2)) view\n"
        "customers(id integer PK, name text)\n"
        "orders(id integer PK, customer_id integer -> customers.id, total numeric(10,2), placed timestamp with time zone)")
    assert "PostgreSQL" in cfg.system_prompt


def test_another_schema_is_named_and_a_wrong_url_is_a_config_error(pg):
    other = compile_sql(pg.url, base=Path("."), schema_name="archive")
    assert list(other.schema.tables) == ["old_orders"]
    assert check_sql("SELECT id FROM archive.old_orders", other).capped
    with pytest.raises(SqlConfigError, match="no tables or views in schema nowhere"):
        compile_sql(pg.url, base=Path("."), schema_name="nowhere")
    with pytest.raises(SqlConfigError, match=r"PostgreSQL database postgresql://postgres:\*\*\*@127.0.0.1") as e:
        compile_sql(f"postgresql://postgres:secret@127.0.0.1:{pg.port}/nosuchdb", base=Path("."))
    assert 'database "nosuchdb" does not exist' in str(e.value) and "secret" not in str(e.value)


def test_rows_as_json_values_with_truncation_and_connection_reuse(cfg):
    conns = Connections()
    try:
        r = conns.run(cfg, check_sql("SELECT o.id, o.total, o.placed, c.name FROM orders o JOIN customers c "
                                     "ON c.id = o.customer_id ORDER BY o.id", cfg))
        assert r.columns == ("id", "total", "placed", "name")
        assert r.rows == [[1, 10.5, "2026-01-01T00:00:00+00:00", "Ada"], [2, 4.25, "2026-01-02T00:00:00+00:00", "Ada"]]
        assert r.truncated
        r = conns.run(cfg, check_sql("SELECT SUM(total) AS s FROM orders", cfg))
        assert r.rows == [[21.75]] and not r.truncated
        assert [len(v) for v in conns._idle.values()] == [1]  # one connection, kept and reused
    finally:
        conns.close()


def test_the_statement_timeout_and_the_read_only_transaction_are_the_databases(cfg, pg):
    conns = Connections()
    try:
        forever = check_sql("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c",
                            cfg)
        with pytest.raises(SqlFailed) as e:
            conns.run(cfg, forever)
        assert e.value.reason == "timeout"
        with pytest.raises(SqlFailed) as e:  # bypassing the checker: the transaction is read only
            conns.run(cfg, Checked("DELETE FROM orders", 1, False))
        assert e.value.reason == "database_error" and "read-only transaction" in str(e.value)
        assert conns.run(cfg, check_sql("SELECT COUNT(*) AS n FROM orders", cfg)).rows == [[3]]  # still usable
    finally:
        conns.close()


def test_idle_connections_of_a_database_no_longer_queried_are_closed(cfg, pg, monkeypatch):
    from dataclasses import replace

    import extproc.semantic.sql as sql

    conns = Connections()
    try:
        conns.run(cfg, check_sql("SELECT 1 AS one", cfg))
        old = conns._idle[(cfg.database, cfg.timeout)][0]
        monkeypatch.setattr(sql, "IDLE_CLOSE_S", 0.0)  # as if the old settings went unused for that long
        other = replace(cfg, timeout=0.4)  # a reload changed the route's timeout: another pool key
        conns.run(other, check_sql("SELECT 1 AS one", other))
        assert old.closed and list(conns._idle) == [(cfg.database, 0.4)]
    finally:
        conns.close()

