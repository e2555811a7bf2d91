"""Issue #65, item 7: a member that lies in its RECEIPTs, among real ``peer join`` processes.

A bootstrap node and four peers train the tiny preset on 127.0.0.1 for 8 rounds: once all honest
(the clean swarm), once with one of the four started as tests/security/lying_peer.py (each receipt
it sends reports false, unsealed digests of every owner's means, refuses every owner and reports an
alignment of 0). Before owners sealed their means, any second digest skipped the owner: with one
such member of four, every honest owner's pieces were applied as zeros in 11 of 16 rounds and the
honest loss ended 52.7 % above the clean one. Now the honest peers read the liar's receipt as a lie
(its digests carry no valid seal), name it, skip no honest owner, and end within
:data:`MARGIN` of the clean swarm's loss.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import pytest

from peer.launch import peer_argv
from tests.integration.conftest import procs  # noqa: F401 (the fixture)
from tests.integration.harness import make_manifest, write_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROUNDS = 8
MARGIN = 0.08
"""The honest peers' mean final validation loss may exceed the clean swarm's by this fraction. Here
(2-core CPU): two clean swarms of 4 ended at 2.856 and 2.922 (2.3 % apart: group timing differs
from run to run); with the honest peers' identities (their data) the same in both swarms, the liar's
swarm ended -0.41 % to -0.05 % from its clean one (3 runs). The attack before the seals: +52.7 %
(16 rounds); with the liar struck (its work left out, 3 peers' data instead of 4): +9.1 %; with a
liar that also judged its groups by its own false receipt (its φ left the honest peers'), +9.85 %
in a CI run."""
LIAR = Path(__file__).with_name("lying_peer.py")
RECORD_ENV = "LOCOSWARM_LYING_RECEIPTS_RECORD"
LIARS_ENV = "LOCOSWARM_LYING_RECEIPTS_LIARS"
"""Where set (1 or 2), how many colluding liars join the 3 honest peers (default 1: the CI test);
bench/lying_receipts.py sets it for its 2-colluder row. Colluders send the same false digests."""
HONEST = 3
"""Where set, the test also runs the floor (the 3 honest identities never averaging) and appends the
three swarms' losses to this file as a JSON line, before its assertion: bench/lying_receipts.py
repeats it to record the row."""


def run_swarm(
    procs, workdir: Path, *, liar: bool, identities_of: str | None = None, alone: bool = False, liars: int = 1
) -> tuple[list[float], list[str]]:
    """Start a bootstrap node and 3 + ``liars`` peers (the last ``liars`` of them liars if ``liar``)
    for :data:`ROUNDS` rounds; return the honest peers' final validation losses and their logs.
    ``identities_of``: the name of an earlier swarm whose peers' identity keys the honest peers take,
    so that they sample the same data (a peer's shard order follows its peer id,
    peer/train/data.py ``peer_seed``). ``alone``: 3 honest peers under
    ``sync.algorithm = "independent"`` (never averaging: the floor)."""
    workdir.mkdir()
    manifest = make_manifest(name="lying-receipts", **({"sync": {"algorithm": "independent"}} if alone else {}))
    _, addr = procs.bootstrap(write_manifest(workdir, manifest))
    size = HONEST if alone else HONEST + liars
    args = ["--initial-peers", addr, "--max-rounds", str(ROUNDS), "--wait-for-peers", str(size)]
    names = [f"{workdir.name}-h{i}" for i in range(HONEST if liar or alone else size)]
    if identities_of is not None:
        for i, name in enumerate(names):
            (procs.workdir / name).mkdir()
            shutil.copy(procs.workdir / f"{identities_of}-h{i}" / "identity.key", procs.workdir / name / "identity.key")
    honest = [procs.peer(name, *args) for name in names]
    attackers = []
    for k in range(liars if liar else 0):
        name = f"{workdir.name}-liar{k or ''}"
        argv = peer_argv(
            data_dir=procs.workdir / name, extra=["--threads", "1", "--owner-key", str(procs.owner_key), *args]
        )
        attackers.append(procs.spawn(name, [sys.executable, str(LIAR), *argv[3:]]))
    for p in honest:
        assert p.wait(600) == 0, p.tail()
    for attacker in attackers:
        attacker.wait(120)
    losses = []
    for p in honest:
        final = [e for e in p.of("eval") if e["when"] == "final"]
        assert final, p.tail()
        losses.append(final[-1]["loss"])
    return losses, [p.log_path.read_text(errors="replace") for p in honest]


def test_a_member_lying_in_its_receipts_costs_the_honest_peers_almost_nothing(procs, tmp_path):
    liars = int(os.environ.get(LIARS_ENV, "1"))
    clean, _ = run_swarm(procs, tmp_path / "clean", liar=False, liars=liars)
    procs.cleanup()
    # the same 3 honest identities (the same data) in both swarms: only the other peers differ
    attacked, logs = run_swarm(procs, tmp_path / "attacked", liar=True, identities_of="clean", liars=liars)
    # the attack ran: every honest peer read a receipt whose digests no owner sealed
    assert all("report means their owners never signed" in log for log in logs)
    assert not any("signed different means" in log for log in logs)  # no honest owner named
    change = statistics.mean(attacked) / statistics.mean(clean) - 1
    print(f"clean {clean}, attacked {attacked}, change {change:+.2%}")
    if record := os.environ.get(RECORD_ENV):  # bench/lying_receipts.py collects repeated runs, with the floor
        procs.cleanup()
        alone, _ = run_swarm(procs, tmp_path / "alone", liar=False, identities_of="clean", alone=True)
        row = {"liars": liars, "clean": clean, "attacked": attacked, "independent": alone, "change": change}
        with open(record, "a") as f:
            f.write(
                json.dumps({**row, "independent_change": statistics.mean(alone) / statistics.mean(clean) - 1}) + "\n"
            )
    assert change <= MARGIN, (clean, attacked)
