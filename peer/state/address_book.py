"""The swarm a peer has seen, remembered in its data dir, so that a restart finds it again.

``<data-dir>/peers.json`` holds the full multiaddrs (``/ip4/HOST/tcp/PORT/p2p/PEER_ID``) of the
peers this peer has seen: the initial peers that answered it, and the addresses the other peers
of its run publish (peer/net/addresses.py)::

    {"version": 1, "addresses": [{"maddr": "/ip4/…/tcp/…/p2p/Qm…", "seen": 1700000000.0}, …]}

newest first, at most :data:`MAX_ENTRIES`, written atomically (temporary file, fsync, rename).
Nothing in it is trusted blindly: on load every entry is parsed and validated as a multiaddr
with a /p2p/ id, and bad entries are skipped and counted (a file that is not such a JSON
document, or is bigger than :data:`MAX_FILE_BYTES`, counts as one bad entry and is replaced at
the next save).

When none of the ``--initial-peers`` answer (BootstrapUnreachable), :func:`start_dht_remembering`
starts the DHT again with the remembered addresses as initial peers, so a peer restarted after
its bootstrap node died rejoins through any peer it saw before.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from peer.net import addresses as swarm_addresses, dht as swarm_dht
from peer.net.rejoin import reconnect
from protocol.errors import BadPeerAddress, BootstrapUnreachable
from protocol.signing import PeerSigner

logger = logging.getLogger(__name__)

FILE_NAME = "peers.json"
FORMAT_VERSION = 1
MAX_ENTRIES = 64
"""Addresses kept (the most recently seen); older ones are forgotten."""
MAX_FILE_BYTES = 256 * 1024
"""A bigger file is not read (64 entries of at most 512 characters take ~40 KiB)."""
RESAVE_AFTER_S = 600.0
"""A known address seen again is written back only when its saved ``seen`` is older than this."""


class AddressBook:
    """Remembered peer multiaddrs, newest first; thread-safe.

    Args:
        path: the JSON file (created at the first :meth:`save`).
        now: clock for ``seen`` times, s since the epoch.
    """

    def __init__(self, path: Path, *, now: Callable[[], float] = time.time):
        self.path, self._now = Path(path), now
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._dirty = False
        self.skipped = 0
        """Bad entries skipped by the last :meth:`load`."""

    @classmethod
    def load(cls, path: Path, *, now: Callable[[], float] = time.time) -> AddressBook:
        """Read ``path`` if it exists; bad entries are skipped, counted in ``skipped`` and logged once."""
        book = cls(path, now=now)
        try:
            if book.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"bigger than {MAX_FILE_BYTES} bytes")
            doc = json.loads(book.path.read_text(encoding="utf-8"))
            if (
                not isinstance(doc, dict)
                or doc.get("version") != FORMAT_VERSION
                or not isinstance(doc.get("addresses"), list)
            ):
                raise ValueError(f"not a version {FORMAT_VERSION} address book")
        except FileNotFoundError:
            return book
        except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            book.skipped = 1
            logger.warning("address book %s is unreadable (%s); starting with an empty one", path, exc)
            return book
        for entry in doc["addresses"]:
            try:
                if not isinstance(entry, dict):
                    raise BadPeerAddress(f"entry {entry!r:.80} is not a map")
                maddr, _ = swarm_addresses.check_peer_maddr(entry.get("maddr"))
                seen = entry.get("seen")
                if (
                    not isinstance(seen, (int, float))
                    or isinstance(seen, bool)
                    or not seen >= 0
                    or seen == float("inf")
                ):
                    raise BadPeerAddress(f"entry {maddr} has seen = {seen!r}: expected a time in s since the epoch")
            except BadPeerAddress as exc:
                book.skipped += 1
                logger.debug("address book %s: skipping a bad entry: %s", path, exc)
                continue
            book._seen[maddr] = max(book._seen.get(maddr, 0.0), float(seen))
        if book.skipped:
            logger.warning(
                "address book %s: skipped %d bad entr%s", path, book.skipped, "y" if book.skipped == 1 else "ies"
            )
        book._trim()
        return book

    def addresses(self, *, exclude_peer: str | None = None) -> list[str]:
        """Remembered multiaddrs, most recently seen first (``exclude_peer``'s own left out)."""
        with self._lock:
            ordered = sorted(self._seen.items(), key=lambda kv: (-kv[1], kv[0]))
        return [m for m, _ in ordered if exclude_peer is None or not m.endswith(f"/p2p/{exclude_peer}")]

    def add(self, maddrs: Iterable[str], *, exclude_peer: str | None = None) -> int:
        """Remember ``maddrs`` as seen now; invalid ones are skipped. Returns how many were new."""
        now, new = self._now(), 0
        with self._lock:
            for address in maddrs:
                try:
                    maddr, peer_id = swarm_addresses.check_peer_maddr(address)
                except BadPeerAddress as exc:
                    logger.debug("not remembering %s", exc)
                    continue
                if peer_id == exclude_peer:
                    continue
                new += maddr not in self._seen
                # A fresher "seen" alone is worth a write only now and then, not at every refresh.
                if now - self._seen.get(maddr, float("-inf")) > RESAVE_AFTER_S:
                    self._dirty = True
                self._seen[maddr] = now
            self._trim()
        return new

    def _trim(self) -> None:
        if len(self._seen) > MAX_ENTRIES:
            keep = sorted(self._seen.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_ENTRIES]
            self._seen = dict(keep)

    def save(self) -> None:
        """Write the book atomically (temporary file in the same directory, fsync, rename).

        Raises:
            OSError: the data dir is not writable; the previous file is intact.
        """
        with self._lock:
            doc = {
                "version": FORMAT_VERSION,
                "addresses": [
                    {"maddr": m, "seen": s} for m, s in sorted(self._seen.items(), key=lambda kv: (-kv[1], kv[0]))
                ],
            }
            self._dirty = False
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            if tmp.exists():
                tmp.unlink()

    def save_if_changed(self) -> None:
        """:meth:`save` when something was added since the last one; failures are logged, not raised."""
        if self._dirty:
            try:
                self.save()
            except OSError as exc:
                logger.warning("cannot write address book %s: %s", self.path, exc.strerror)


def start_dht_remembering(start: Callable[[list[str]], object], initial_peers: Sequence[str], book: AddressBook):
    """Start the DHT through ``initial_peers``, or through the remembered peers if none of those answer.

    Args:
        start: starts a DHT node with the given initial peers (e.g. ``peer.net.dht_node.start_dht``
            with this peer's other settings bound).
        initial_peers: the ``--initial-peers``; with none, this peer starts a new swarm and the book
            is not consulted.
        book: remembered addresses; the initial peers that answered are added to it and saved.

    Returns:
        The started DHT.

    Raises:
        BootstrapUnreachable: neither the initial peers nor any remembered address answered
            (both lists in the message).
        BadPeerAddress, NetworkError: as ``start`` raises them.
    """
    given = swarm_dht.parse_initial_peers(initial_peers)
    try:
        dht = start(given)
    except BootstrapUnreachable as exc:
        remembered = [m for m in book.addresses() if m not in given]
        if not given or not remembered:
            raise
        logger.warning(
            "none of the initial peers answered; trying %d remembered address(es) of peers seen before", len(remembered)
        )
        try:
            return start(remembered)
        except BootstrapUnreachable as again:
            raise BootstrapUnreachable(
                f"{exc}; none of the {len(remembered)} remembered peer address(es) in {book.path} answered either"
            ) from again
    book.add(given)
    book.save_if_changed()
    return dht


class AddressKeeper(swarm_dht.Periodic):
    """Publishes this peer's multiaddrs for its run and remembers the other peers', every ``period_s``.

    Args:
        dht: a started hivemind.DHT.
        book: where the other peers' addresses are remembered (saved when they change).
        run_id: this peer's run.
        signer: signs this peer's published addresses (protocol/signing.py); its peer id is this peer's.
        period_s: seconds between two rounds of publishing and reading.
        publish: False for a client-mode peer (nobody can dial it): it only reads.
    """

    def __init__(
        self, dht, book: AddressBook, *, run_id: str, signer: PeerSigner, period_s: float = 15.0, publish: bool = True
    ):
        super().__init__(period_s=period_s, name="address-keeper")
        self.dht, self.book, self.run_id, self.signer = dht, book, run_id, signer
        self.peer_id = signer.peer_id
        self.publish = publish
        self.seen: set[str] = set()
        """Other peers' multiaddrs read in this process's life: where it looks for the swarm again
        after losing it (peer/net/rejoin.py); never the address book's older entries, so a peer
        started on its own DHT stays on it."""

    def refresh(self) -> None:
        """Publish this peer's visible multiaddrs (unless client mode), then remember every other peer's."""
        if self.publish and not swarm_addresses.publish_addresses(
            self.dht, self.run_id, self.signer, swarm_dht.visible_maddrs(self.dht)
        ):
            logger.debug("no DHT node accepted this peer's addresses; retrying in %.0f s", self.period_s)
        known = {m.rsplit("/p2p/", 1)[1] for m in self.book.addresses() if "/p2p/" in m}  # read first
        others = 0
        for peer_id, maddrs in swarm_addresses.read_addresses(self.dht, self.run_id, prefer=known).items():
            if peer_id != self.peer_id:
                others += 1
                self.book.add(maddrs, exclude_peer=self.peer_id)
                self.seen.update(maddrs)
        self.book.save_if_changed()
        if not others and self.seen:  # the peers read earlier in this run are unreadable: the swarm is lost
            answered = reconnect(self.dht, sorted(self.seen))
            if answered:
                logger.info("found the swarm again: %d peer(s) seen earlier answered", answered)

    tick = refresh
