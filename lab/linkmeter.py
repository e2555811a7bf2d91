"""What a lab host sends, as its own link counts it: samples of the bytes the root-side end of its veth
pair received (exactly what the host sent), and the busy stretches in them (a sync, a download); and
a peer's traffic ledger against the IP bytes its link carried both ways (:class:`LedgerWatch`).

Used by the cap tests (tests/chaos/test_upload_cap.py, test_day_cap.py) and bench/caps.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

SAMPLE_S = 0.1
BUSY_SHARE = 0.2
"""A sample is busy when it sent more than this share of the reference rate."""


def tx_bytes(veth_root: str) -> int:
    """Bytes the lab host behind ``veth_root`` has sent (the root-side end receives them)."""
    return int(Path(f"/sys/class/net/{veth_root}/statistics/rx_bytes").read_text())


class LinkMeter(threading.Thread):
    """Samples :func:`tx_bytes` every :data:`SAMPLE_S` until :meth:`stop`; ``samples`` holds
    (monotonic s, bytes sent so far)."""

    def __init__(self, veth_root: str):
        super().__init__(daemon=True)
        self.veth_root = veth_root
        self.samples: list[tuple[float, int]] = [(time.monotonic(), tx_bytes(veth_root))]
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self.samples.append((time.monotonic(), tx_bytes(self.veth_root)))

    def stop(self) -> None:
        self._done.set()
        self.join()


def busy_stretches(samples: list[tuple[float, int]], rate_bytes_per_s: float) -> list[tuple[float, int]]:
    """(seconds, bytes) of each stretch of samples that sent over :data:`BUSY_SHARE` of
    ``rate_bytes_per_s``, gaps under a second bridged; a stretch of one busy sample lasts one sample."""
    stretches: list[list[int]] = []  # [first sample index, last sample index]
    for i in range(1, len(samples)):
        (t0, b0), (t1, b1) = samples[i - 1], samples[i]
        if (b1 - b0) / (t1 - t0) > BUSY_SHARE * rate_bytes_per_s:
            if stretches and samples[i - 1][0] - samples[stretches[-1][1]][0] < 1.0:
                stretches[-1][1] = i
            else:
                stretches.append([i - 1, i])
    return [(samples[j][0] - samples[i][0], samples[j][1] - samples[i][1]) for i, j in stretches]


ETHERNET_HEADER_BYTES = 14


def ip_bytes(veth_root: str) -> int:
    """IP bytes the lab host behind ``veth_root`` sent and received so far (its link, both ways: the
    interface's bytes less the Ethernet header of each frame), what a metered line counts."""
    stats = Path(f"/sys/class/net/{veth_root}/statistics")
    total = sum(int((stats / name).read_text()) for name in ("rx_bytes", "tx_bytes"))
    frames = sum(int((stats / name).read_text()) for name in ("rx_packets", "tx_packets"))
    return total - ETHERNET_HEADER_BYTES * frames


def one_segment_a_frame(host) -> None:
    """Make ``host`` (a lab/netlab.py ``Host``) send each TCP segment as a frame of its own, with its
    own headers, as on a real line: by default a veth carries up to 64 KB of segments as one frame
    (segmentation offload). Call before its processes connect."""
    host.exec(["ip", "link", "set", host.veth_host, "gso_max_segs", "1"])


class LedgerWatch(threading.Thread):
    """Samples (bytes a peer's traffic ledger counted, :func:`ip_bytes` of its link) each time the
    ledger file (peer/net/traffic.py, ``DATA_DIR/traffic.json``) changes, into ``pairs``."""

    def __init__(self, ledger: Path, veth_root: str, sample_s: float = 0.02):
        super().__init__(daemon=True)
        self.ledger, self.veth_root, self.sample_s = Path(ledger), veth_root, sample_s
        self.pairs: list[tuple[int, int]] = []
        self._done = threading.Event()

    def run(self) -> None:
        last = None
        while not self._done.wait(self.sample_s):
            wire = ip_bytes(self.veth_root)
            try:
                bins = json.loads(self.ledger.read_text())["bins"]
            except (OSError, ValueError, KeyError):
                continue
            counted = sum(s + r for _, s, r in bins)
            if counted != last:
                self.pairs.append((counted, wire))
                last = counted

    def stop(self) -> None:
        self._done.set()
        self.join()

    def span(self) -> tuple[int, int]:
        """(bytes the ledger counted, IP bytes the link carried) from the ledger's first write seen
        to its last; (0, 0) with fewer than two writes."""
        if len(self.pairs) < 2:
            return 0, 0
        (c0, w0), (c1, w1) = self.pairs[0], self.pairs[-1]
        return c1 - c0, w1 - w0
