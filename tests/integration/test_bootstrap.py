"""`bootstrap run`: persistent identity, printed multiaddrs, clean exit on SIGINT/SIGTERM."""

import signal
import stat

import pytest

from tests.integration.harness import make_manifest, write_manifest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_identity_persists_across_restarts(procs, tmp_path, stop_signal):
    run_file = write_manifest(tmp_path, make_manifest())
    first, addr1 = procs.bootstrap(run_file)
    key = tmp_path / "bootstrap.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    first.popen.send_signal(stop_signal)
    assert first.wait(30) == 130, first.tail()  # stopped by a signal

    second, addr2 = procs.bootstrap(run_file)
    assert addr1.split("/p2p/")[1] == addr2.split("/p2p/")[1]
    ready = second.of("ready")[0]
    assert ready["run_id"] == make_manifest().run_id
    assert all("/p2p/" in a for a in ready["maddrs"])


def test_an_ownerless_run_is_owned_by_the_key_beside_the_identity_and_keeps_its_run_id(procs, tmp_path):
    from peer.launch import bootstrap_argv
    from protocol.manifest import RunManifest
    from protocol.presets import tiny_run
    from protocol.signing import load_owner_key

    draft = tiny_run().replace(name="ownerless")
    assert not draft.owner
    run_file = write_manifest(tmp_path, draft)
    argv = bootstrap_argv(identity=tmp_path / "boot" / "identity.key", run=run_file)
    ids = []
    for attempt in range(2):
        boot = procs.spawn(f"boot-{attempt}", argv)
        ids.append(boot.wait_event(lambda e: e.kind == "ready", 60)["run_id"])
        boot.popen.send_signal(signal.SIGINT)
        assert boot.wait(30) == 130, boot.tail()
    key_path = tmp_path / "boot" / "owner.key"
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    owned = draft.with_owner(load_owner_key(key_path, create=False).public_hex)
    assert ids == [owned.run_id, owned.run_id] and isinstance(owned, RunManifest)


def test_a_port_in_use_exits_78_naming_the_port(tmp_path):
    # issue #68 item 7, as `peer join --port`: p2pd's failure to listen must not read as a network fault
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "bootstrap", "run", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--identity", str(tmp_path / "boot.key")]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 78, result.stderr
    assert f"--port {port}: TCP port {port} on 127.0.0.1 is in use" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
