"""This peer's memory of misbehaving groupmates, kept in its run directory across restarts (issue #51).

Three rules leave a groupmate out for a number of rounds: the averager process's strikes (clipped or
dropped contributions, means it refused by a norm check: what this peer saw itself,
peer/sync/screening.py ``Strikes``), its distrust of equivocators proven by their own seals
(:data:`peer.sync.screening.EQUIVOCATOR_IGNORE_ROUNDS`, for good), and the proven equivocators the
host names in its gathered ``distrust`` list (peer/sync/pieces.py ``Suspects``; the owners it names
for others' refusals or alignments are not kept). Each entry runs out at a round of the run, so it means the same after a restart: two
small JSON files beside the run's checkpoint hold them, one per process that owns the state (no file
has two writers)::

    ignored-groupmates.json  {"version": 1, "ignored": {"12D3Koo…": 140}, "equivocators": {"Qm…": 1000139}}
    suspected-owners.json    {"version": 1, "suspects": {"Qm…": 219}}

each peer id (base58) → the first round it is no longer left out. A file is rewritten (temporary
file, fsync, rename) after a round that changed what it holds, and read when the peer starts.
Nothing in it is trusted blindly: an entry that is not a base58 id of at most
:data:`MAX_PEER_ID_CHARS` characters with a round in ``[0, MAX_ROUND]`` is dropped, at most
:data:`MAX_ENTRIES` per section are kept (those that run out last), and a file that is unreadable,
not such a JSON document or bigger than :data:`MAX_FILE_BYTES` is ignored with a warning (the
peer starts without that memory). Writes that fail are logged; neither failure stops the peer.

Strikes below the limit (a groupmate clipped once or twice in the last rounds) are not kept: a
restart forgets at most ``STRIKES_TO_IGNORE − 1`` strikes of the last few rounds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hivemind.p2p import PeerID

from peer.sync.pieces import SUSPECT_ROUNDS, Suspects
from peer.sync.screening import Strikes

logger = logging.getLogger(__name__)

GROUPMATES_FILE = "ignored-groupmates.json"
"""The averager process's file: sections ``ignored`` (strikes) and ``equivocators`` (distrust)."""
SUSPECTS_FILE = "suspected-owners.json"
"""The host's file: section ``suspects``."""
FORMAT_VERSION = 1
MAX_ENTRIES = 4096
"""Entries kept per section: those that run out last (the oldest are forgotten first)."""
MAX_PEER_ID_CHARS = 128
"""A libp2p peer id in base58 takes 46 (RSA keys' multihash) to 53 characters."""
MAX_ROUND = 2**62
"""Rounds beyond this are no rounds of a run (protocol/keys.py carries 20 bits of them)."""
MAX_FILE_BYTES = 4 * 1024 * 1024
"""A bigger file is not read (two full sections of long ids take under 1.5 MiB)."""
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


def _valid(peer: object, until: object) -> bool:
    return (
        isinstance(peer, str)
        and 0 < len(peer) <= MAX_PEER_ID_CHARS
        and _BASE58.issuperset(peer)
        and type(until) is int
        and 0 <= until <= MAX_ROUND
    )


def _latest(entries: Mapping[str, int]) -> dict[str, int]:
    """``entries`` cut to the :data:`MAX_ENTRIES` that run out last, in the order they run out."""
    return dict(sorted(entries.items(), key=lambda e: (e[1], e[0]))[-MAX_ENTRIES:])


class MemoryFile:
    """One JSON file of sections, each peer id (str) → the round its entry runs out.

    Args:
        path: the file; None keeps nothing (a peer without a run directory).
        sections: the names of its sections.
    """

    def __init__(self, path: Path | None, sections: tuple[str, ...]):
        self.path, self.sections = (None if path is None else Path(path)), sections
        self._saved: dict[str, dict[str, int]] | None = None  # what the file holds, as last read or written

    def load(self) -> dict[str, dict[str, int]]:
        """Every section's valid entries (empty ones when there is no file); never raises: a file
        that cannot be used is logged as a warning and counts as none."""
        empty: dict[str, dict[str, int]] = {name: {} for name in self.sections}
        if self.path is None or not self.path.exists():
            return empty
        try:
            size = self.path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise ValueError(f"{size:,} bytes, more than the {MAX_FILE_BYTES:,} read")
            doc = json.loads(self.path.read_bytes())
            if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"not a version {FORMAT_VERSION} document")
        except (OSError, ValueError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
            logger.warning("ignoring %s, starting without its memory of groupmates: %s", self.path, exc)
            return empty
        out, dropped = empty, 0
        for name in self.sections:
            section = doc.get(name, {})
            if not isinstance(section, dict):
                dropped += 1
                continue
            valid = {peer: until for peer, until in section.items() if _valid(peer, until)}
            dropped += len(section) - len(valid)
            out[name] = _latest(valid)
        if dropped:
            logger.warning("%s: dropped %d entries that are no peer id and round", self.path, dropped)
        self._saved = out
        return out

    def save(self, sections: Mapping[str, Mapping[Any, int]]) -> None:
        """Write ``sections`` (peer ids, written as ``str``) when they differ from what the file holds,
        atomically (temporary file, fsync, rename); a failure is logged, the previous file intact."""
        if self.path is None:
            return
        doc = {name: _latest({str(p): int(u) for p, u in sections.get(name, {}).items()}) for name in self.sections}
        if doc == self._saved:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"version": FORMAT_VERSION, **doc}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._saved = doc
        except OSError as exc:
            logger.warning("could not keep this peer's memory of groupmates in %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


class GroupmateMemory:
    """The averager process's memory (:data:`GROUPMATES_FILE`): its ``Strikes`` and its distrust.

    Args:
        path: the file; None keeps nothing.
        key: a peer id as the averager holds it (a hivemind ``PeerID``) from its base58 text.
    """

    def __init__(self, path: Path | None, *, key: Callable[[str], Any] = PeerID.from_base58):
        self.file, self.key = MemoryFile(path, ("ignored", "equivocators")), key

    def recall(self) -> tuple[Strikes, Strikes]:
        """New ``(strikes, distrust)`` that leave out again the groupmates the file holds, each until
        the round it names (the averager's rules: peer/sync/screening.py, peer/sync/receipts.py)."""
        strikes, distrust = Strikes(), Strikes()
        loaded = self.file.load()
        for name, rule in (("ignored", strikes), ("equivocators", distrust)):
            for peer, until in loaded[name].items():
                try:
                    rule.ignore(self.key(peer), until - 1, rounds=0)  # ignored at every round < until
                except ValueError as exc:
                    logger.warning("%s: dropped the entry %r: %s", self.file.path, peer, exc)
        return strikes, distrust

    def save(self, strikes: Strikes, distrust: Strikes) -> None:
        """Keep who ``strikes`` and ``distrust`` leave out, when that changed (never raises)."""
        self.file.save({"ignored": strikes.ignored_until(), "equivocators": distrust.ignored_until()})


class SuspectMemory:
    """The host's memory (:data:`SUSPECTS_FILE`): the owners its gathered ``distrust`` list names."""

    def __init__(self, path: Path | None):
        self.file = MemoryFile(path, ("suspects",))

    def restore(self, suspects: Suspects) -> None:
        """Name again the owners the file holds, each until the round it names."""
        for peer, until in self.file.load()["suspects"].items():  # in the order they run out
            suspects.add([peer], until - SUSPECT_ROUNDS, proven=[peer])  # only proven ones are kept

    def save(self, suspects: Suspects) -> None:
        """Keep the owners ``suspects`` names, when that changed (never raises)."""
        self.file.save({"suspects": suspects.named_until()})
