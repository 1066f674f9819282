"""The SQL generation adapter end to end: a question through the real Envoy and processor, the model (a
chat server answering with the SQL each test chose: tests/e2e/sql_chat_service.py) asked with the
schema introspected from a real SQLite file and a real PostgreSQL cluster (tests/e2e/postgres.py),
its SQL checked and run read-only, the rows back to the client; refusals (a write, an unknown table
or column, no SQL, a timeout) as errors in the route's dialect naming the reason, with the data
unchanged."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import httpx
import pytest

from extproc.stack import free_port, stop_process, wait_http
from tests.conftest import REPO
from tests.e2e.postgres import Postgres, skip_reason

pytestmark = pytest.mark.e2e

SQLITE = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), total REAL, day TEXT);
INSERT INTO customers VALUES (1, 'Ada', 'Oslo'), (2, 'Bob', 'Bergen'), (3, 'Cy', 'Oslo');
INSERT INTO orders VALUES (1, 1, 10.5, '2026-01-01'), (2, 1, 4.5, '2026-01-02'), (3, 2, 7, '2026-01-03'),
  (4, 3, 1.25, '2026-01-04');
"""
POSTGRES = """
CREATE TABLE products (sku text PRIMARY KEY, title text NOT NULL, price numeric(8, 2));
CREATE TABLE stock (sku text REFERENCES products (sku), warehouse text, qty integer, PRIMARY KEY (sku, warehouse));
INSERT INTO products VALUES ('A1', 'Anvil', 99.90), ('B2', 'Bolt', 0.25), ('C3', 'Cog', 3);
INSERT INTO stock VALUES ('A1', 'north', 2), ('B2', 'north', 500), ('B2', 'south', 120), ('C3', 'south', 0);
"""
FOREVER = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"


@pytest.fixture(scope="module")
def pg():
    if skip_reason() is not None:
        yield None
        return
    with Postgres() as pg:
        pg.execute(POSTGRES)
        yield pg


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pg):
    from tests.e2e.conftest import make_stack

    d = tmp_path_factory.mktemp("sql")
    conn = sqlite3.connect(d / "shop.db")
    conn.executescript(SQLITE)
    conn.commit()
    conn.close()
    port = free_port()
    chat = subprocess.Popen([sys.executable, str(REPO / "tests" / "e2e" / "sql_chat_service.py"), str(port)])
    pg_route = (f"    - {{path: /v1/sql/inventory, kind: sql, target: model, sql: {{database: '{pg.url}', "
                "maxRows: 2, timeout: 300ms}}\n") if pg is not None else ""
    cfg = d / "gateway.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: sql}}
spec:
  backends: [{{name: model, kind: openai, endpoints: ["127.0.0.1:{port}"], models: [sql-model],
               dialect: {{negotiate: false, preset: openai}}}}]
  routes:
    - {{path: /v1/sql/shop, kind: sql, target: model, sql: {{database: shop.db, maxRows: 3, timeout: 300ms}}}}
    - {{path: /v1/sql/count, kind: sql, target: model, sql: {{database: shop.db, tables: [orders]}},
       transform: '{{"orders": $.rows[0][0], "question": $.input.question}}'}}
{pg_route}""")
    st = make_stack(cfg)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, chat)
        st.start()
        st.chat_url = f"http://127.0.0.1:{port}"
        st.db = d / "shop.db"
        yield st
    finally:
        st.stop()
        stop_process(chat)


def ask(stack, path: str, question: str, sql: str) -> httpx.Response:
    httpx.post(f"{stack.chat_url}/answers", json={"question": question, "content": sql}, timeout=5).raise_for_status()
    return httpx.post(f"{stack.url}{path}", json={"question": question}, timeout=10)


def test_sqlite_question_to_rows_with_the_schema_given_to_the_model(stack):
    r = ask(stack, "/v1/sql/shop", "Spend per customer in Oslo?",
            "```sql\nSELECT c.name, SUM(o.total) AS spent FROM customers c JOIN orders o ON o.customer_id = c.id\n"
            "WHERE c.city = 'Oslo' GROUP BY c.name ORDER BY spent DESC;\n```")
    assert r.status_code == 200, r.text
    assert r.headers["x-adapter-sql-rows"] == "2"
    assert r.json() == {"sql": "SELECT c.name, SUM(o.total) AS spent FROM customers AS c JOIN orders AS o ON "
                               "o.customer_id = c.id WHERE c.city = 'Oslo' GROUP BY c.name ORDER BY spent DESC LIMIT 4",
                        "columns": ["name", "spent"], "rows": [["Ada", 15.0], ["Cy", 1.25]], "row_count": 2,
                        "truncated": False}
    sent = httpx.get(f"{stack.chat_url}/last", timeout=5).json()
    assert sent["model"] == "sql-model" and sent["temperature"] == 0
    system, user = sent["messages"]
    assert "customers(id integer PK, name text, city text)" in system["content"]
    assert "orders(id integer PK, customer_id integer -> customers.id, total real, day text)" in system["content"]
    assert user == {"role": "user", "content": "Spend per customer in Oslo?"}


def test_the_limit_is_enforced_and_truncation_reported(stack):
    r = ask(stack, "/v1/sql/shop", "All orders?", "SELECT id FROM orders ORDER BY id LIMIT 1000")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["rows"] == [[1], [2], [3]] and doc["truncated"] is True and doc["sql"].endswith("LIMIT 4")


def test_the_route_transform_maps_the_rows(stack):
    r = ask(stack, "/v1/sql/count", "How many orders?", "SELECT COUNT(*) FROM orders")
    assert r.status_code == 200, r.text
    assert r.json() == {"orders": 4, "question": "How many orders?"}
    # the table list narrows what the model may read: customers is not this route's
    r = ask(stack, "/v1/sql/count", "Names?", "SELECT name FROM customers")
    assert r.status_code == 422 and r.json()["error"]["reason"] == "unknown_table"


@pytest.mark.parametrize("sql, status, code, reason", [
    ("DELETE FROM orders", 422, "sql_refused", "not_read_only"),
    ("UPDATE orders SET total = 0 WHERE id = 1", 422, "sql_refused", "not_read_only"),
    ("SELECT 1; DROP TABLE orders", 422, "sql_refused", "multiple_statements"),
    ("SELECT * FROM payments", 422, "sql_refused", "unknown_table"),
    ("SELECT email FROM customers", 422, "sql_refused", "unknown_column"),
    ("Sorry, I can't help with that.", 422, "sql_refused", "parse_error"),
    (FOREVER, 504, "sql_timeout", "timeout"),
])
def test_sqlite_refusals_are_errors_naming_the_reason_and_the_data_is_unchanged(stack, sql, status, code, reason):
    r = ask(stack, "/v1/sql/shop", f"q-{reason}-{status}-{len(sql)}", sql)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["reason"], err["route"]) == (code, reason, "v1-sql-shop")
    assert err["request_id"] and err["sql"]
    conn = sqlite3.connect(stack.db)
    assert conn.execute("SELECT COUNT(*), SUM(total) FROM orders").fetchone() == (4, 23.25)
    conn.close()


def test_a_question_is_required(stack):
    r = httpx.post(f"{stack.url}/v1/sql/shop", json={"ask": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_question"


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
def test_postgres_question_to_rows(stack, pg):
    r = ask(stack, "/v1/sql/inventory", "Stock per product?",
            "SELECT p.title, SUM(s.qty) AS units, MAX(p.price) AS price FROM products p JOIN stock s ON s.sku = p.sku "
            "GROUP BY p.title ORDER BY units DESC")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["columns"] == ["title", "units", "price"]
    assert doc["rows"] == [["Bolt", 620, 0.25], ["Anvil", 2, 99.9]] and doc["truncated"] is True
    system = httpx.get(f"{stack.chat_url}/last", timeout=5).json()["messages"][0]["content"]
    assert "PostgreSQL" in system and "stock(sku text PK -> products.sku, warehouse text PK, qty integer)" in system
    assert "products(sku text PK, title text, price numeric(8,2))" in system


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
@pytest.mark.parametrize("sql, status, code, reason", [
    ("DELETE FROM stock", 422, "sql_refused", "not_read_only"),
    ("SELECT pg_sleep(5)", 422, "sql_refused", "forbidden_function"),
    ("SELECT cost FROM products", 422, "sql_refused", "unknown_column"),
    (FOREVER, 504, "sql_timeout", "timeout"),
    ("SELECT price / 0 FROM products", 502, "sql_error", "database_error"),
])
def test_postgres_refusals_and_failures(stack, pg, sql, status, code, reason):
    r = ask(stack, "/v1/sql/inventory", f"pg-{reason}-{len(sql)}", sql)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["reason"], err["route"]) == (code, reason, "v1-sql-inventory")
    import psycopg

    with psycopg.connect(pg.url) as conn:
        assert conn.execute("SELECT COUNT(*), SUM(qty) FROM stock").fetchone() == (4, 622)
