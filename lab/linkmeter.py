"""What a lab host sends, as its own link counts it: samples of the bytes the root-side end of its veth
pair received (exactly what the host sent), and the busy stretches in them (a sync, a download).

Used by the upload-cap test (tests/chaos/test_upload_cap.py) and bench/caps.py.
"""

from __future__ import annotations

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
