"""Shared test setup: offline Hugging Face, deterministic, small thread counts (CI has 2 cores), and one
PostgreSQL server per session for the ledger tests (``pg_server``/``pg_url``: skipped where no server binary
exists, failing under ``CI=true``); ``script_module`` imports a bench or scripts/ file as a module."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import contextlib  # noqa: E402
import glob  # noqa: E402
import importlib.util  # noqa: E402
import pwd  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@contextlib.contextmanager
def script_module(path: Path, name: str):
    """The script at ``path`` (bench/, scripts/) imported as module ``name`` while the block runs: registered in
    ``sys.modules`` (dataclasses look their module up while the file runs), removed after."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def _isolated_ledger(tmp_path, monkeypatch):
    """Never touch the user's real ~/.privtune ledger from a test."""
    monkeypatch.setenv("PRIVTUNE_LEDGER", f"sqlite:///{tmp_path / 'ledger.db'}")
    monkeypatch.setenv("PRIVTUNE_HOME", str(tmp_path / "privtune_home"))
    yield


#: where a test that forgets its tmp_path would write: `tune` without output_dir makes runs/<timestamp>/ in the
#: working directory; the suite runs from the repository root
_STRAY_RUN_DIRS = tuple({Path.cwd() / "runs", Path(__file__).resolve().parents[1] / "runs"})


@pytest.fixture(autouse=True)
def _no_stray_run_directory():
    """Fail the test that creates runs/ in the repository (or wherever pytest was started): a test writes only
    under its tmp_path (pass output_dir, or monkeypatch.chdir(tmp_path))."""
    before = {p: p.exists() for p in _STRAY_RUN_DIRS}
    yield
    made = [str(p) for p, existed in before.items() if not existed and p.exists()]
    if made:
        pytest.fail(f"this test created {made}; write under tmp_path (output_dir=..., or monkeypatch.chdir(tmp_path))",
                    pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    torch.set_num_threads(1)
    yield


# --------------------------------------------------------------------------- PostgreSQL server


def _pg_bindir() -> Path | None:
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True):
        return Path(cand).parent
    return None


def _unavailable(reason: str):
    """Skip with ``reason`` on a developer machine; fail in CI (``CI=true``), which must have a server."""
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(f"CI=true but the PostgreSQL ledger tests cannot run: {reason}. CI must test the "
                    "PostgreSQL backend against a real server: make `.ci/run` install it "
                    "(`apt-get install postgresql`).", pytrace=False)
    pytest.skip(reason)


def _run_as() -> tuple[list[str], int | None, int | None]:
    """Prefix to run server commands as a non-root user (postgres refuses root)."""
    if os.geteuid() != 0:
        return [], None, None
    for user in ("postgres", "nobody"):
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            continue
        if shutil.which("runuser"):
            return ["runuser", "-u", user, "--"], pw.pw_uid, pw.pw_gid
        return ["su", "-s", "/bin/sh", user, "-c"], pw.pw_uid, pw.pw_gid  # pragma: no cover
    _unavailable("running as root and no 'postgres' or 'nobody' user exists to run a PostgreSQL server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def pg_server():
    bindir = _pg_bindir()
    if bindir is None:
        _unavailable("PostgreSQL server binaries (initdb, pg_ctl) not found; on Debian install the "
                     "`postgresql` package to run the PostgreSQL ledger tests")
    prefix, uid, gid = _run_as()
    base = Path(tempfile.mkdtemp(prefix="privtune-pg-"))
    if uid is not None:
        os.chown(base, uid, gid)
    data, log, port = base / "data", base / "server.log", _free_port()

    def run(args: list[str]) -> subprocess.CompletedProcess:
        if prefix and prefix[0] == "su":  # pragma: no cover
            import shlex

            return subprocess.run(prefix + [" ".join(shlex.quote(a) for a in args)],
                                  capture_output=True, text=True, timeout=120)
        return subprocess.run(prefix + args, capture_output=True, text=True, timeout=120)

    r = run([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync",
             "-E", "UTF8", "--locale=C"])
    assert r.returncode == 0, f"initdb failed: {r.stderr}"
    opts = f"-F -p {port} -k {base} -c listen_addresses='' -c max_connections=60"
    r = run([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "-o", opts, "start"])
    assert r.returncode == 0, f"pg_ctl start failed: {r.stderr} {log.read_text() if log.exists() else ''}"
    try:
        yield {"host": str(base), "port": port}
    finally:
        run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"])
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server):
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(host=pg_server["host"], port=pg_server["port"], user="postgres", dbname="postgres",
                         autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    return f"postgresql://postgres@/{name}?host={pg_server['host']}&port={pg_server['port']}"
