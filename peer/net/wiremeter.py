"""What a peer's processes send and receive on the network, as the kernel counts it: the TCP
sockets of this process and its descendants (the DHT and averager processes, hivemind's p2pd
daemon, which carries every libp2p stream of the peer, and shard downloads over HTTP), read
through Linux's sock_diag netlink interface (the ``tcp_info`` that ``ss -ti`` shows), for the
traffic ledger of ``--max-gb-per-day`` (peer/net/traffic.py).

Counted per socket: the TCP payload sent (``tcpi_bytes_sent``, retransmissions included) and
received (``tcpi_bytes_received``), plus :data:`IPV4_HEADER_BYTES` (IPv6:
:data:`IPV6_HEADER_BYTES`) for every segment sent and received (``tcpi_segs_out``,
``tcpi_segs_in``: pure ACKs included): the IP bytes a metered line carries, libp2p's framing,
encryption and the DHT's RPCs all inside. Not counted: connections between loopback addresses
(no line carries them), UDP (QUIC, which p2pd does not use here), and the bytes a socket moved
between the last poll and its end (its counters go with it): :class:`WireMeter` is polled every
second and follows a closed socket while the kernel still reports it (FIN_WAIT, LAST_ACK).

Linux only (sock_diag, ``/proc``; the segment counts since 4.2, bytes sent with retransmissions since
4.6, bytes acknowledged before); :func:`available` says why not elsewhere, where the ledger counts
the paced streams instead (peer/net/pacing.py).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
ALL_STATES = 0xFFFFFFFF
IPV4_HEADER_BYTES = 52
"""IPv4 (20 B) and TCP (20 B, 12 B of timestamp option) headers of one segment."""
IPV6_HEADER_BYTES = 72
"""IPv6 (40 B) and TCP (32 B) headers of one segment."""
PROCESS_TREE_REFRESH_S = 5.0
"""How often the set of this peer's processes is read again from ``/proc`` (s)."""

# struct tcp_info (include/uapi/linux/tcp.h): offsets of the fields read here
_BYTES_ACKED, _BYTES_RECEIVED, _SEGS_OUT, _SEGS_IN, _BYTES_SENT = 120, 128, 136, 140, 200
_NLMSG = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBxI")  # family, protocol, ext, pad, states
_SOCKID = struct.Struct("=HH16s16sIQ")  # sport, dport (big-endian), src, dst, interface, cookie
_MSG_HEAD = struct.Struct("=BBBB")  # family, state, timer, retrans
_MSG_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode


@dataclass(frozen=True)
class SocketCount:
    """One TCP socket's counters (bytes and segments since it opened)."""

    key: tuple
    """(family, source address, source port, destination address, destination port)."""
    inode: int
    """0 once the process closed it (an orphan still closing)."""
    sent: int
    received: int
    segs_out: int
    segs_in: int
    loopback: bool

    def wire(self) -> tuple[int, int]:
        """(bytes sent, bytes received) with each segment's IP and TCP headers."""
        header = IPV4_HEADER_BYTES if self.key[0] == socket.AF_INET else IPV6_HEADER_BYTES
        return self.sent + header * self.segs_out, self.received + header * self.segs_in


def _request(family: int, seq: int) -> bytes:
    body = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), ALL_STATES)
    body += _SOCKID.pack(0, 0, b"", b"", 0, 0)
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def _parse(msg: bytes) -> SocketCount | None:
    family = msg[0]
    sport, dport, src, dst, _, _ = _SOCKID.unpack_from(msg, _MSG_HEAD.size)
    at = _MSG_HEAD.size + _SOCKID.size
    inode = _MSG_TAIL.unpack_from(msg, at)[4]
    at += _MSG_TAIL.size
    info = None
    while at + 4 <= len(msg):  # rtattrs: u16 length, u16 type, payload, aligned to 4
        length, kind = struct.unpack_from("=HH", msg, at)
        if length < 4:
            break
        if kind == INET_DIAG_INFO:
            info = msg[at + 4 : at + length]
        at += (length + 3) & ~3
    if info is None or len(info) < _SEGS_IN + 4:
        return None  # a listening or TIME_WAIT socket: no counters
    size = 4 if family == socket.AF_INET else 16
    a, b = ipaddress.ip_address(src[:size]), ipaddress.ip_address(dst[:size])
    acked, received = struct.unpack_from("=QQ", info, _BYTES_ACKED)
    segs_out, segs_in = struct.unpack_from("=II", info, _SEGS_OUT)
    sent = struct.unpack_from("=Q", info, _BYTES_SENT)[0] if len(info) >= _BYTES_SENT + 8 else acked
    return SocketCount(
        key=(family, str(a), socket.ntohs(sport), str(b), socket.ntohs(dport)),
        inode=inode,
        sent=sent,
        received=received,
        segs_out=segs_out,
        segs_in=segs_in,
        loopback=a.is_loopback and b.is_loopback,
    )


def tcp_sockets() -> list[SocketCount]:
    """Every TCP socket of this network namespace with counters (IPv4 and IPv6).

    Raises:
        OSError: sock_diag is not available (not Linux, or a kernel without it).
    """
    out: list[SocketCount] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            nl.send(_request(family, seq))
            done = False
            while not done:
                data = nl.recv(1 << 16)
                at = 0
                while at + _NLMSG.size <= len(data):
                    length, kind, _, _, _ = _NLMSG.unpack_from(data, at)
                    if length < _NLMSG.size:
                        break
                    if kind == NLMSG_DONE:
                        done = True
                    elif kind == NLMSG_ERROR:
                        errno = -struct.unpack_from("=i", data, at + _NLMSG.size)[0]
                        if errno:
                            raise OSError(errno, f"sock_diag dump failed: {os.strerror(errno)}")
                        done = True
                    elif kind == SOCK_DIAG_BY_FAMILY:
                        count = _parse(data[at + _NLMSG.size : at + length])
                        if count is not None:
                            out.append(count)
                    at += (length + 3) & ~3
                if not data:
                    break
    return out


def process_tree(root: int) -> set[int]:
    """``root`` and its live descendants (from ``/proc/*/stat``)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the name may hold spaces and parentheses
        parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {root}, [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


def socket_inodes(pids: set[int]) -> set[int]:
    """The socket inodes the processes ``pids`` hold open (those this user may read)."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    return inodes


def available() -> tuple[bool, str]:
    """(True, '') where :class:`WireMeter` can count, else (False, why)."""
    if not Path("/proc/self/fd").is_dir():
        return False, "no /proc (not Linux)"
    try:
        tcp_sockets()
    except (OSError, AttributeError) as exc:  # AttributeError: no AF_NETLINK on this platform
        return False, f"sock_diag netlink unavailable ({exc})"
    return True, ""


class WireMeter:
    """Cumulative (bytes sent, bytes received) of the TCP sockets of process ``root`` and its
    descendants, with IP and TCP headers (see the module's docstring), counted since this meter was
    made; :meth:`totals` polls. Poll at least every second or so (:meth:`start` runs a thread that
    does): what a socket moved between the last poll and its end is lost.

    Thread-safe. A socket open before the meter was made counts from then on.

    Args:
        root: the process whose tree is counted (default: this one).
        poll_s: the period of :meth:`start`'s thread, s.
        count_loopback: count connections between loopback addresses too (tests on one host).
    """

    def __init__(self, root: int | None = None, *, poll_s: float = 1.0, count_loopback: bool = False):
        self.root = os.getpid() if root is None else root
        self.poll_s, self.count_loopback = poll_s, count_loopback
        self._last: dict[tuple, tuple[int, int]] = {}
        """Socket key → its (sent, received) with headers at the last poll."""
        self._sent = self._received = 0
        self._pids: set[int] = set()
        self._pids_at = float("-inf")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.poll(baseline=True)

    def poll(self, *, baseline: bool = False) -> None:
        """Add what each socket of the process tree moved since the last poll (``baseline``: count
        nothing, only note where each socket stands)."""
        with self._lock:
            now = time.monotonic()
            if now - self._pids_at >= PROCESS_TREE_REFRESH_S:
                self._pids, self._pids_at = process_tree(self.root), now
            inodes = socket_inodes(self._pids)
            seen: dict[tuple, tuple[int, int]] = {}
            for s in tcp_sockets():
                # an orphan (inode 0) still closing counts when it was one of ours at the last poll
                ours = s.inode in inodes or (s.inode == 0 and s.key in self._last)
                if not ours or (s.loopback and not self.count_loopback):
                    continue
                seen[s.key] = s.wire()
                if not baseline:
                    before = self._last.get(s.key, (0, 0))
                    self._sent += max(0, seen[s.key][0] - before[0])
                    self._received += max(0, seen[s.key][1] - before[1])
            self._last = seen

    def totals(self) -> tuple[int, int]:
        """(bytes sent, bytes received) since this meter was made, polled now."""
        self.poll()
        with self._lock:
            return self._sent, self._received

    def start(self) -> WireMeter:
        """Poll every ``poll_s`` seconds in a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="wire-meter", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except OSError:  # a dump that failed once (memory pressure): the next poll counts it
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
