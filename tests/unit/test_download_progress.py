"""A state download shows its progress (issue 16, item 4): the download reports every verified
chunk, and TransferProgress draws it as plain lines off a terminal (a rich bar on one)."""

from __future__ import annotations

import asyncio
import io

from peer.progress import TransferProgress
from peer.state.download import download_state
from tests.unit.state_samples import CHUNK, RUN, SHAPES, sample_snapshot
from tests.unit.test_state_transfer import TIMEOUT, dies_after_one_chunk, honest, swarm


def download_with_progress(handlers: dict, snapshot):
    calls = []

    async def main():
        async with swarm(handlers) as open_stream:
            return await download_state(
                list(handlers),
                open_stream,
                digest=snapshot.digest,
                shapes=SHAPES,
                run_id=RUN,
                timeout=TIMEOUT,
                chunk_elements=CHUNK,
                on_progress=lambda *a: calls.append(a),
            )

    return asyncio.run(main()), calls


def test_every_verified_chunk_is_reported_once_up_to_the_total():
    snapshot = sample_snapshot()
    total = len(snapshot.chunks)
    result, calls = download_with_progress({n: honest(snapshot) for n in ("d0", "d1")}, snapshot)
    assert [c[0] for c in calls] == list(range(1, total + 1))  # chunks verified, one call each
    assert all(c[1] == total for c in calls)
    assert calls[-1][2] == sum(result.bytes_by_donor.values()) and calls[-1][3] == 2  # bytes read, donors


def test_a_failing_donor_and_a_failing_callback_do_not_stop_the_download():
    snapshot = sample_snapshot()
    calls = []

    def bad_callback(*args):
        calls.append(args)
        raise RuntimeError("a broken terminal")

    async def main():
        async with swarm({"d0": dies_after_one_chunk(snapshot), "d1": honest(snapshot)}) as open_stream:
            return await download_state(
                ["d0", "d1"],
                open_stream,
                digest=snapshot.digest,
                shapes=SHAPES,
                run_id=RUN,
                timeout=TIMEOUT,
                chunk_elements=CHUNK,
                on_progress=bad_callback,
            )

    result = asyncio.run(main())
    assert len(calls) == len(snapshot.chunks) and sum(result.chunks_by_donor.values()) == len(snapshot.chunks)


def test_plain_progress_lines_off_a_terminal():
    out = io.StringIO()
    bar = TransferProgress("the swarm's state", 8 << 20, stream=out, every_s=0.0)
    bar.update(2 << 20, detail="from 3 peer(s)")
    bar.update(8 << 20, detail="from 3 peer(s)")
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("downloading the swarm's state: 2.0 of 8.0 MiB (25 %) from 3 peer(s), ")
    assert lines[-1].startswith("downloading the swarm's state: 8.0 of 8.0 MiB (100 %)") and len(lines) == 3
    quiet = io.StringIO()
    bar = TransferProgress("x", 100, stream=quiet, every_s=3600.0)
    for done in range(0, 101, 10):
        bar.update(done)
    bar.close()
    assert len(quiet.getvalue().splitlines()) == 1  # at most one line per every_s, and the last
