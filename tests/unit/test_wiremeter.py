"""The kernel's count of a process tree's TCP traffic (peer/net/wiremeter.py), on real sockets: a
child process talks to this one over loopback, and only the child's side is the meter's."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from peer.net import wiremeter

OK, WHY = wiremeter.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"no socket counters here: {WHY}")

SENT, RECEIVED = 300_000, 70_000
CHILD = f"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sys.stdin.readline()  # the meter is made
s.sendall(b"x" * {SENT})
got = 0
while got < {RECEIVED}:
    got += len(s.recv(65536))
print("done", flush=True)
sys.stdin.read()  # the socket stays open until the test lets go
"""


def _talk(server: socket.socket) -> tuple[subprocess.Popen, socket.socket]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(server.getsockname()[1])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    conn, _ = server.accept()
    return child, conn


def _exchange(child: subprocess.Popen, conn: socket.socket) -> None:
    """Let the child send SENT bytes, answer RECEIVED, and wait until it read them."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    got = 0
    while got < SENT:
        got += len(conn.recv(65536))
    conn.sendall(b"y" * RECEIVED)
    assert child.stdout.readline() == "done\n"


def _end(child: subprocess.Popen, conn: socket.socket) -> None:
    conn.close()
    assert child.stdin is not None and child.stdout is not None
    child.stdin.close()
    child.wait(timeout=10)
    child.stdout.close()


def test_counts_the_tree_of_the_root_process_with_headers_and_nothing_else() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        child, conn = _talk(server)
        try:
            meter = wiremeter.WireMeter(child.pid, count_loopback=True)  # counts from now on
            plain = wiremeter.WireMeter(child.pid)  # loopback: not a line, not counted
            _exchange(child, conn)
            sent, received = meter.totals()
            # the child's bytes and a header for each segment; this process's side of the connection
            # (which received SENT) is not the meter's
            assert SENT <= sent <= SENT * 1.05 + 4096, sent
            assert RECEIVED <= received <= RECEIVED * 1.05 + 4096, received
            assert plain.totals() == (0, 0)
        finally:
            _end(child, conn)


def test_a_socket_gone_between_polls_keeps_what_was_counted() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        child, conn = _talk(server)
        meter = wiremeter.WireMeter(child.pid, count_loopback=True)
        _exchange(child, conn)
        counted = meter.totals()
        assert counted[0] >= SENT
        _end(child, conn)
        assert meter.totals() >= counted  # totals never go back when a socket closes
