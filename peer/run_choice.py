"""Which run a joining peer trains: the swarm's announced runs, its flags and its checkpoints.

``peer join`` to a swarm decides once, after its DHT node started (peer/node.py):

* ``--run-id ID``: that run (with ``--run``/``--preset`` too, they must name the same run); an id
  the swarm does not announce while it announces others is refused after :data:`RUN_ID_LOOK_S`,
  listing them (:func:`refuse_unannounced_run_id`);
* ``--run FILE``/``--preset NAME`` (a local manifest): the swarm's run of that manifest; a new run
  of this peer's own when the swarm announces none, or with ``--new-run``; else
  :class:`RunChoiceNeeded`;
* nothing: the one announced run this peer holds a checkpoint of (``<data dir>/runs/<run
  id>/checkpoint.safetensors``: a restart resumes its run); else the run the bootstrap node it
  dialed announces as its own (``home``: signed by that node's identity, peer/net/home_run.py);
  else the one announced run; else the run with the most vouched live peers (``weight``: peers
  whose signed records name each other as groupmates, :func:`vouched_live`). Owner keys cost
  nothing, so runs announced by strangers never make a plain join exit: it always picks one
  (issue #51, item 5).

Runs have owners (protocol/manifest.py): the announced runs here are only those whose manifest is
signed by the owner its run id binds (peer/net/dht.py ``list_announced``), so an unsigned or
forged announcement neither counts as a second run nor stands in for the real one. A local
manifest that names its owner is that one run; one that names none (a preset, most TOML files)
matches the swarm's runs of the same content, whoever owns them, and if it is started, the peer
starting it becomes its owner.

Pure: the DHT reads are the caller's (``announced``, ``stats``, ``home`` and :func:`weigher`'s ``read``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Set
from pathlib import Path
from typing import Any

from peer.train.resync import attested
from protocol import liveness
from protocol.errors import ManifestNotFound, RunChoiceNeeded
from protocol.manifest import RunManifest
from protocol.text import sanitize

RunStats = Callable[[str], tuple[int, int] | None]
"""run id → (peers with a progress record, highest round among them), or None when unknown."""

RunWeight = Callable[[str], int]
"""run id → its vouched live peers (:func:`vouched_live`), 0 when unknown."""

RUN_ID_LOOK_S = 3.0
"""How long a peer given ``--run-id`` looks for that run's announcement before a runs index holding
only other runs refuses the id (listing them); the announcement of a run whose owner just started
may take a moment to reach the nodes this peer asks. With no run announced at all, it waits up to
``manifest_wait_s`` as a plain join does (a swarm still starting)."""

MAX_RUNS_LISTED = 10
"""The most runs a refused ``--run-id`` lists (anyone can announce runs; the rest are counted)."""

MAX_WEIGHED_RUNS = 8
"""The most runs whose progress records a plain join reads to weigh them (:func:`weigher`): each is
a bounded DHT read, and a joiner must not spend a read per run an attacker announced."""


def vouched_live(manifest: RunManifest, records: Iterable[Any], now: float) -> int:
    """How many of a run's peers are live and vouched for, as a joiner (which has no ledger) can tell.

    Args:
        manifest: the run's manifest (its liveness rule, protocol/liveness.py).
        records: the run's progress records (``peer.net.dht.PeerProgress``: ``peer_id``, ``record``,
            ``expiration``).
        now: DHT time, s.

    Returns:
        The live peers that :func:`peer.train.resync.attested` vouches for: some other live peer
        names it as a groupmate and it names that peer back. A flood of fresh identities that never
        synced with anyone counts 0; identities of one owner naming each other do count (a joiner
        has no other evidence).
    """
    live = {
        r.peer_id: (r.record.round, tuple(r.record.groupmates))
        for r in records
        if liveness.judge(r.record, r.expiration, now, manifest).live
    }
    return len(attested(live))


def weigher(
    announced: dict[str, RunManifest], read: Callable[[str], Iterable[Any]], now: Callable[[], float]
) -> RunWeight:
    """A :data:`RunWeight` over ``announced`` that reads (``read(run_id)``: its progress records) at
    most :data:`MAX_WEIGHED_RUNS` runs, each once; other runs, and runs whose read raised, weigh 0."""
    cache: dict[str, int] = {}

    def weight(run_id: str) -> int:
        if run_id not in cache:
            if run_id not in announced or len(cache) >= MAX_WEIGHED_RUNS:
                return 0
            try:
                cache[run_id] = vouched_live(announced[run_id], read(run_id), now())
            except Exception:  # NetworkError, a DHT shutting down: unknown weighs nothing
                cache[run_id] = 0
        return cache[run_id]

    return weight


def _heaviest(candidates: Iterable[str], weight: RunWeight, prefer: Set[str]) -> str:
    """The candidate with the most vouched live peers; ties: one in ``prefer``, then the smallest run id.
    Runs in ``prefer`` are weighed first (they are the likely ones and :func:`weigher` reads few)."""
    ordered = sorted(candidates, key=lambda rid: (rid not in prefer, rid))
    return max(ordered, key=lambda rid: (weight(rid), rid in prefer, [-ord(c) for c in rid]))


def checkpointed_runs(data_dir: Path) -> set[str]:
    """Run ids this data dir holds a checkpoint of (``runs/<run id>/checkpoint.safetensors``)."""
    runs_dir = Path(data_dir) / "runs"
    if not runs_dir.is_dir():
        return set()
    return {p.parent.name for p in runs_dir.glob("*/checkpoint.safetensors")}


def describe_runs(announced: dict[str, RunManifest], stats: RunStats) -> str:
    """``"name" (run id, 3 peers, round 12); ...``, sorted by run id."""
    parts = []
    for run_id, manifest in sorted(announced.items()):
        found = stats(run_id)
        where = "no progress records" if found is None else f"{found[0]} peer(s), round {found[1]}"
        parts.append(f"{sanitize(manifest.name)!r} (run id {run_id}, {where})")
    return "; ".join(parts)


def choose_run(
    announced: dict[str, RunManifest],
    *,
    local: RunManifest | None,
    local_flag: str = "--run/--preset",
    run_id: str | None = None,
    new_run: bool = False,
    checkpoints: Set[str] = frozenset(),
    stats: RunStats = lambda run_id: None,
    home: str | None = None,
    weight: RunWeight = lambda run_id: 0,
) -> str | None:
    """The id of the run this peer trains.

    Args:
        announced: the swarm's validly signed runs, run id → manifest (peer/net/dht.py ``list_announced``).
        local: the manifest of ``--run``/``--preset``, or None for a plain join.
        local_flag: how the user named ``local`` (``--preset tiny``), for the messages.
        run_id: ``--run-id``.
        new_run: ``--new-run``: start ``local`` even while the swarm announces other runs.
        checkpoints: run ids this peer holds a checkpoint of (:func:`checkpointed_runs`).
        stats: peers and round of an announced run, read only for a message.
        home: the run the bootstrap node this peer dialed announces as its own (peer/net/home_run.py).
        weight: an announced run's vouched live peers (:func:`weigher`), to pick among runs.

    Returns:
        An announced run's id (or ``run_id``, or ``local.run_id`` of an owned ``local``) whose
        signed manifest the caller fetches, or None: start ``local`` as a run of this peer's own
        (signed with its owner key) since the swarm does not announce it.

    Raises:
        RunChoiceNeeded: ``local`` is not the swarm's run and ``new_run`` is not set; ``run_id`` and
            ``local`` name different runs. Never for a plain join.
        ManifestNotFound: a plain join while the swarm announces no run (yet): retry later.
    """
    if local is not None:
        if local.owner:  # one run: that owner's
            matches = [local.run_id] if local.run_id in announced else []
        else:
            matches = sorted(rid for rid, m in announced.items() if m.same_content(local))
        if run_id is not None:
            if run_id == local.run_id or run_id in matches:
                return run_id
            raise RunChoiceNeeded(
                f"--run-id {run_id} and {local_flag} (run id {local.run_id}) name different runs; give one of them"
            )
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:  # anyone can announce a preset's content under a key of its own
            return home if home in matches else _heaviest(matches, weight, set(checkpoints))
        if not announced or new_run:
            return None
        others = describe_runs(announced, stats)
        ident = f" (run id {local.run_id})" if local.owner else ""  # an ownerless manifest has no run yet
        raise RunChoiceNeeded(
            f"{local_flag} is run {local.name!r}{ident}, but the swarm trains {others}: drop "
            f"{local_flag} to join the swarm's run, or add --new-run to start {local.name!r} beside it"
        )
    if run_id is not None:
        return run_id
    if not announced:
        raise ManifestNotFound("the swarm announces no run yet; retry in a few seconds or pass --run-id")
    mine = sorted(checkpoints & announced.keys())
    if len(mine) == 1:  # a restart resumes its run
        return mine[0]
    if home in announced:
        return home
    if len(announced) == 1:
        return next(iter(announced))
    return _heaviest(mine or announced, weight, set(mine))


def refuse_unannounced_run_id(run_id: str, announced: dict[str, RunManifest]) -> None:
    """Refuse ``--run-id`` when the swarm's runs index, read, holds other runs but not it: the id is
    wrong (a typo, another swarm's run), and waiting for it would not help (issue #68, item 7). An
    empty index proves nothing (a swarm still starting): the caller goes on waiting.

    Args:
        run_id: ``--run-id``.
        announced: the swarm's validly signed runs, run id → manifest, read without ``only``.

    Raises:
        RunChoiceNeeded: ``announced`` holds runs, not ``run_id``; the message lists them (name
            and run id, at most :data:`MAX_RUNS_LISTED`, sorted by run id) and says what to pass.
    """
    if not announced or run_id in announced:
        return
    listed = sorted(announced.items())
    names = [f"{sanitize(m.name, max_chars=64)!r} (run id {rid})" for rid, m in listed[:MAX_RUNS_LISTED]]
    more = f" and {len(listed) - MAX_RUNS_LISTED} more" if len(listed) > MAX_RUNS_LISTED else ""
    raise RunChoiceNeeded(
        f"--run-id {run_id}: the swarm announces no such run; it announces {'; '.join(names)}{more}: "
        "pass one of these ids (`peer status` lists them with their peers), or drop --run-id"
    )
