"""CurveZMQ for the fan-out: the pool's shared keypair and a ZAP handler that
accepts only that public key (docs/contracts.md section 4).

Every agent of a pool holds the same keypair. Fan-out servers (followers' bound
sockets) are Curve servers with that secret key; clients (leaders) present the
same keypair and the server's public key. The ZAP handler admits a client only
when the public key it proves it owns is the pool's, so a process without the
secret key cannot complete the handshake and nothing it sends is ever read.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from node_agent.contract import files

log = logging.getLogger(__name__)

PUBLIC_FILE = files.CURVE_PUBLIC_KEY
SECRET_FILE = files.CURVE_SECRET_KEY
ENV_PUBLIC = files.ENV_CURVE_PUBLIC_KEY
ENV_SECRET = files.ENV_CURVE_SECRET_KEY


class CurveKeyError(ValueError):
    """The pool's Curve keys are missing or not valid Z85."""


@dataclass(frozen=True)
class CurveKeys:
    """The pool's keypair as Z85 text (40 ASCII characters each)."""

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        for name, key in (("public", self.public), ("secret", self.secret)):
            if len(key) != 40:
                raise CurveKeyError(
                    f"Curve {name} key must be 40 Z85 characters, got {len(key)}; "
                    "generate a pair with zmq.curve_keypair()"
                )
            try:
                zmq.utils.z85.decode(key)
            except (ValueError, KeyError, TypeError) as exc:
                raise CurveKeyError(f"Curve {name} key is not valid Z85: {exc}") from None
        if zmq.curve_public(self.secret) != self.public:
            raise CurveKeyError(
                "Curve public key does not belong to the secret key; "
                "write both files from the same keypair"
            )

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh keypair (the operator creates the pool's once)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, key_dir: str | os.PathLike[str] | None = None) -> CurveKeys:
        """Keys from ``key_dir`` (curve-public.key, curve-secret.key) when both
        files exist, else from FLEXKV_CURVE_PUBLIC_KEY / FLEXKV_CURVE_SECRET_KEY."""
        if key_dir is not None:
            d = Path(key_dir)
            pub, sec = d / PUBLIC_FILE, d / SECRET_FILE
            if pub.is_file() and sec.is_file():
                return cls(pub.read_bytes().strip(), sec.read_bytes().strip())
        env_pub, env_sec = os.environ.get(ENV_PUBLIC), os.environ.get(ENV_SECRET)
        if env_pub and env_sec:
            return cls(env_pub.strip().encode(), env_sec.strip().encode())
        raise CurveKeyError(
            f"No Curve keys: neither {key_dir}/{PUBLIC_FILE} and {SECRET_FILE} nor "
            f"{ENV_PUBLIC} / {ENV_SECRET} are set; mount the pool's <pool>-curve Secret"
        )

    def write(self, key_dir: str | os.PathLike[str]) -> None:
        """Write both files (mode 0600 for the secret) into ``key_dir``."""
        d = Path(key_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / PUBLIC_FILE).write_bytes(self.public)
        sec = d / SECRET_FILE
        sec.write_bytes(self.secret)
        sec.chmod(0o600)


def make_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Turn ``sock`` (before bind) into a Curve server with the pool's keys."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Turn ``sock`` (before connect) into a Curve client of a pool server."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


class PoolAuthenticator:
    """One ZAP handler per context that admits only the pool's public key.

    ``start`` is idempotent and shared by every server socket of the context;
    rejected handshakes are logged (no message from such a peer is ever read,
    so there is nothing else to count).
    """

    _lock = threading.Lock()

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> None:
        self._ctx = ctx
        self._keys = keys
        self._auth: ThreadAuthenticator | None = None

    def start(self) -> None:
        """Start the handler thread (idempotent)."""
        with self._lock:
            if self._auth is not None:
                return
            auth = ThreadAuthenticator(self._ctx, log=log.getChild("zap"))
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=_OnlyKey(self._keys))
            self._auth = auth

    def stop(self) -> None:
        """Stop the handler thread (idempotent)."""
        with self._lock:
            if self._auth is not None:
                self._auth.stop()
                self._auth = None


class _OnlyKey:
    """Credentials provider: the client key must equal the pool's public key."""

    def __init__(self, keys: CurveKeys) -> None:
        self._z85 = keys.public

    def callback(self, domain: str, key: bytes) -> bool:
        """``key`` is the client's proven public key, Z85-encoded by pyzmq."""
        ok = key == self._z85
        if not ok:
            log.warning("Rejected a fan-out client with a foreign Curve key",
                        extra={"domain": domain})
        return ok
