"""Which run a joining peer trains: the swarm's announced runs, its flags and its checkpoints.

``peer join`` to a swarm decides once, after its DHT node started (peer/node.py):

* ``--run-id ID``: that run (with ``--run``/``--preset`` too, they must name the same run);
* ``--run FILE``/``--preset NAME`` (a local manifest): the swarm's run of that manifest; a new run
  of this peer's own when the swarm announces none, or with ``--new-run``; else
  :class:`RunChoiceNeeded`;
* nothing: the one announced run, or, of several, the one run this peer holds a checkpoint of
  (``<data dir>/runs/<run id>/checkpoint.safetensors``); else :class:`RunChoiceNeeded` listing
  the runs (name, run id, peers, round) and asking for ``--run-id``.

Runs have owners (protocol/manifest.py): the announced runs here are only those whose manifest is
signed by the owner its run id binds (peer/net/dht.py ``list_announced``), so an unsigned or
forged announcement neither counts as a second run nor stands in for the real one. A local
manifest that names its owner is that one run; one that names none (a preset, most TOML files)
matches the swarm's runs of the same content, whoever owns them, and if it is started, the peer
starting it becomes its owner.

Pure: the DHT reads are the caller's (``announced`` and ``stats``).
"""

from __future__ import annotations

from collections.abc import Callable, Set
from pathlib import Path

from protocol.errors import ManifestNotFound, RunChoiceNeeded
from protocol.manifest import RunManifest
from protocol.text import sanitize

RunStats = Callable[[str], tuple[int, int] | None]
"""run id → (peers with a progress record, highest round among them), or None when unknown."""


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

    Returns:
        An announced run's id (or ``run_id``, or ``local.run_id`` of an owned ``local``) whose
        signed manifest the caller fetches, or None: start ``local`` as a run of this peer's own
        (signed with its owner key) since the swarm does not announce it.

    Raises:
        RunChoiceNeeded: several runs and nothing picks one; ``local`` is not the swarm's run and
            ``new_run`` is not set; ``run_id`` and ``local`` name different runs; the swarm
            announces ``local``'s content under several owners.
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
        if len(matches) > 1:
            listing = describe_runs({rid: announced[rid] for rid in matches}, stats)
            raise RunChoiceNeeded(
                f"the swarm trains {local_flag} as {len(matches)} runs of different owners: "
                f"{listing}; choose one with --run-id RUN_ID"
            )
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
    if len(announced) == 1:
        return next(iter(announced))
    mine = sorted(checkpoints & announced.keys())
    if len(mine) == 1:
        return mine[0]
    held = f" (this peer holds checkpoints of {len(mine)} of them)" if mine else ""
    raise RunChoiceNeeded(
        f"the swarm announces {len(announced)} runs{held}: {describe_runs(announced, stats)}; "
        "choose one with --run-id RUN_ID"
    )
