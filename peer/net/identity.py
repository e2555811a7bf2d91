"""Persistent libp2p identities: a private key file that fixes a node's peer id.

The file holds a libp2p ``PrivateKey`` protobuf (the format p2pd reads with ``-id``), written
once with mode 0600 and reused on every start, so a node's multiaddr survives restarts.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from protocol.errors import ConfigError

logger = logging.getLogger(__name__)


def ensure_identity(path: str | Path) -> Path:
    """Create the key file at ``path`` if it does not exist; return the path.

    The file is created atomically (written to a temporary name, then renamed) with mode 0600,
    so a crash never leaves a half-written key behind.

    Raises:
        ConfigError: the directory cannot be created, or an existing file is unreadable or
            not a libp2p private key.
    """
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    path = Path(path).expanduser()
    if path.exists():
        try:
            key = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        except Exception as exc:
            raise ConfigError(
                f"identity file {path} is not a libp2p private key ({exc}); move it away to create a new identity"
            ) from exc
        if not key.data:
            raise ConfigError(f"identity file {path} is empty; delete it to create a new identity")
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            logger.warning("identity file %s has mode %o; others can read it (chmod 600)", path, mode)
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the directory for identity file {path}: {exc.strerror}") from exc
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    logger.info("created new identity %s", path)
    return path
