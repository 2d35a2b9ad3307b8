"""CurveZMQ key pairs without zmq: X25519 from ``cryptography`` and a Z85 encoder.

CurveZMQ keys are raw 32-byte Curve25519 keys written as 40 characters of Z85
(ZeroMQ RFC 32), which is what ``zmq.curve_keypair()`` returns.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

Z85_ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
_Z85_INDEX = {char: i for i, char in enumerate(Z85_ALPHABET)}


def z85_encode(data: bytes) -> str:
    """Encode ``data`` (length a multiple of 4) as Z85 text (5 chars per 4 bytes)."""
    if len(data) % 4:
        raise ValueError(f"Z85 encodes whole 4-byte frames; got {len(data)} bytes, pad to 4")
    out: list[str] = []
    for offset in range(0, len(data), 4):
        value = int.from_bytes(data[offset : offset + 4], "big")
        chunk = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            chunk.append(Z85_ALPHABET[digit])
        out.extend(reversed(chunk))
    return "".join(out)


def z85_decode(text: str) -> bytes:
    """Decode Z85 text (length a multiple of 5) back into bytes."""
    if len(text) % 5:
        raise ValueError(f"Z85 text comes in 5-char frames; got {len(text)} chars")
    out = bytearray()
    for offset in range(0, len(text), 5):
        value = 0
        for char in text[offset : offset + 5]:
            try:
                value = value * 85 + _Z85_INDEX[char]
            except KeyError:
                raise ValueError(f"{char!r} is not a Z85 character") from None
        if value >= 2**32:
            raise ValueError(f"Z85 frame {text[offset : offset + 5]!r} overflows 32 bits")
        out += value.to_bytes(4, "big")
    return bytes(out)


def curve_keypair() -> tuple[str, str]:
    """Generate a fresh CurveZMQ key pair as ``(public_z85, secret_z85)``."""
    private = X25519PrivateKey.generate()
    secret = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return z85_encode(public), z85_encode(secret)


def public_from_secret(secret_z85: str) -> str:
    """The Z85 public key that belongs to a Z85 secret key."""
    private = X25519PrivateKey.from_private_bytes(z85_decode(secret_z85))
    return z85_encode(private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
