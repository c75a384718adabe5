"""Storage backends of the ledger: one SQLAlchemy schema, two databases.

* **SQLite** (default, one machine): a file.  Every write is one ``BEGIN IMMEDIATE``
  transaction, which takes the database's write lock *before* reading, so a check of the
  remaining budget and the reservation that follows are atomic across processes.
* **PostgreSQL** (a team sharing one ledger), through psycopg 3: every write locks its
  dataset's row with ``SELECT ... FOR UPDATE`` first; dataset creation and schema creation
  are serialised with transaction-scoped advisory locks.

URLs: ``None`` -> ``$PRIVTUNE_LEDGER`` or ``sqlite:///$PRIVTUNE_HOME/ledger.db``
(``PRIVTUNE_HOME`` defaults to ``~/.privtune``); ``sqlite:///relative/path.db``,
``sqlite:////absolute/path.db`` (SQLAlchemy's convention; ``~`` is expanded), a bare file
path, ``postgresql://user:password@host:port/dbname`` (also ``postgres://`` and
``postgresql+psycopg://``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.engine.url import URL

from privtune.errors import InvalidParameterError, LedgerError

APPLICATION = "privtune-ledger"
# 1: unkeyed SHA-256 chain and raw content fingerprints; 2: keyed (see _key.py) and a random public id
SCHEMA_VERSION = 2
LEGACY_SCHEMA_VERSION = 1
_PG_SCHEMA_LOCK = 0x70726976  # advisory lock keys ("priv", "init")
_PG_INIT_LOCK = 0x696E6974

metadata = sa.MetaData()

meta_table = sa.Table(
    "privtune_meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

datasets_table = sa.Table(
    "privtune_datasets",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("fingerprint", sa.String(64), nullable=False, unique=True),
    sa.Column("name", sa.String(200), nullable=True, unique=True),
    # random id assigned at registration: what run directories publish instead of any hash of the data
    sa.Column("public_id", sa.String(32), nullable=True, unique=True),
    # caches of the replayed hash chain (verify checks them); the chain is the truth
    sa.Column("total_epsilon", sa.Float, nullable=False),
    sa.Column("delta", sa.Float, nullable=False),
    sa.Column("accountant", sa.String(16), nullable=False),
    sa.Column("created_at", sa.String(40), nullable=False),
    sa.Column("head_seq", sa.Integer, nullable=False),
    sa.Column("head_hash", sa.String(64), nullable=False),
)

records_table = sa.Table(
    "privtune_records",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("dataset_id", sa.Integer, sa.ForeignKey("privtune_datasets.id"), nullable=False, index=True),
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("entry_id", sa.String(32), nullable=True, index=True),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("epsilon_after", sa.Float, nullable=False),
    sa.Column("command", sa.Text, nullable=False),
    sa.Column("config_hash", sa.String(64), nullable=True),
    sa.Column("privtune_version", sa.String(32), nullable=False),
    sa.Column("username", sa.String(128), nullable=False),
    sa.Column("host", sa.String(256), nullable=False),
    sa.Column("created_at", sa.String(40), nullable=False),
    sa.Column("prev_hash", sa.String(64), nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
    sa.UniqueConstraint("dataset_id", "seq", name="uq_privtune_records_dataset_seq"),
)

_TABLES = {"privtune_meta", "privtune_datasets", "privtune_records"}


def privtune_home() -> Path:
    """``$PRIVTUNE_HOME`` or ``~/.privtune``."""
    return Path(os.environ.get("PRIVTUNE_HOME") or "~/.privtune").expanduser()


def default_ledger_url() -> str:
    """``$PRIVTUNE_LEDGER`` when set, else ``sqlite:///`` + ``privtune_home()/ledger.db``."""
    env = os.environ.get("PRIVTUNE_LEDGER")
    if env:
        return env
    return f"sqlite:///{privtune_home() / 'ledger.db'}"


def _is_default_location(path: Path) -> bool:
    return path.parent == privtune_home()


def _in_memory_error(raw: str) -> InvalidParameterError:
    return InvalidParameterError(
        f"`url` {mask_url(raw)!r} names no SQLite file, which would give an in-memory ledger: it forgets "
        "every budget and spend when the process exits, so nothing would be on the books. Pass a file, "
        "e.g. 'sqlite:////absolute/path/ledger.db' (four slashes for an absolute path) or a plain path; "
        "omit --ledger to use $PRIVTUNE_LEDGER or ~/.privtune/ledger.db. (From Python, a throw-away "
        "ledger for tests is Ledger('sqlite:///:memory:', allow_in_memory=True).)"
    )


def resolve_url(url: str | os.PathLike | None, *, allow_in_memory: bool = False) -> tuple[URL, Path | None, bool]:
    """Return (SQLAlchemy URL, SQLite file path or None, whether it is the default location).

    An SQLite URL without a file (``sqlite://``, ``sqlite:///``, ``sqlite:///:memory:``, or a
    ``file:`` URI in memory mode) is refused unless ``allow_in_memory``: an in-memory ledger
    keeps no books."""
    raw = default_ledger_url() if url is None else url
    if isinstance(raw, os.PathLike):
        raw = os.fspath(raw)
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidParameterError(
            f"`url` must be a ledger URL string such as 'sqlite:////path/ledger.db' or "
            f"'postgresql://user@host/db'. Got {raw!r}."
        )
    raw = raw.strip()
    if "://" not in raw:  # a bare path
        raw = "sqlite:///" + str(Path(raw).expanduser())
    if raw.startswith("postgres://"):
        raw = "postgresql://" + raw[len("postgres://"):]
    try:
        u = make_url(raw)
    except Exception:
        raise InvalidParameterError(
            f"`url` is not a valid database URL. Got {raw!r}. Use 'sqlite:////absolute/path/ledger.db' "
            "or 'postgresql://user:password@host:5432/dbname'."
        ) from None
    backend = u.get_backend_name()
    if backend == "sqlite":
        if u.drivername not in ("sqlite", "sqlite+pysqlite"):
            raise InvalidParameterError(f"`url` driver {u.drivername!r} is not supported; use plain 'sqlite:///PATH'.")
        db = (u.database or "").strip()
        if db in ("", ":memory:"):
            if not allow_in_memory:
                raise _in_memory_error(raw)
            return u, None, False
        if db.startswith("file:"):  # SQLite URI filename (e.g. ?mode=ro&uri=true)
            name, _, query = db[len("file:"):].partition("?")
            in_memory = name in ("", ":memory:") or "mode=memory" in query or u.query.get("mode") == "memory"
            if in_memory:
                if not allow_in_memory:
                    raise _in_memory_error(raw)
                return u, None, False
            return u, Path(name).expanduser(), False
        path = Path(db).expanduser()
        u = u.set(database=str(path))
        return u, path, _is_default_location(path)
    if backend == "postgresql":
        if u.drivername not in ("postgresql", "postgresql+psycopg"):
            raise InvalidParameterError(
                f"`url` driver {u.drivername!r} is not supported; use 'postgresql://...' "
                "(privtune talks to PostgreSQL through psycopg 3)."
            )
        return u.set(drivername="postgresql+psycopg"), None, False
    raise InvalidParameterError(
        f"`url` must use one of the schemes 'sqlite', 'postgresql'. Got {u.drivername!r} in {mask_url(raw)!r}."
    )


def mask_url(url: str | URL) -> str:
    """The URL with any password (user part or ``password=`` query parameter) replaced by ``***``
    (for messages and JSON)."""
    if isinstance(url, URL):
        masked = url.render_as_string(hide_password=True)
    else:
        masked = re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", str(url))
    return re.sub(r"([?&]password=)[^&]*", r"\1***", masked)


def url_without_password(url: str) -> str:
    """``url`` with its password removed, for the files a run writes (config.yaml, its private state).

    The password of the user part and a ``password=`` query parameter are dropped, the rest is kept:
    ``postgresql://user:SECRET@host/db`` becomes ``postgresql://user@host/db``, for which libpq takes
    the password from ``PGPASSWORD`` or ``~/.pgpass``.  A URL without a password is returned as given.
    Parsed as the ledger parses it (SQLAlchemy), so what is removed is what the ledger would send.
    """
    try:
        u = make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        # not a URL the ledger can open (a run never gets far with it): drop what stands where a password would
        return re.sub(r"([?&])password=[^&]*&?", r"\1", re.sub(r"(://[^:/@]*):[^@]*@", r"\1@", url))
    if u.password is None and "password" not in u.query:
        return url
    query = {k: v for k, v in u.query.items() if k != "password"}
    return URL.create(u.drivername, username=u.username, host=u.host, port=u.port, database=u.database,
                      query=query).render_as_string(hide_password=False)


# A locked SQLite ledger (another process writing, or a program holding a lock) is waited for up to
# LOCK_WAIT_S seconds in total; after LOCK_NOTICE_S of waiting a line on stderr says so, and for what.
LOCK_NOTICE_S = 2.0
LOCK_WAIT_S = 120.0


def _is_locked(exc: BaseException) -> bool:
    return "database is locked" in str(exc).lower() or "database is busy" in str(exc).lower()


def _lock_notice(sqlite_path: Path | None, purpose: str) -> None:
    print(
        f"privtune: the SQLite ledger {str(sqlite_path)!r} is locked by another process (another privtune command "
        f"recording a spend, or a program holding the file open); waiting up to {LOCK_WAIT_S - LOCK_NOTICE_S:.3g} s "
        f"more to {purpose}.",
        file=sys.stderr, flush=True,
    )


def _wait_for_lock(dbapi_conn, statement: str, sqlite_path: Path | None, purpose: str) -> None:
    """Run ``statement`` (which takes a lock); if the file stays locked for LOCK_NOTICE_S, say so on
    stderr and keep waiting up to LOCK_WAIT_S in total (then the 'database is locked' error)."""
    cur = dbapi_conn.cursor()
    try:
        cur.execute(f"PRAGMA busy_timeout = {int(LOCK_NOTICE_S * 1000)}")
        try:
            cur.execute(statement)
            return
        except sqlite3.OperationalError as exc:
            if not _is_locked(exc):
                raise
        _lock_notice(sqlite_path, purpose)
        cur.execute(f"PRAGMA busy_timeout = {int(max(0.0, LOCK_WAIT_S - LOCK_NOTICE_S) * 1000)}")
        cur.execute(statement)
    except sqlite3.OperationalError as exc:  # wrapped as SQLAlchemy would, for translate_errors
        raise sa.exc.OperationalError(statement, None, exc) from None
    except sqlite3.DatabaseError as exc:
        raise sa.exc.DatabaseError(statement, None, exc) from None
    finally:
        try:
            cur.execute(f"PRAGMA busy_timeout = {int(LOCK_WAIT_S * 1000)}")
        finally:
            cur.close()


def create_engine(u: URL, sqlite_path: Path | None) -> Engine:
    """An engine with the transaction behaviour the ledger relies on."""
    backend = u.get_backend_name()
    if backend == "sqlite":
        kwargs: dict = {"connect_args": {"timeout": LOCK_WAIT_S}}
        if sqlite_path is None:
            kwargs["poolclass"] = sa.pool.StaticPool
            kwargs["connect_args"]["check_same_thread"] = False
        engine = sa.create_engine(u, **kwargs)

        @event.listens_for(engine, "connect")
        def _connect(dbapi_conn, _record):  # take transaction control away from pysqlite
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn):
            dbapi_conn = conn.connection.dbapi_connection
            if conn.get_execution_options().get("privtune_write"):
                # BEGIN IMMEDIATE takes the write lock now, so a busy file is waited for here
                _wait_for_lock(dbapi_conn, "BEGIN IMMEDIATE", sqlite_path, "record a change in it")
            else:
                conn.exec_driver_sql("BEGIN")
                # take the read lock now, so that a busy file is waited for (and announced) here
                try:
                    _wait_for_lock(dbapi_conn, "SELECT count(*) FROM sqlite_master", sqlite_path, "read it")
                except BaseException:
                    dbapi_conn.execute("ROLLBACK")
                    raise

        return engine
    try:
        # Lazy: optional psycopg, only for a PostgreSQL ledger.
        import psycopg  # noqa: F401
    except ImportError:
        raise LedgerError(
            "The PostgreSQL ledger needs psycopg 3, which is not installed. "
            "Install it with `pip install 'privtune[postgres]'` (or `pip install 'psycopg[binary]'`)."
        ) from None
    return sa.create_engine(u, pool_pre_ping=True, connect_args={"connect_timeout": 10})


def _describe(u: URL, sqlite_path: Path | None) -> str:
    if sqlite_path is not None:
        return f"SQLite ledger {str(sqlite_path)!r}"
    return f"ledger {mask_url(u)!r}"


@contextlib.contextmanager
def translate_errors(u: URL, sqlite_path: Path | None) -> Iterator[None]:
    """Turn database exceptions into LedgerError with a cause and a fix; never reset anything."""
    try:
        yield
    except sa.exc.IntegrityError as exc:
        raise LedgerError(
            f"The {_describe(u, sqlite_path)} refused a write that would break its consistency "
            f"(a concurrent process wrote the same record): {_short(exc)}. Run the command again."
        ) from None
    except sa.exc.DBAPIError as exc:
        msg = _short(exc)
        low = msg.lower()
        where = _describe(u, sqlite_path)
        if "file is not a database" in low or "malformed" in low or "not a database" in low:
            raise LedgerError(
                f"The {where} is corrupted or is not a privtune ledger ({msg}). privtune never resets a "
                "ledger: move the file aside (keep it, it holds your privacy history) or point "
                "--ledger / PRIVTUNE_LEDGER at the right file."
            ) from None
        if "readonly" in low or "read-only" in low:
            raise LedgerError(
                f"The {where} is read-only ({msg}); recording a spend needs write access to the file and its "
                "directory. Fix the permissions or point --ledger / PRIVTUNE_LEDGER at a writable location."
            ) from None
        if "unable to open database file" in low:
            raise LedgerError(
                f"Cannot open the {where} ({msg}): its directory is missing or not writable. Create the "
                "directory and check its permissions, or point --ledger / PRIVTUNE_LEDGER elsewhere."
            ) from None
        if "database is locked" in low:
            raise LedgerError(
                f"The {where} stayed locked by another process for {LOCK_WAIT_S:g} s ({msg}). Retry; if it "
                "persists, look for a hung privtune process or a program holding the file open (e.g. sqlite3)."
            ) from None
        if isinstance(exc, (sa.exc.OperationalError, sa.exc.InterfaceError)) and sqlite_path is None:
            raise LedgerError(
                f"Cannot use the {where}: {msg}. Check that the server is running and the URL "
                "(host, port, user, password, database) is right."
            ) from None
        raise LedgerError(f"The {where} failed: {msg}.") from None


def _short(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_sqlite_location(path: Path, default_location: bool) -> None:
    """Clear errors for a missing/unwritable directory or a path that is not a file."""
    if path.exists():
        if not path.is_file():
            raise LedgerError(
                f"The ledger path {str(path)!r} exists but is not a file. Point --ledger / PRIVTUNE_LEDGER at "
                "a file such as sqlite:////home/me/.privtune/ledger.db."
            )
        if not os.access(path, os.R_OK):
            raise LedgerError(f"The ledger file {str(path)!r} is not readable by this user. Fix its permissions.")
        return
    parent = path.parent
    if not parent.exists():
        if default_location:
            try:  # it will hold the ledger and its secret key: private to the user, whatever the umask
                parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(parent, 0o700)
            except OSError as exc:
                raise LedgerError(
                    f"Cannot create the ledger directory {str(parent)!r}: {exc.strerror or exc}. Set "
                    "PRIVTUNE_LEDGER to a writable location, e.g. sqlite:////tmp/ledger.db."
                ) from None
        else:
            raise LedgerError(
                f"The ledger directory {str(parent)!r} does not exist. Create it (mkdir -p {parent}) or point "
                "--ledger / PRIVTUNE_LEDGER at an existing directory."
            )
    if not parent.is_dir():
        raise LedgerError(f"The ledger's parent {str(parent)!r} is not a directory. Choose another ledger path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LedgerError(
            f"The ledger directory {str(parent)!r} is not writable, so the ledger file cannot be created. "
            "Fix the directory's permissions or point --ledger / PRIVTUNE_LEDGER at a writable location."
        )


def write_connection(engine: Engine) -> contextlib.AbstractContextManager[Connection]:
    """A connection whose transactions begin with the write lock (SQLite: BEGIN IMMEDIATE)."""

    @contextlib.contextmanager
    def _cm() -> Iterator[Connection]:
        with engine.connect() as conn:
            conn.execution_options(privtune_write=True)
            with conn.begin():
                yield conn

    return _cm()


def read_connection(engine: Engine) -> contextlib.AbstractContextManager[Connection]:
    """A connection with one read transaction (a consistent snapshot on both backends)."""

    @contextlib.contextmanager
    def _cm() -> Iterator[Connection]:
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn

    return _cm()


def pg_advisory_lock(conn: Connection, key: int) -> None:
    """Transaction-scoped advisory lock (PostgreSQL only; SQLite's BEGIN IMMEDIATE already serialises)."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})


def read_meta(conn: Connection) -> dict[str, str]:
    """The ledger's meta table as a dict."""
    return dict(conn.execute(sa.select(meta_table.c.key, meta_table.c.value)).all())


def schema_state(conn: Connection, where: str) -> str:
    """'ok', 'legacy' (schema 1: migrate it), 'empty' (create it), or LedgerError for a
    foreign/damaged/newer database."""
    return _schema_state(conn, where)


def _schema_state(conn: Connection, where: str) -> str:
    names = set(sa.inspect(conn).get_table_names())
    if "privtune_meta" in names:
        rows = dict(conn.execute(sa.select(meta_table.c.key, meta_table.c.value)).all())
        if rows.get("application") != APPLICATION:
            raise LedgerError(
                f"The {where} has a privtune_meta table that was not written by privtune "
                f"(application={rows.get('application')!r}). Refusing to use or reset it; point --ledger / "
                "PRIVTUNE_LEDGER at a privtune ledger."
            )
        try:
            version = int(rows.get("schema_version", "0"))
        except ValueError:
            version = -1
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"The {where} has schema version {version}, newer than this privtune understands "
                f"({SCHEMA_VERSION}). Upgrade privtune: pip install -U privtune."
            )
        if version not in (SCHEMA_VERSION, LEGACY_SCHEMA_VERSION):
            raise LedgerError(f"The {where} has an unknown schema version {rows.get('schema_version')!r}.")
        missing = _TABLES - names
        if missing:
            raise LedgerError(
                f"The {where} is damaged: tables {sorted(missing)} are missing. privtune will not recreate "
                "them over a ledger that held privacy history; restore the database from a backup."
            )
        return "ok" if version == SCHEMA_VERSION else "legacy"
    ours = names & _TABLES
    if ours:
        raise LedgerError(
            f"The {where} is damaged: it has {sorted(ours)} but no privtune_meta table. Restore it from a "
            "backup; privtune will not reset it."
        )
    if names and conn.dialect.name == "sqlite":
        raise LedgerError(
            f"The {where} is a SQLite database of another application (tables: {sorted(names)[:5]}). "
            "privtune will not write into it; point --ledger / PRIVTUNE_LEDGER at a new or privtune file."
        )
    return "empty"


def current_schema(engine: Engine, where: str) -> str:
    """'ok', 'legacy' or 'empty' (see :func:`schema_state`), in a read transaction."""
    with read_connection(engine) as conn:
        return _schema_state(conn, where)


def create_schema(engine: Engine, where: str, key_check: str) -> None:
    """Create the schema of an empty database (nothing when another process created it meanwhile)."""
    with write_connection(engine) as conn:
        pg_advisory_lock(conn, _PG_SCHEMA_LOCK)
        if _schema_state(conn, where) != "empty":  # created concurrently
            return
        metadata.create_all(conn)
        conn.execute(
            meta_table.insert(),
            [{"key": "application", "value": APPLICATION}, {"key": "schema_version", "value": str(SCHEMA_VERSION)},
             {"key": "key_check", "value": key_check}],
        )


def add_public_id_column(conn: Connection) -> None:
    """Schema 1 -> 2 DDL (inside the migration's write transaction; both SQLite and PostgreSQL)."""
    conn.execute(sa.text("ALTER TABLE privtune_datasets ADD COLUMN public_id VARCHAR(32)"))
    conn.execute(sa.text("CREATE UNIQUE INDEX ix_privtune_datasets_public_id ON privtune_datasets (public_id)"))


PG_SCHEMA_LOCK = _PG_SCHEMA_LOCK


PG_INIT_LOCK = _PG_INIT_LOCK
