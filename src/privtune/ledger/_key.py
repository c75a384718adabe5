"""The ledger's secret key: keyed dataset fingerprints and a keyed hash chain.

Every ledger has a 256-bit secret key, created with the ledger and never written into a run
directory.  It is used for three things, each with its own domain-separation prefix:

* the **dataset fingerprint** the ledger stores: ``HMAC-SHA256(key, prefix || SHA-256(content))``.
  Without the key, a ledger row (or anything derived from it) cannot be matched against a
  candidate dataset, so "the data minus one row plus a guess" cannot be confirmed from it;
* every **record's MAC** in a dataset's hash chain (replaces the public SHA-256 of v1 ledgers);
* the dataset row's **head MAC**, which binds the position and MAC of the chain's last record,
  so that deleting the last records and moving the head back needs the key.

Where the key lives (:func:`key_path`):

* ``$PRIVTUNE_LEDGER_KEY_FILE`` when set (any backend), e.g. to keep the key on another disk
  than the database, so that a stolen or shared database copy is useless to a forger;
* SQLite: the file ``<ledger file>.key`` beside the database (``ledger.db.key``);
* PostgreSQL: ``$PRIVTUNE_HOME/ledger-keys/<database>-<hash of host:port/database>.key``.  Everyone who
  uses a team ledger needs the same key file: the first command against an empty database
  creates it; copy it to your colleagues over a secure channel.

The file is created with mode 0600 (whatever the umask) in a directory that exists or is
created 0700, written completely before it is linked into place, so that two processes that
create a ledger at once end up with the same key.  It holds 64 hexadecimal digits and a
newline.  The ledger stores ``HMAC(key, "key-check")`` in its meta table, so a wrong key file is
a clear error, never a silent fresh budget.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import shlex
import stat
import warnings
from pathlib import Path

from privtune.errors import LedgerError, PrivtuneWarning
from privtune.ledger._backend import privtune_home

KEY_ENV = "PRIVTUNE_LEDGER_KEY_FILE"
_KEY_BYTES = 32
_KEY_TEXT = re.compile(r"[0-9a-f]{64}")
_PREFIX = b"privtune-ledger/v2/"


def _mac(key: bytes, purpose: str, message: bytes) -> str:
    return hmac.new(key, _PREFIX + purpose.encode() + b"\0" + message, hashlib.sha256).hexdigest()


def keyed_fingerprint(key: bytes, content_sha256_hex: str) -> str:
    """The ledger's fingerprint of a dataset whose canonical content has SHA-256 ``content_sha256_hex``.

    HMAC over the content digest (not over the bytes again) so that a v1 ledger, which stored the
    digest, is re-keyed without the data; SHA-256 being collision resistant, this identifies the
    content exactly as an HMAC of the bytes would."""
    return _mac(key, "dataset", bytes.fromhex(content_sha256_hex))


def record_mac(key: bytes, canonical_record: str) -> str:
    """MAC of one chain record (its canonical JSON, which includes the previous record's MAC)."""
    return _mac(key, "record", canonical_record.encode())


def genesis_mac(key: bytes, fingerprint: str) -> str:
    """The ``prev_hash`` of a dataset's first record."""
    return _mac(key, "genesis", fingerprint.encode())


def head_mac(key: bytes, fingerprint: str, seq: int, record_hash: str) -> str:
    """What the dataset row stores as ``head_hash``: binds the last record's position and MAC."""
    return _mac(key, "head", f"{fingerprint}:{int(seq)}:{record_hash}".encode())


def key_check(key: bytes) -> str:
    """Stored in the ledger's meta table to recognise the right key file."""
    return _mac(key, "key-check", b"")


def demo_key_path(ledger_file: Path) -> Path:
    """Key file of a ledger kept inside a run directory (the embedded demo): under $PRIVTUNE_HOME,
    named after the ledger file's location, so that the key is never written into the run directory."""
    tag = hashlib.sha256(str(Path(ledger_file).resolve()).encode()).hexdigest()[:16]  # of a path, not of data
    return privtune_home() / "demo-ledger-keys" / f"{tag}.key"


def key_path(sqlite_path: Path | None, url_text: str, database: str | None) -> Path | None:
    """Where this ledger's key file is (``None``: an in-memory ledger, whose key lives in memory).

    ``url_text``: for PostgreSQL, the server and database only (``host:port/database``, no user), so
    that every member of a team finds the key under the same name."""
    env = os.environ.get(KEY_ENV)
    if env and env.strip():
        return Path(env.strip()).expanduser()
    if sqlite_path is not None:
        return sqlite_path.with_name(sqlite_path.name + ".key")
    if url_text.startswith("sqlite"):
        return None

    label = re.sub(r"[^A-Za-z0-9_.-]", "_", database or "ledger")[:40]
    tag = hashlib.sha256(url_text.encode()).hexdigest()[:12]  # of the server's address, not of data
    return privtune_home() / "ledger-keys" / f"{label}-{tag}.key"


def read_key(path: Path) -> bytes | None:
    """The key in ``path``, or ``None`` when the file does not exist."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise LedgerError(
            f"Cannot read the ledger key file {str(path)!r}: {getattr(exc, 'strerror', None) or exc}. Fix its "
            "permissions (it should be readable by you only, mode 0600)."
        ) from None
    if not _KEY_TEXT.fullmatch(text):
        raise LedgerError(
            f"The ledger key file {str(path)!r} does not hold a privtune ledger key (64 hexadecimal digits). "
            "Restore it from your backup, or point $PRIVTUNE_LEDGER_KEY_FILE at the right file."
        )
    _warn_if_others_can_read(path)
    return bytes.fromhex(text)


def _warn_if_others_can_read(path: Path) -> None:
    """Warn (once per file) when group or others have any access to the key file: whoever can read it can
    forge the ledger's records consistently and match its fingerprints against candidate datasets."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return
    if os.name != "posix" or not mode & 0o077 or path in _warned:
        return
    _warned.add(path)
    warnings.warn(
        f"the ledger key file {str(path)!r} is accessible to other users (mode {mode:04o}); whoever can read it "
        f"can rewrite the ledger undetected. Restrict it: chmod 600 {shlex.quote(str(path))}",
        PrivtuneWarning, stacklevel=2)


_warned: set[Path] = set()


def create_key(path: Path) -> bytes:
    """Create a new key file (mode 0600) at ``path``, or return the key another process created first."""
    parent = path.parent
    if not parent.exists():
        try:
            parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(parent, 0o700)  # mkdir's mode is reduced by the umask
        except OSError as exc:
            raise LedgerError(
                f"Cannot create the directory {str(parent)!r} for the ledger key: {exc.strerror or exc}. Create "
                f"it (mode 0700) or set ${KEY_ENV} to a writable location."
            ) from None
    key = secrets.token_bytes(_KEY_BYTES)
    tmp = parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, key.hex().encode("ascii") + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and fails if a concurrent process linked its key first
        except FileExistsError:
            pass
    except OSError as exc:
        raise LedgerError(
            f"Cannot create the ledger key file {str(path)!r}: {exc.strerror or exc}. Make its directory "
            f"writable or set ${KEY_ENV} to a writable location."
        ) from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    existing = read_key(path)
    if existing is None:  # pragma: no cover - deleted between link and read
        raise LedgerError(f"The ledger key file {str(path)!r} vanished while it was created. Run the command again.")
    return existing


def missing_key_error(path: Path, where: str) -> LedgerError:
    return LedgerError(
        f"The {where} is keyed, but its key file {str(path)!r} does not exist. The key is needed to find datasets "
        "and to verify and extend the hash chains; privtune never creates a new key for an existing ledger. "
        f"Restore the key file from your backup (or copy it from the colleague who created the ledger), or set "
        f"${KEY_ENV} to where it is."
    )


def wrong_key_error(path: Path | None, where: str) -> LedgerError:
    return LedgerError(
        f"The ledger key {str(path) if path else '(in memory)'!r} does not belong to the {where} (its key check "
        f"differs). Using it would treat every dataset as new. Restore the right key file, or set ${KEY_ENV} to it."
    )
