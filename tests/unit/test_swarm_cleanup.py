"""`peer swarm` leaves no dead hivemind socket behind (peer/swarm.py ``remove_stale_sockets``)."""

import os
import socket
import time

from peer.swarm import remove_stale_sockets


def test_dead_sockets_go_live_and_older_ones_stay(tmp_path):
    start = time.time() - 1.0
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / "hivemind-live.sock"))
    live.listen(1)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "hivemind-dead.sock"))
    dead.close()  # the file stays, nothing listens: what a killed process leaves
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.bind(str(tmp_path / "hivemind-old.sock"))
    old.close()
    os.utime(tmp_path / "hivemind-old.sock", (start - 3600, start - 3600))
    (tmp_path / "hivemind-file.sock").write_text("not a socket")
    try:
        assert remove_stale_sockets(start, str(tmp_path / "hivemind-*.sock")) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "hivemind-file.sock",
            "hivemind-live.sock",
            "hivemind-old.sock",
        ]
    finally:
        live.close()
