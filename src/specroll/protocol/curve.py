"""CURVE security for the trainer's endpoint (``network.security = "curve"``): the run's keys on
disk, the socket options, and the trainer's ZAP authenticator that admits only this run's clients.

ZeroMQ's CURVE mechanism (RFC 26, CurveZMQ: Curve25519 key agreement, every frame encrypted and
authenticated with libsodium's crypto_box) makes the trainer's ROUTER a CURVE server; each
generator and drafter trainer is a CURVE client that must know the server's public key. The ZAP
handler (RFC 27) the trainer runs on its context is pyzmq's :class:`~zmq.auth.asyncio.AsyncioAuthenticator`:
it admits a client only if its public key is one of the run's client keys, and names the key's
role kind (``generator`` or ``drafter``) as the connection's ``User-Id``, which the trainer reads
from every message (``zmq.Frame.get("User-Id")``) and compares with the ``Hello`` role.

The keys directory (``RUN_DIR/keys`` by default; ``specroll keys init``) holds ZeroMQ certificate
files written by :func:`zmq.auth.create_certificates`: ``server.key`` / ``server.key_secret`` and one
pair per role kind (``generator.key`` / ``generator.key_secret``, ``drafter.key`` /
``drafter.key_secret``). The folder is 0700 and every file 0600; a key file that others may read
(group or world permission bits) is refused, like ``ssh`` refuses such a private key. Each side
reads only the files it needs (:func:`files_for`): the trainer the server pair and the clients'
public keys; a generator the server's public key and its own pair.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
import zmq.auth.asyncio
from zmq.utils import z85

CLIENT_ROLES = ("generator", "drafter")
"""Role kinds with a client key pair: what a ``Hello`` from that key may say it is."""
SERVER = "server"
KEYS_DIRNAME = "keys"
"""``RUN_DIR/keys``: the launcher's keys directory when ``network.keys_dir`` is unset."""
ZAP_DOMAIN = "specroll"
"""The ZAP domain of the trainer's socket (enforced: with no handler, nothing connects)."""
MAX_LOGGED_REFUSALS = 64
"""Distinct refusals the trainer logs (each once); later ones are only counted."""

log = logging.getLogger("specroll.security")


class KeysError(ValueError):
    """A missing, unreadable, malformed or exposed key file, or a keys directory that cannot be made;
    the message names the file and what was expected."""


def public_file(name: str) -> str:
    return f"{name}.key"


def secret_file(name: str) -> str:
    return f"{name}.key_secret"


def files_for(role: str) -> tuple[str, ...]:
    """The key files a ``role`` (``trainer``, ``generator``, ``drafter``) reads from the keys directory.

    Raises:
        KeysError: an unknown role.
    """
    if role == "trainer":
        return (secret_file(SERVER), *(public_file(r) for r in CLIENT_ROLES))
    if role in CLIENT_ROLES:
        return (public_file(SERVER), secret_file(role))
    raise KeysError(f"role {role!r}: expected 'trainer' or one of {CLIENT_ROLES}")


def all_files() -> tuple[str, ...]:
    return tuple(f(name) for name in (SERVER, *CLIENT_ROLES) for f in (public_file, secret_file))


def init_keys(directory: str | Path) -> bool:
    """Make the run's keys in ``directory`` unless it holds them all already; returns whether it
    made them. The keys are written into a private temporary folder beside ``directory`` and renamed
    onto it, so the directory is whole or absent: folder 0700, files 0600.

    Raises:
        KeysError: ``directory`` exists but is not a complete keys directory (a file, an empty or
            partial folder: nothing is overwritten), or cannot be written.
    """
    directory = Path(directory)
    if directory.exists() or directory.is_symlink():
        if not directory.is_dir():
            raise KeysError(f"keys directory {directory} exists and is not a directory")
        _check_folder(directory)
        try:
            missing = [name for name in all_files() if not (directory / name).is_file()]
        except OSError as exc:
            raise KeysError(f"keys directory {directory}: cannot read it ({exc.strerror or exc})") from None
        if missing:
            raise KeysError(f"keys directory {directory} lacks {', '.join(missing)}; expected a complete keys "
                            "directory ('specroll keys init' makes one) or none (nothing is overwritten)")
        check_keys(directory)
        return False
    parent = directory.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{directory.name}.init-"))  # 0700
    except OSError as exc:
        raise KeysError(f"cannot make keys directory {directory}: {exc.strerror or exc}") from None
    try:
        for name in (SERVER, *CLIENT_ROLES):
            zmq.auth.create_certificates(tmp, name)
        for name in all_files():
            os.chmod(tmp / name, 0o600)  # created under the umask, but inside a 0700 folder until now
        os.replace(tmp, directory)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise KeysError(f"cannot make keys directory {directory}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def check_keys(directory: str | Path) -> None:
    """Check a whole keys directory: every file readable, private and well-formed, each public key
    file the same key as its secret file, and each secret key the secret of its public key.

    Raises:
        KeysError: the first problem, naming the file.
    """
    directory = Path(directory)
    _check_folder(directory)
    for name in (SERVER, *CLIENT_ROLES):
        public, _ = _read(directory, public_file(name), want_secret=False)
        pair_public, _ = _read(directory, secret_file(name), want_secret=True)
        if public != pair_public:
            raise KeysError(f"keys directory {directory}: {public_file(name)} is not the public key of "
                            f"{secret_file(name)} (files of two runs mixed?); expected one run's keys")
    ServerKeys.load(directory)  # two roles sharing a key


def _stat(path: Path, what: str, hint: str) -> os.stat_result:
    """``path.stat()``, or a KeysError naming ``what`` (``key file``, ``keys directory``)."""
    try:
        return path.stat()
    except FileNotFoundError:
        raise KeysError(f"{what} {path} not found; expected the run's keys ('specroll keys init RUN_DIR' makes "
                        f"them in RUN_DIR/{KEYS_DIRNAME}{hint})") from None
    except OSError as exc:
        raise KeysError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None


def _check_folder(directory: Path) -> None:
    """The keys directory is a directory only its owner may change (like ``ssh``'s ``~/.ssh``).

    Raises:
        KeysError: it is missing, not a directory, unreadable, or writable by group or others.
    """
    st = _stat(directory, "keys directory", "")
    if not stat.S_ISDIR(st.st_mode):
        raise KeysError(f"keys directory {directory} is not a directory; expected the folder of the run's keys")
    if st.st_mode & 0o022:
        raise KeysError(f"keys directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}: others may replace its "
                        f"keys; expected 0700 (chmod 700 {directory})")


def _read(directory: Path, name: str, want_secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) z85 keys of certificate file ``directory/name``.

    Raises:
        KeysError: the file is missing, unreadable, readable by others, or not a certificate
            (with a secret key when ``want_secret``).
    """
    path = directory / name
    st = _stat(path, "key file", f"; copy {name} there from the run's keys")
    if not stat.S_ISREG(st.st_mode):
        raise KeysError(f"key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise KeysError(f"key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may read it; expected 0600 "
                        f"(chmod 600 {path})")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise KeysError(f"key file {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError, IndexError) as exc:
        raise KeysError(f"key file {path}: not a ZeroMQ certificate ({exc})") from None
    for key in (public, secret) if want_secret else (public,):
        if key is None or len(key) != 40:
            what = "secret" if key is secret else "public"
            raise KeysError(f"key file {path}: no {what} key of 40 z85 characters; expected a file "
                            "'specroll keys init' wrote")
    if want_secret:
        try:
            derived = zmq.curve_public(secret)
        except (ValueError, zmq.ZMQError) as exc:
            raise KeysError(f"key file {path}: not a CURVE secret key ({exc})") from None
        if derived != public:
            raise KeysError(f"key file {path}: its public key is not the one of its secret key; expected a file "
                            "'specroll keys init' wrote")
    return public, secret


@dataclass(frozen=True)
class ServerKeys:
    """What the trainer needs: its key pair (z85, 40 bytes each) and the clients it admits."""

    public: bytes
    secret: bytes
    clients: Mapping[bytes, str] = field(default_factory=dict)
    """z85 public key → role kind (``generator``, ``drafter``)."""

    @classmethod
    def load(cls, directory: str | Path) -> ServerKeys:
        """Read the trainer's key files (:func:`files_for` ``("trainer")``).

        Raises:
            KeysError: a key file is missing, unreadable, exposed or malformed.
        """
        directory = Path(directory)
        _check_folder(directory)
        public, secret = _read(directory, secret_file(SERVER), want_secret=True)
        clients = {_read(directory, public_file(role), want_secret=False)[0]: role for role in CLIENT_ROLES}
        if len(clients) != len(CLIENT_ROLES):
            raise KeysError(f"keys directory {directory}: two roles share one public key; expected one pair per role")
        assert secret is not None
        return cls(public, secret, clients)


@dataclass(frozen=True)
class ClientKeys:
    """What a generator or drafter trainer needs: the server's public key and its own pair (z85)."""

    role: str
    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, directory: str | Path, role: str) -> ClientKeys:
        """Read the key files of ``role`` (:func:`files_for`).

        Raises:
            KeysError: an unknown role, or a key file missing, unreadable, exposed or malformed.
        """
        files_for(role)
        directory = Path(directory)
        _check_folder(directory)
        server_public, _ = _read(directory, public_file(SERVER), want_secret=False)
        public, secret = _read(directory, secret_file(role), want_secret=True)
        assert secret is not None
        return cls(role, server_public, public, secret)


def apply(sock: zmq.Socket, keys: ServerKeys | ClientKeys) -> None:  # type: ignore[type-arg]
    """Set ``sock``'s CURVE options (before it binds or connects): a server with the ZAP domain
    enforced (no handler running: every handshake fails), or a client of the server's public key."""
    if isinstance(keys, ServerKeys):
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


class RefusalLog:
    """Logs each distinct refusal once (a refused client retries its connection every 100 ms or
    so: one line per attempt would flood the log), at most :data:`MAX_LOGGED_REFUSALS` of them;
    :attr:`count` counts every refusal."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self.log = logger
        self.seen: set[str] = set()
        self.count = 0

    def handshake_failed(self, event: int, value: int, secured: bool) -> None:
        """A failed handshake the trainer's socket monitor reported (``EVENT_HANDSHAKE_FAILED_*``):
        a ZMTP protocol error ``value``, or a peer that hung up half-way (it found the mismatch first)."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.refused("handshake:hung-up", hung_up_refusal(secured))
        else:
            self.refused(f"handshake:{value}", handshake_refusal(value, secured))

    def summary(self) -> str | None:
        """The line to log when the trainer closes (None: nothing was refused)."""
        if not self.count:
            return None
        return f"refused {self.count} connection attempts and messages in all ({len(self.seen - {''})} kinds logged)"

    def refused(self, key: str, message: str) -> None:
        self.count += 1
        if key in self.seen:
            return
        if len(self.seen) < MAX_LOGGED_REFUSALS:
            self.seen.add(key)
            self.log.warning("%s (logged once)", message)
        elif len(self.seen) == MAX_LOGGED_REFUSALS:
            self.seen.add("")
            self.log.warning("%d distinct refusals logged; further ones are only counted", MAX_LOGGED_REFUSALS)


MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_CRYPTOGRAPHIC = 0x11000001  # ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC


def handshake_refusal(code: int, secured: bool) -> str:
    """What a failed ZMTP handshake on the trainer's socket means (the socket monitor's
    ``EVENT_HANDSHAKE_FAILED_*`` value ``code``: a ZMTP protocol error, or an errno), ``secured``:
    the trainer runs CURVE."""
    if code == MECHANISM_MISMATCH:
        if secured:
            return "refused a connection without CURVE security (a peer without this run's keys, or one with " \
                   "network.security = 'none')"
        return "refused a connection that asked for CURVE security: this trainer runs network.security = 'none'"
    if code == _CRYPTOGRAPHIC:
        return "refused a CURVE connection made for another server key (another run's keys, or a stale server.key)"
    return f"refused a connection: its handshake failed (ZMTP error {code:#x})"


def hung_up_refusal(secured: bool) -> str:
    """What a handshake on the trainer's socket that failed without detail (the peer hung up
    half-way) most likely means: the peer found the mismatch first."""
    other = "without CURVE, or with another run's server key" if secured else "that asked for CURVE security"
    return (f"a connection hung up during its handshake: most likely a peer {other} (network.security here is "
            f"{'curve' if secured else 'none'}), or one stopped while connecting")


class RunAuthenticator(zmq.auth.asyncio.AsyncioAuthenticator):
    """The trainer's ZAP handler: admits a CURVE client whose public key is one of the run's client
    keys and names its role kind as the connection's ``User-Id``; refuses (and logs once, through
    ``refusals``) every other key. Runs on the asyncio loop of the context's sockets.

    Start it before the server socket binds (:meth:`start`), stop it after the socket closes.
    """

    def __init__(self, context: zmq.Context, keys: ServerKeys, refusals: RefusalLog) -> None:  # type: ignore[type-arg]
        super().__init__(context, log=logging.getLogger("specroll.security.zap"))
        self.clients = dict(keys.clients)
        self.refusals = refusals
        self.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: ``key`` is the client's z85 public key."""
        if key in self.clients:
            return True
        shown = key.decode("ascii", "replace")
        self.refusals.refused(f"key:{shown}", f"refused a CURVE client with an unknown public key {shown[:8]}… "
                              "(not this run's generator or drafter key)")
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.clients[z85.encode(client_public_key)]
