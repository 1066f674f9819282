"""SQL generation adapter: a real database's schema introspected, given to the model compactly, and the
model's SQL checked and run read-only.

What:
- `introspect(database, tables, schema_name)`: tables and views with their columns, types, primary
  keys and foreign keys, read from SQLite (`sqlite_schema`, `PRAGMA table_info`/`foreign_key_list`)
  or PostgreSQL (`pg_catalog`, one schema: `public` unless `sql.schema` says otherwise). Called once
  per config load (`compile_sql`, by `extproc/config/compile.py`): the schema lives in the immutable
  snapshot; a database schema change takes effect at the next reload.
- `DbSchema.prompt()`: one line per table, `orders(id integer PK, customer_id integer ->
  customers.id, total real)`; `compile_sql` refuses a schema longer than `sql.maxSchemaBytes`
  (default 8 KiB: list the tables the model may use in `sql.tables`).
- `check_sql(text, config)`: the model's answer (code fences and a trailing `;` stripped) parsed
  with sqlglot in the database's dialect; refused (`SqlRefused`, its `reason` in the error) when it
  is not exactly one statement (`multiple_statements`), does not parse (`parse_error`), is not a
  query (`not_read_only`: any INSERT/UPDATE/DELETE/MERGE/DDL/command anywhere in the tree, SELECT
  INTO, FOR UPDATE/SHARE), names a table that is not in the schema or its CTEs (`unknown_table`), a
  column no table in scope has (`unknown_column`: sqlglot's qualify with the schema), or calls a
  function that writes, sleeps, reads files or administers the server (`forbidden_function`:
  `FORBIDDEN_FUNCTIONS`, any `pg_*`/`lo_*`/`pragma_*` function, any `*_to_xml*` one). The outermost LIMIT is capped: none or one
  over `sql.maxRows` becomes LIMIT maxRows + 1 (the extra row only tells `truncated`), a smaller
  literal one is kept. The SQL that runs is the parsed tree rendered again, not the model's text.
- `Connections.run(config, checked)`: the statement on a read-only connection with a deadline.
  SQLite: `file:...?mode=ro` URI, `PRAGMA query_only = ON`, a progress handler that interrupts it
  at `sql.timeout`; a connection per query (opening one costs tens of microseconds).
  PostgreSQL (psycopg): connections with `default_transaction_read_only=on` and `statement_timeout`,
  `read_only` transactions rolled back after each query, idle ones kept (at most `POOL_SIZE` per
  database) in the worker's `Connections` (in `Runtime.cache("sql")`), a broken one dropped.
  Rows come back as JSON values (Decimal as a number, dates ISO 8601, bytes base64).
Cost (perf/bench_sql.py, perf/RESULTS.md): prompt building is a string join of the precomputed
schema text; checking is one sqlglot parse plus one qualify pass (~0.3-1 ms for a join of two tables);
running is the database's own time.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import re
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping
from urllib.parse import quote

MAX_ROWS = 100
TIMEOUT_S = 2.0
MAX_SCHEMA_BYTES = 8192
POOL_SIZE = 4  # idle PostgreSQL connections kept per database and worker
IDLE_CLOSE_S = 300.0  # a database (URL, timeout) no query used for this long has its idle connections closed
PROGRESS_STEPS = 1000  # SQLite VM instructions between deadline checks

# functions that write, sleep, read or write files, load code or administer the server; any pg_*, lo_*
# and pragma_* function is refused too (PostgreSQL's admin, file and large-object functions; SQLite's
# pragma table-valued functions, which read the schema past `sql.tables`), and any *_to_xml* one
# (PostgreSQL's query_to_xml and kin run the SQL text they are given)
FORBIDDEN_FUNCTIONS = frozenset({
    "sleep", "benchmark", "set_config", "nextval", "setval", "currval", "lastval", "dblink", "dblink_exec",
    "load_extension", "readfile", "writefile", "edit", "fts3_tokenizer", "zeroblob", "randomblob",
    "query_to_xml", "query_to_xml_and_xmlschema", "table_to_xml", "database_to_xml", "cursor_to_xml",
    "txid_current", "current_setting", "lo_import", "lo_export", "copy",
})
FORBIDDEN_PREFIXES = ("pg_", "lo_", "pragma_")


class SqlConfigError(Exception):
    """A database the config names cannot be introspected, or its schema does not fit (config load)."""


class SqlRefused(Exception):
    """The model's SQL was refused before it ran (`reason`: a short code; the message names what)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class SqlFailed(Exception):
    """The SQL ran and the database stopped it: `reason` is `timeout` or `database_error`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str
    pk: bool = False
    ref: str | None = None  # "table.column" of a foreign key


@dataclass(frozen=True, slots=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    view: bool = False


@dataclass(frozen=True, slots=True)
class DbSchema:
    dialect: str  # sqlglot's: "sqlite" or "postgres"
    tables: Mapping[str, Table]  # by lower-cased name

    def prompt(self) -> str:
        lines = []
        for t in self.tables.values():
            cols = ", ".join(f"{c.name} {c.type or 'any'}{' PK' if c.pk else ''}{f' -> {c.ref}' if c.ref else ''}"
                             for c in t.columns)
            lines.append(f"{t.name}({cols}){' view' if t.view else ''}")
        return "\n".join(lines)

    def glot_schema(self) -> dict[str, dict[str, str]]:
        return {t.name: {c.name: (c.type or "TEXT") for c in t.columns} for t in self.tables.values()}


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (a Route field)
class SqlConfig:
    """A sql route's compiled `sql` block (in `Route.sql`): where, the schema read at load, the limits."""
    database: str  # SQLite: the absolute file path; PostgreSQL: the conninfo URL
    engine: str  # "sqlite" | "postgresql"
    schema: DbSchema
    system_prompt: str
    max_rows: int = MAX_ROWS
    timeout: float = TIMEOUT_S
    max_tokens: int = 512
    question_field: str = "question"
    namespace: str = "main"  # the schema its tables are in: SQLite `main`, PostgreSQL `sql.schema`
    glot: Any = None  # sqlglot MappingSchema of `schema`, built once at load (check_sql only reads it)

    def user_prompt(self, question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]


@dataclass(frozen=True, slots=True)
class Checked:
    sql: str  # what runs: the parsed statement rendered again, with the capped LIMIT
    fetch: int  # rows to fetch: max_rows + 1 when the gateway capped the LIMIT, else the query's own
    capped: bool  # the gateway set the LIMIT (a row past max_rows means truncated)


@dataclass(frozen=True, slots=True)
class Result:
    columns: tuple[str, ...]
    rows: list[list[Any]]
    truncated: bool


# -- introspection --------------------------------------------------------------------------------------

def engine_of(database: str) -> str:
    return "postgresql" if database.startswith(("postgresql://", "postgres://")) else "sqlite"


def sqlite_path(database: str, base: Path) -> Path:
    """`sqlite:///abs/path`, `sqlite:rel/path` or a plain path; relative paths are read from `base`."""
    name = database.removeprefix("sqlite://").removeprefix("sqlite:")
    p = Path(name)
    return p if p.is_absolute() else (base / p).resolve()


def _sqlite_connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA query_only = ON")
    return conn


def _introspect_sqlite(path: str) -> list[Table]:
    if not Path(path).is_file():
        raise SqlConfigError(f"SQLite database {path} does not exist")
    try:
        conn = _sqlite_connect(path)
    except sqlite3.Error as e:
        raise SqlConfigError(f"SQLite database {path}: {e}") from None
    try:
        out = []
        for name, kind in conn.execute("SELECT name, type FROM sqlite_schema WHERE type IN ('table', 'view') "
                                       "AND name NOT LIKE 'sqlite_%' ORDER BY name"):
            qn = '"' + name.replace('"', '""') + '"'
            fks = {row[3]: f"{row[2]}.{row[4] or 'rowid'}" for row in conn.execute(f"PRAGMA foreign_key_list({qn})")}
            cols = tuple(Column(c[1], (c[2] or "").lower(), bool(c[5]), fks.get(c[1]))
                         for c in conn.execute(f"PRAGMA table_info({qn})"))
            out.append(Table(name, cols, kind == "view"))
        return out
    except sqlite3.Error as e:
        raise SqlConfigError(f"SQLite database {path}: {e}") from None
    finally:
        conn.close()


_PG_COLUMNS = """
SELECT c.relname, c.relkind, a.attname, format_type(a.atttypid, a.atttypmod),
       EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conrelid = c.oid AND k.contype = 'p' AND a.attnum = ANY (k.conkey)),
       (SELECT rc.relname || '.' || ra.attname FROM pg_constraint k
          JOIN pg_class rc ON rc.oid = k.confrelid
          JOIN pg_attribute ra ON ra.attrelid = k.confrelid AND ra.attnum = k.confkey[array_position(k.conkey, a.attnum)]
         WHERE k.conrelid = c.oid AND k.contype = 'f' AND a.attnum = ANY (k.conkey) LIMIT 1)
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
 WHERE n.nspname = %s AND c.relkind IN ('r', 'v', 'm', 'p')
 ORDER BY c.relname, a.attnum
"""


def _pg_connect(url: str, timeout: float, connect_timeout: float = 5.0):
    import psycopg

    ms = max(1, int(timeout * 1000))
    return psycopg.connect(url, connect_timeout=max(1, int(connect_timeout)), autocommit=False,
                           options=f"-c default_transaction_read_only=on -c statement_timeout={ms}")


def _introspect_postgres(url: str, schema_name: str) -> list[Table]:
    import psycopg

    try:
        with _pg_connect(url, 10.0) as conn:
            rows = conn.execute(_PG_COLUMNS, (schema_name,)).fetchall()
            conn.rollback()
    except psycopg.Error as e:
        raise SqlConfigError(f"PostgreSQL database {_redact(url)}: {str(e).strip()}") from None
    tables: dict[str, list[Column]] = {}
    kinds: dict[str, str] = {}
    for rel, kind, col, typ, pk, ref in rows:
        tables.setdefault(rel, []).append(Column(col, typ, bool(pk), ref))
        kinds[rel] = kind
    return [Table(n, tuple(cs), kinds[n] in ("v", "m")) for n, cs in tables.items()]


def _redact(url: str) -> str:
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def introspect(database: str, tables: tuple[str, ...] = (), schema_name: str = "public") -> DbSchema:
    """The schema of `database` (an absolute SQLite path or a PostgreSQL URL); `tables`: only these
    (each must exist). Raises SqlConfigError."""
    engine = engine_of(database)
    found = _introspect_postgres(database, schema_name) if engine == "postgresql" else _introspect_sqlite(database)
    by_name = {t.name.lower(): t for t in found}
    if tables:
        missing = [t for t in tables if t.lower() not in by_name]
        if missing:
            raise SqlConfigError(f"tables not in the database: {', '.join(missing)} (it has: "
                                 f"{', '.join(t.name for t in found) or 'none'})")
        by_name = {t.lower(): by_name[t.lower()] for t in tables}
    if not by_name:
        raise SqlConfigError("the database has no tables or views" +
                             (f" in schema {schema_name}" if engine == "postgresql" else ""))
    return DbSchema("postgres" if engine == "postgresql" else "sqlite", MappingProxyType(by_name))


def system_prompt(schema: DbSchema, max_rows: int) -> str:
    name = "PostgreSQL" if schema.dialect == "postgres" else "SQLite"
    return (f"You translate questions into one {name} SELECT statement over this database "
            f"(table(column type, PK: primary key, -> foreign key)):\n{schema.prompt()}\n"
            f"Rules: read only (one SELECT, WITH allowed); only the tables and columns above; at most "
            f"{max_rows} rows. Answer with the SQL only, no explanation.")


def compile_sql(database: str, *, base: Path, tables: tuple[str, ...] = (), schema_name: str = "public",
                max_rows: int = MAX_ROWS, timeout: float = TIMEOUT_S, max_schema_bytes: int = MAX_SCHEMA_BYTES,
                max_tokens: int = 512, question_field: str = "question") -> SqlConfig:
    """A route's `sql` block compiled at config load: the database introspected, the prompt built."""
    engine = engine_of(database)
    where = database if engine == "postgresql" else str(sqlite_path(database, base))
    schema = introspect(where, tables, schema_name)
    text = schema.prompt()
    size = len(text.encode())
    if size > max_schema_bytes:
        raise SqlConfigError(f"the schema of {len(schema.tables)} tables is {size} bytes, over maxSchemaBytes "
                             f"{max_schema_bytes}: list the tables the model may use in `tables`, or raise "
                             "maxSchemaBytes")
    from sqlglot.schema import MappingSchema

    return SqlConfig(where, engine, schema, system_prompt(schema, max_rows), max_rows, timeout, max_tokens,
                     question_field, schema_name if engine == "postgresql" else "main",
                     MappingSchema(schema.glot_schema(), dialect=schema.dialect))


# -- checking -------------------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*(?:sql|SQL|postgresql|sqlite)?[ \t]*\n?(.*?)```", re.S)


def extract_sql(answer: str) -> str:
    """The SQL in a model's answer: the first fenced block if there is one, else the whole text."""
    m = _FENCE.search(answer)
    text = (m.group(1) if m else answer).strip()
    while text.endswith(";"):
        text = text[:-1].rstrip()
    return text


def check_sql(text: str, config: SqlConfig) -> Checked:
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import OptimizeError, ParseError, SqlglotError
    from sqlglot.optimizer.qualify import qualify

    dialect = config.schema.dialect
    if not text:
        raise SqlRefused("parse_error", "the model answered no SQL")
    try:
        statements = [s for s in sqlglot.parse(text, read=dialect) if s is not None]
    except ParseError as e:
        first = e.errors[0]["description"] if e.errors else str(e).splitlines()[0]
        raise SqlRefused("parse_error", f"the model's SQL does not parse: {first}") from None
    except SqlglotError as e:
        raise SqlRefused("parse_error", f"the model's SQL does not parse: {e}") from None
    if len(statements) != 1:
        raise SqlRefused("multiple_statements", f"one statement allowed, the model's SQL has {len(statements)}")
    tree = statements[0]
    writes = (exp.Insert, exp.Update, exp.Delete, exp.Merge, exp.Create, exp.Drop, exp.Alter, exp.Command,
              exp.TruncateTable, exp.Pragma, exp.Attach, exp.Detach, exp.Into, exp.Lock, exp.Set, exp.Transaction,
              exp.Commit, exp.Rollback, exp.Copy, exp.Grant)
    if isinstance(tree, writes):
        raise SqlRefused("not_read_only", f"only a SELECT runs; the model's SQL is {tree.key.upper()}")
    if not isinstance(tree, (exp.Select, exp.SetOperation)):
        raise SqlRefused("parse_error", f"the model's answer is not a SQL statement: {text[:80]!r}")
    for node in tree.walk():
        if isinstance(node, writes):
            what = "SELECT INTO" if isinstance(node, exp.Into) else \
                "a locking clause" if isinstance(node, exp.Lock) else node.key.upper()
            raise SqlRefused("not_read_only", f"only a SELECT runs; the model's SQL contains {what}")
        if isinstance(node, exp.Func):
            name = (node.name if isinstance(node, exp.Anonymous) else node.sql_name()).lower()
            if name in FORBIDDEN_FUNCTIONS or name.startswith(FORBIDDEN_PREFIXES) or "_to_xml" in name:
                raise SqlRefused("forbidden_function", f"function {name}() is not allowed")
    ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    for t in tree.find_all(exp.Table):
        name = t.name.lower()
        if not name:  # a table-valued function (FROM generate_series(...)): its functions were checked above
            continue
        if t.args.get("catalog") or (t.db and t.db.lower() != config.namespace.lower()):
            raise SqlRefused("unknown_table", f"table {t.sql(dialect)} is not in the schema (only {config.namespace}'s "
                             "tables are)")
        if name not in config.schema.tables and name not in ctes:
            raise SqlRefused("unknown_table", f"table {t.name} is not in the schema")
    own = _literal_limit(tree.args.get("limit"))
    if own is not None and own <= config.max_rows:
        checked = Checked(tree.sql(dialect=dialect), own, False)
    else:
        tree = tree.limit(config.max_rows + 1, copy=False)
        checked = Checked(tree.sql(dialect=dialect), config.max_rows + 1, True)
    try:  # rendered above: qualifying rewrites the tree in place (aliases, quotes), which is not what runs
        qualify(tree, schema=config.glot, dialect=dialect, validate_qualify_columns=True, quote_identifiers=False,
                identify=False)
    except OptimizeError as e:
        raise SqlRefused("unknown_column", f"{e}".split(". Line:")[0]) from None
    except SqlglotError as e:
        raise SqlRefused("parse_error", f"the model's SQL could not be resolved: {e}") from None
    return checked


def _literal_limit(limit: Any) -> int | None:
    from sqlglot import exp

    if limit is None:
        return None
    value = limit.expression if isinstance(limit, exp.Limit) else limit
    if isinstance(value, exp.Literal) and value.is_int:
        return int(value.this)
    return None


# -- running --------------------------------------------------------------------------------------------

def _json_value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, decimal.Decimal):
        return int(v) if v == v.to_integral_value() and abs(v) < 2 ** 53 else float(v)
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return v.isoformat()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    return str(v)


def _result(columns: tuple[str, ...], rows: list[Any], checked: Checked, max_rows: int) -> Result:
    truncated = checked.capped and len(rows) > max_rows
    return Result(columns, [[_json_value(v) for v in r] for r in rows[:max_rows]], truncated)


class Connections:
    """A worker's database connections (one per `Runtime`, in `Runtime.cache("sql")`): idle PostgreSQL
    connections per database URL, at most POOL_SIZE each; SQLite opens one per query. Thread-safe
    (queries run in worker threads). Those of a database no query used for IDLE_CLOSE_S (a reload
    changed its URL or timeout, or dropped the route) are closed at the next query."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, float], list[Any]] = {}
        self._used: dict[tuple[str, float], float] = {}
        self._lock = threading.Lock()

    def run(self, config: SqlConfig, checked: Checked) -> Result:
        if config.engine == "postgresql":
            return self._run_postgres(config, checked)
        return run_sqlite(config, checked)

    def _run_postgres(self, config: SqlConfig, checked: Checked) -> Result:
        import psycopg

        key = (config.database, config.timeout)
        now = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault(key, [])
            conn = idle.pop() if idle else None
            self._used[key] = now
            stale = [k for k, t in self._used.items() if k != key and now - t >= IDLE_CLOSE_S]
            closing = [c for k in stale for c in self._idle.pop(k, ())]
            for k in stale:
                del self._used[k]
        for c in closing:
            c.close()
        try:
            if conn is None:
                conn = _pg_connect(config.database, config.timeout)
                conn.read_only = True
            try:
                cur = conn.execute(checked.sql)
                columns = tuple(d.name for d in cur.description or ())
                rows = cur.fetchmany(checked.fetch)
            finally:
                conn.rollback()
        except psycopg.errors.QueryCanceled:
            self._keep(key, conn)
            raise SqlFailed("timeout", f"the query ran past the statement timeout ({config.timeout:g} s)") from None
        except psycopg.Error as e:
            if conn is not None and not conn.closed and conn.info.transaction_status == 0:  # IDLE: still usable
                self._keep(key, conn)
            elif conn is not None:
                conn.close()
            raise SqlFailed("database_error", f"the database refused the query: {str(e).strip()}") from None
        self._keep(key, conn)
        return _result(columns, rows, checked, config.max_rows)

    def _keep(self, key: tuple[str, float], conn: Any) -> None:
        if conn is None or conn.closed:
            return
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < POOL_SIZE:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for c in conns:
            c.close()


def run_sqlite(config: SqlConfig, checked: Checked) -> Result:
    deadline = time.monotonic() + config.timeout
    try:
        conn = _sqlite_connect(config.database)
    except sqlite3.Error as e:
        raise SqlFailed("database_error", f"the database could not be opened: {e}") from None
    try:
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, PROGRESS_STEPS)
        cur = conn.execute(checked.sql)
        columns = tuple(d[0] for d in cur.description or ())
        rows = cur.fetchmany(checked.fetch)
    except sqlite3.OperationalError as e:
        if "interrupted" in str(e):
            raise SqlFailed("timeout", f"the query ran past the statement timeout ({config.timeout:g} s)") from None
        raise SqlFailed("database_error", f"the database refused the query: {e}") from None
    except sqlite3.Error as e:
        raise SqlFailed("database_error", f"the database refused the query: {e}") from None
    finally:
        conn.close()
    return _result(columns, rows, checked, config.max_rows)


def result_document(checked: Checked, result: Result) -> dict[str, Any]:
    return {"sql": checked.sql, "columns": list(result.columns), "rows": result.rows,
            "row_count": len(result.rows), "truncated": result.truncated}


__all__ = ["Checked", "Column", "Connections", "DbSchema", "Result", "SqlConfig", "SqlConfigError", "SqlFailed",
           "SqlRefused", "Table", "check_sql", "compile_sql", "engine_of", "extract_sql", "introspect",
           "result_document", "run_sqlite", "sqlite_path", "system_prompt"]
