"""A state download that fails because its donors left (a restarted peer's stale record, most
often) is one ``status`` line, not a warning; failing again in a row, or for any other reason
(bytes that do not check out), is a warning (peer/round/catchup.py, issue #53 "no spurious
warning")."""

from __future__ import annotations

import types

from peer.round.catchup import CatchUp
from protocol.errors import BadPayload, StateDownloadFailed


def peer(*errors: Exception) -> types.SimpleNamespace:
    """A stand-in for CatchUp's attributes whose every state download raises the next of ``errors``."""
    events: list[tuple[str, str]] = []
    queue = list(errors)

    def download_state(donors, digest, timeout_s):
        raise queue.pop(0)

    t = types.SimpleNamespace(
        state=types.SimpleNamespace(pos=types.SimpleNamespace(round=3)),
        transport=types.SimpleNamespace(download_state=download_state),
        cfg=types.SimpleNamespace(state_download_timeout_s=1.0),
        reporter=types.SimpleNamespace(emit=lambda event, **f: events.append((event, f["message"]))),
        failed_downloads=0,
        events=events,
    )
    t.resync_target = lambda: (4, "ab" * 16, ["QmDonor"])
    t.about_to_sync = lambda round_, donors: False
    return t


def test_a_download_its_donors_left_is_a_status_line_then_a_warning_when_it_repeats():
    gone = StateDownloadFailed("could not download state abab: 0 of 78 chunks verified", {"QmDonor": "closed"})
    t = peer(gone, gone, gone)
    assert not CatchUp.catch_up_once(t) and not CatchUp.catch_up_once(t) and not CatchUp.catch_up_once(t)
    kinds = [e for e, m in t.events if not m.startswith("downloading the state")]
    failures = [m for e, m in t.events if not m.startswith("downloading the state")]
    assert kinds == ["status", "warning", "warning"]
    assert failures[0].startswith("state download of round 4 failed, continuing from round 3: could not download")
    assert "failed 2 times in a row" in failures[1] and "failed 3 times in a row" in failures[2]
    assert [m for e, m in t.events if e == "status"][0].startswith("downloading the state of round 4 (abababab")


def test_a_state_that_does_not_check_out_is_a_warning_at_once():
    t = peer(BadPayload("chunk 3 hashes otherwise"))
    assert not CatchUp.catch_up_once(t)
    assert [e for e, m in t.events if not m.startswith("downloading")] == ["warning"]
    assert t.events[-1][1].endswith("continuing from round 3: chunk 3 hashes otherwise")
