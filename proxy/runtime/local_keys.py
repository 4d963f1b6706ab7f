"""What `serve` makes at start when the operator configured none, so the embedded default
serves every endpoint: the sealing key (reasoning_seal: /v1/responses/compact, sealed
reasoning), the dashboard's session secret (admin.session_secret), and a demo admin key.

Precedence, for each secret: the configuration (reasoning_seal.keys, admin.session_secret;
`${NAME}` reads the environment) always wins, then RESPONSES_PROXY_SEAL_KEY (the seal key
only), then the file kept beside the ledger, made at the first start:

    <folder of ledger.path>/seal.key             base64 of 32 random bytes (key id "local")
    <folder of ledger.path>/admin-session.key    signs dashboard sessions

Each file is created once, mode 0600 (written to a private temporary file, then linked into
place, so two processes starting at once keep one value), read again at every later start
and never printed. Every process of `serve --workers N` and every restart reads the same
file, so a dashboard session made on one process is valid on the others. Nothing is made
for a PostgreSQL ledger: its replicas run on several hosts, and a key made on one host
would not open what another sealed; configure the keys there (README "Scaling out").

The demo admin key is made only with the demo key (`make run`, `serve --demo-key`, or no
config file at all) and only when the configuration names no admin key: a fresh one at
every start, printed once with the dashboard's URL, as the demo API key is.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from proxy.config.cross_checks import SEAL_ENV, admin_prefix
from proxy.config.load import Config

SEAL_FILE = "seal.key"
SESSION_FILE = "admin-session.key"
SEAL_KEY_ID = "local"
DEMO_ADMIN_NAME = "demo"
DEMO_ADMIN_PREFIX = "rp-admin-"  # never sk-rp- (the client keys' prefix, refused by the admin API)


class LocalKeyError(Exception):
    """A file this module keeps is unusable (not one it would make): start-up stops, naming it."""


@dataclass
class LocalKeys:
    """What ensure() did: the folder it used, the demo admin key to print, and warnings."""

    folder: Path | None = None
    demo_admin_key: str | None = None
    made: list[str] = field(default_factory=list)  # the files made at this start
    warnings: list[str] = field(default_factory=list)
    session_shared: bool = False  # every process signs sessions with one secret


def state_folder(config: Config) -> Path | None:
    """The folder of the SQLite ledger (data/ by default), None for PostgreSQL or :memory:."""
    ledger = config.ledger
    if ledger.backend == "postgres":
        return None
    path = ledger.path
    if path == ":memory:":
        return None
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = (config.path.resolve().parent if config.path is not None else Path.cwd()) / p
    return p.parent


def check_private(path: Path, what: str) -> None:
    """`path` is ours alone to trust: owned by the user the proxy runs as and writable by nobody
    else (a state folder under /tmp, or a secret another user planted there, would let them
    choose the secret: a forged dashboard session). LocalKeyError naming the path otherwise."""
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise LocalKeyError(f"{path} ({what}) is owned by uid {st.st_uid}, not by the user the proxy runs as "
                            f"(uid {os.geteuid()}): refusing to trust it")
    if st.st_mode & 0o022:
        raise LocalKeyError(f"{path} ({what}) is writable by other users (mode {st.st_mode & 0o777:o}): "
                            f"make it private (chmod go-w {path}) or choose another ledger.path")


def check_state_folder(folder: Path) -> None:
    """The state folder (the ledger, its spool, the start-up secrets): made private when it is
    new, checked when it is not."""
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(folder, "the state folder")


def _read(path: Path) -> str:
    check_private(path, "a start-up secret")
    text = path.read_text().strip()
    if (path.stat().st_mode & 0o077) != 0:
        os.chmod(path, 0o600)  # readable by others: tightened, never left so
    return text


def read_or_make(path: Path, make) -> tuple[str, bool]:
    """The secret in `path`, made (mode 0600) when the file does not exist; (value, made)."""
    try:
        return _read(path), False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process got there first: its value is kept
        except FileExistsError:
            return _read(path), False
    finally:
        tmp.unlink(missing_ok=True)
    return value, True


def _new_seal_key() -> str:
    return base64.urlsafe_b64encode(os.urandom(32)).decode()


def _seal_configured(config: Config) -> bool:
    return any(value for value in config.reasoning_seal.keys.values()) or bool(os.environ.get(SEAL_ENV))


def _ensure_seal(config: Config, folder: Path, out: LocalKeys) -> None:
    path = folder / SEAL_FILE
    key, made = read_or_make(path, _new_seal_key)
    try:
        raw = base64.b64decode(key + "=" * (-len(key) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise LocalKeyError(f"{path} is not a sealing key (base64 of 32 bytes): remove it to make a new one "
                            "(what it sealed will no longer open)")
    config.update("reasoning_seal", keys={SEAL_KEY_ID: key}, active=SEAL_KEY_ID)
    if made:
        out.made.append(str(path))


def _ensure_session(config: Config, folder: Path, out: LocalKeys) -> None:
    path = folder / SESSION_FILE
    secret, made = read_or_make(path, lambda: secrets.token_urlsafe(32))
    if len(secret) < 16:
        raise LocalKeyError(f"{path} holds too short a session secret: remove it to make a new one")
    config.update("admin", session_secret=secret)
    out.session_shared = True
    if made:
        out.made.append(str(path))


def demo_admin_wanted(config: Config) -> bool:
    return config.auth.enabled and config.auth.demo_key and not config.admin.keys


def ensure(config: Config) -> LocalKeys:
    """Fill in, in `config`, what the operator left unset (see the module's docstring)."""
    out = LocalKeys(folder=state_folder(config))
    if demo_admin_wanted(config):
        out.demo_admin_key = DEMO_ADMIN_PREFIX + secrets.token_urlsafe(24)
        digest = hashlib.sha256(out.demo_admin_key.encode()).hexdigest()
        config.update("admin", keys=[{"name": DEMO_ADMIN_NAME, "sha256": digest}])
    want_session = bool(config.admin.keys or config.admin.oidc.issuer) and not config.admin.session_secret
    if config.admin.session_secret:
        out.session_shared = True
    if out.folder is None:
        return out
    check_state_folder(out.folder)
    try:
        if not _seal_configured(config):
            _ensure_seal(config, out.folder, out)
        if want_session:
            _ensure_session(config, out.folder, out)
    except OSError as exc:
        out.warnings.append(f"cannot keep start-up secrets in {out.folder}: {exc.strerror or exc}")
    return out


def dashboard_url(host: str, port: int, config: Config) -> str:
    prefix = admin_prefix(config.admin)
    shown = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}{prefix}/"


def announce_admin_key(config: Config, host: str, port: int) -> None:
    """The demo admin key, once, with the dashboard's URL (the one other secret ever printed)."""
    made = config.local_keys
    if made is not None and made.demo_admin_key:
        print(f"admin key: {made.demo_admin_key} (dashboard: {dashboard_url(host, port, config)})", flush=True)
