import stat

import pytest

from peer.net.identity import ensure_identity
from protocol.errors import ConfigError


def test_identity_created_private_and_reused(tmp_path):
    path = tmp_path / "sub" / "id.key"
    ensure_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_bytes()
    ensure_identity(path)
    assert path.read_bytes() == first


def test_garbage_identity_file_is_refused(tmp_path):
    path = tmp_path / "id.key"
    path.write_bytes(b"")
    with pytest.raises(ConfigError, match="id.key"):
        ensure_identity(path)
