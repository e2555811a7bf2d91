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
