"""The SQL adapter's parts on a real SQLite file: the schema introspected (keys, views, the table list,
the size bound), the model's SQL checked (each refusal reason; the LIMIT kept or capped; what runs is
the re-rendered tree), and run read-only with a deadline (rows as JSON values, truncation, timeout,
a write refused by the connection itself); and config errors naming the field."""

from __future__ import annotations

import sqlite3

import pytest

from extproc.config.loader import ConfigError, load_text
from extproc.semantic.sql import (Checked, SqlConfigError, SqlFailed, SqlRefused, check_sql, compile_sql, extract_sql,
                                  run_sqlite)

SHOP = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, photo BLOB);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), total REAL, day TEXT);
CREATE VIEW big_orders AS SELECT id, total FROM orders WHERE total > 5;
INSERT INTO customers VALUES (1, 'Ada', x'0102'), (2, 'Bob', NULL);
INSERT INTO orders VALUES (1, 1, 10.5, '2026-01-01'), (2, 1, 4.5, '2026-01-02'), (3, 2, 7, '2026-01-03');
"""


def make_db(path, script=SHOP):
    conn = sqlite3.connect(path)
    conn.executescript(script)
    conn.commit()
    conn.close()
    return path


@pytest.fixture
def cfg(tmp_path):
    make_db(tmp_path / "shop.db")
    return compile_sql("shop.db", base=tmp_path, max_rows=2, timeout=0.2)


def test_the_schema_is_introspected_with_keys_and_views_in_one_line_per_table(cfg, tmp_path):
    assert cfg.engine == "sqlite" and cfg.database == str(tmp_path / "shop.db")
    assert cfg.schema.prompt() == (
        "big_orders(id integer, total real) view\n"
        "customers(id integer PK, name text, photo blob)\n"
        "orders(id integer PK, customer_id integer -> customers.id, total real, day text)")
    assert cfg.schema.prompt() in cfg.system_prompt and "SQLite" in cfg.system_prompt
    assert "at most 2 rows" in cfg.system_prompt
    assert cfg.user_prompt("how many?")[1] == {"role": "user", "content": "how many?"}


def test_the_table_list_narrows_the_schema_and_must_name_existing_tables(tmp_path):
    make_db(tmp_path / "shop.db")
    only = compile_sql(str(tmp_path / "shop.db"), base=tmp_path, tables=("Orders",))
    assert list(only.schema.tables) == ["orders"]
    with pytest.raises(SqlRefused) as e:
        check_sql("SELECT name FROM customers", only)
    assert e.value.reason == "unknown_table"
    with pytest.raises(SqlConfigError, match="tables not in the database: payments"):
        compile_sql(str(tmp_path / "shop.db"), base=tmp_path, tables=("payments",))


def test_a_missing_empty_or_oversized_database_is_a_config_error(tmp_path):
    with pytest.raises(SqlConfigError, match="does not exist"):
        compile_sql("none.db", base=tmp_path)
    make_db(tmp_path / "empty.db", "CREATE TABLE t (x INTEGER); DROP TABLE t;")
    with pytest.raises(SqlConfigError, match="no tables or views"):
        compile_sql("empty.db", base=tmp_path)
    wide = "; ".join(f"CREATE TABLE t{i} ({', '.join(f'column_{j} TEXT' for j in range(20))})" for i in range(30))
    make_db(tmp_path / "wide.db", wide)
    with pytest.raises(SqlConfigError, match=r"the schema of 30 tables is \d+ bytes, over maxSchemaBytes 8192"):
        compile_sql("wide.db", base=tmp_path)
    assert len(compile_sql("wide.db", base=tmp_path, tables=("t1", "t2")).schema.tables) == 2


@pytest.mark.parametrize("sql, reason, says", [
    ("DELETE FROM orders", "not_read_only", "DELETE"),
    ("UPDATE orders SET total = 0", "not_read_only", "UPDATE"),
    ("DROP TABLE orders", "not_read_only", "DROP"),
    ("INSERT INTO orders (id) SELECT id FROM orders", "not_read_only", "INSERT"),
    ("ATTACH DATABASE '/tmp/x.db' AS x", "not_read_only", "ATTACH"),
    ("PRAGMA query_only = OFF", "not_read_only", "PRAGMA"),
    ("WITH d AS (DELETE FROM orders RETURNING *) SELECT * FROM d", "not_read_only", "DELETE"),
    ("SELECT 1; DELETE FROM orders", "multiple_statements", "has 2"),
    ("SELEC id FROM orders", "parse_error", "does not parse"),
    ("The total of all orders", "parse_error", "does not parse"),
    ("orders", "parse_error", "not a SQL statement"),
    ("SELECT FROM WHERE (", "parse_error", "does not parse"),
    ("", "parse_error", "no SQL"),
    ("SELECT * FROM payments", "unknown_table", "payments"),
    ("SELECT * FROM other.orders", "unknown_table", "other.orders"),
    ("SELECT price FROM orders", "unknown_column", "price"),
    ("SELECT o.name FROM orders AS o JOIN customers AS c ON c.id = o.customer_id", "unknown_column", "name"),
    ("SELECT randomblob(1000000000)", "forbidden_function", "randomblob"),
    ("SELECT load_extension('evil')", "forbidden_function", "load_extension"),
    ("SELECT pg_sleep(10)", "forbidden_function", "pg_sleep"),
    ("SELECT pg_catalog.pg_sleep(10)", "forbidden_function", "pg_sleep"),
    ("SELECT name FROM pragma_table_info('customers')", "forbidden_function", "pragma_table_info"),
    ("SELECT query_to_xml('DELETE FROM orders', true, true, '')", "forbidden_function", "query_to_xml"),
    ("SELECT * FROM sqlite_schema", "unknown_table", "sqlite_schema"),
])
def test_refusals_name_the_reason(cfg, sql, reason, says):
    with pytest.raises(SqlRefused) as e:
        check_sql(sql, cfg)
    assert e.value.reason == reason and says in str(e.value)


@pytest.mark.parametrize("answer, runs, fetch, capped", [
    ("SELECT id FROM orders", "SELECT id FROM orders LIMIT 3", 3, True),
    ("select id from orders limit 50", "SELECT id FROM orders LIMIT 3", 3, True),
    ("SELECT id FROM orders LIMIT 1", "SELECT id FROM orders LIMIT 1", 1, False),
    ("```sql\nSELECT id FROM orders ORDER BY id DESC;\n```", "SELECT id FROM orders ORDER BY id DESC LIMIT 3", 3, True),
    ("Here it is:\n```\nSELECT main.orders.id FROM main.orders\n```\nDone.", "SELECT main.orders.id FROM main.orders LIMIT 3",
     3, True),
    ("SELECT id FROM orders UNION SELECT id FROM customers", "SELECT id FROM orders UNION SELECT id FROM customers LIMIT 3",
     3, True),
    ("WITH t AS (SELECT customer_id, SUM(total) AS s FROM orders GROUP BY customer_id) SELECT c.name, t.s FROM t "
     "JOIN customers c ON c.id = t.customer_id",
     "WITH t AS (SELECT customer_id, SUM(total) AS s FROM orders GROUP BY customer_id) SELECT c.name, t.s FROM t "
     "JOIN customers AS c ON c.id = t.customer_id LIMIT 3", 3, True),
])
def test_what_passes_runs_as_rendered_with_the_limit_kept_or_capped(cfg, answer, runs, fetch, capped):
    assert check_sql(extract_sql(answer), cfg) == Checked(runs, fetch, capped)


def test_rows_come_back_as_json_values_and_truncation_is_exact(cfg):
    r = run_sqlite(cfg, check_sql("SELECT id, name, photo FROM customers ORDER BY id", cfg))
    assert r.columns == ("id", "name", "photo") and r.rows == [[1, "Ada", "AQI="], [2, "Bob", None]]
    assert not r.truncated  # two rows, max_rows 2: the third one fetched was not there
    r = run_sqlite(cfg, check_sql("SELECT id FROM orders ORDER BY id", cfg))
    assert r.rows == [[1], [2]] and r.truncated
    r = run_sqlite(cfg, check_sql("SELECT id FROM orders ORDER BY id LIMIT 2", cfg))
    assert r.rows == [[1], [2]] and not r.truncated  # the query's own limit: nothing was cut


def test_a_query_past_the_timeout_is_interrupted(cfg):
    forever = check_sql("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c", cfg)
    with pytest.raises(SqlFailed) as e:
        run_sqlite(cfg, forever)
    assert e.value.reason == "timeout" and "0.2 s" in str(e.value)


def test_the_connection_itself_is_read_only(cfg, tmp_path):
    with pytest.raises(SqlFailed) as e:  # bypassing the checker: the database refuses
        run_sqlite(cfg, Checked("DELETE FROM orders", 1, False))
    assert e.value.reason == "database_error" and "readonly" in str(e.value).replace(" ", "")
    conn = sqlite3.connect(tmp_path / "shop.db")
    assert conn.execute("SELECT COUNT(*) FROM orders").fetchone() == (3,)
    conn.close()


CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: sql}}
spec:
  backends: [{{name: llm, kind: openai, endpoints: ["127.0.0.1:9001"], models: [m]}}]
  routes:
    - {route}
"""


@pytest.mark.parametrize("route, where, says", [
    ("{path: /ask, kind: sql, target: llm}", "spec.routes[0].sql", "needs a `sql` block"),
    ("{path: /ask, kind: llm, target: llm, transform: '{\"x\": $.output}', sql: {database: shop.db}}",
     "spec.routes[0].sql", "only sql routes"),
    ("{path: /ask, kind: sql, target: llm, request: '{\"q\": $.q}', sql: {database: shop.db}}",
     "spec.routes[0].request", "only `transform`"),
    ("{path: /ask, kind: sql, target: llm, sql: {database: shop.db, timeout: 1s}}", "spec.routes[0].sql.timeout",
     "below spec.processor.messageTimeout"),
    ("{path: /ask, kind: sql, target: llm, sql: {database: shop.db, tables: [nope]}}", "spec.routes[0].sql.database",
     "tables not in the database: nope"),
    ("{path: /ask, kind: sql, target: llm, sql: {database: missing.db}}", "spec.routes[0].sql.database",
     "missing.db does not exist"),
])
def test_config_errors_name_the_field(tmp_path, route, where, says):
    make_db(tmp_path / "shop.db")
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(CONFIG.format(route=route))
    with pytest.raises(ConfigError) as e:
        load_text(cfg.read_text(), str(cfg))
    text = str(e.value)
    assert f"gateway.yaml:7: {where}: " in text and says in text, text


def test_a_sql_route_compiles_with_its_schema(tmp_path):
    make_db(tmp_path / "shop.db")
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(CONFIG.format(route="{path: /ask, kind: sql, target: llm, sql: {database: shop.db, maxRows: 7}}"))
    route = load_text(cfg.read_text(), str(cfg)).routes["ask"]
    assert route.kind == "sql" and route.model == "m" and route.sql.max_rows == 7
    assert "orders(id integer PK" in route.sql.system_prompt
