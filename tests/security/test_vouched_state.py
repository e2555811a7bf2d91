"""Issue 17, item 3: state is adopted only when vouched for.

Before: one real and four fake progress records claiming the next round with an all-zero φ made
every honest DiLoCo peer adopt it (loss 2.69 → 5.56); a NoLoCo peer followed any one record two
rounds ahead. Signed records (item 2) bind a record to its key, but keys are free: here the four
fakes are records of four fresh identities, each validly signed, stored through a stock hivemind
node. Honest peers are real Trainers that trained two rounds together (so each holds the others
in its ledger), reading the run's records from a real DHT node.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from peer.config import TrainerConfig
from peer.net import dht as swarm_dht
from peer.net.dht import PeerProgress
from peer.net.identity import ensure_identity
from peer.net.validator import protect_run
from peer.round import Trainer
from peer.state.snapshot import make_snapshot
from peer.sync.membership import SwarmView
from peer.train.model import build_model
from protocol.presets import tiny_run
from protocol.records import ProgressRecord
from protocol.signing import PeerSigner
from tests.security.dht_attacker import victim_and_attacker
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)
from tests.unit.test_round_overlap import Events, Group, Transport, run_in_threads

pytestmark = pytest.mark.timeout(300)

HONEST = ("h0", "h1", "h2")
ROUNDS = 2
"""Rounds the honest peers and the attacker's real peer train together before the attack."""


@pytest.fixture(scope="module")
def signers(tmp_path_factory):
    base = tmp_path_factory.mktemp("ids")
    names = (*HONEST, "mallory", "fresh0", "fresh1", "fresh2", "fresh3", "joiner")
    return {name: PeerSigner.from_identity(ensure_identity(base / f"{name}.key")) for name in names}


@pytest.fixture(scope="module")
def node():
    with victim_and_attacker() as both:
        yield both


def zero_state(trainer: Trainer, round_: int):
    """The attacker's state: φ and outer state all zero, at ``round_``, as a served snapshot whose
    digest is real (so the download verifies against it)."""
    meta = {"run_id": trainer.m.run_id, "round": round_, "inner_step": round_ * trainer.H}
    zeros = [torch.zeros_like(t) for t in [*trainer.phi, *trainer.outer.state_tensors()]]
    snapshot = make_snapshot(meta, zeros)
    return types.SimpleNamespace(_snapshots=[snapshot], shapes=trainer.shapes), snapshot.digest.hex()


def trainer(corpus, manifest, signer, dht, transport, *, peers: int = 1) -> Trainer:
    swarm = SwarmView(dht, run_id=manifest.run_id, signer=signer, record_ttl_s=120.0, max_sync_s=5.0)
    return Trainer(
        manifest=manifest,
        model=build_model(manifest.model, corpus.tokenizer),
        corpus=corpus,
        swarm=swarm,
        transport=transport,
        config=TrainerConfig(max_rounds=ROUNDS, wait_for_peers=peers, wait_for_peers_timeout_s=60.0),
        reporter=Events(),
        stop_event=threading.Event(),
    )


def forged(round_: int, digest: str, H: int) -> ProgressRecord:
    return ProgressRecord(
        round=round_,
        inner_step=round_ * H,
        train_loss=2.0,
        tokens_per_s=100.0,
        group_size=5,
        bytes_sent=1 << 20,
        state_digest=digest,
    )


@pytest.mark.parametrize("algorithm", ["diloco", "noloco"])
def test_one_real_and_four_fresh_identities_cannot_make_the_swarm_adopt_their_state(corpus, node, signers, algorithm):
    peer, attacker = node
    manifest = tiny_run().replace(name=f"vouched-{algorithm}", sync={"algorithm": algorithm}, noloco={"group_size": 4})
    protect_run(peer, manifest.run_id)
    group = Group(4)  # the honest peers stay up serving their states after their round loops
    peers = {
        name: trainer(
            corpus, manifest, signers[name], peer, Transport(signers[name].peer_id, group, keeps_serving=True), peers=4
        )
        for name in (*HONEST, "mallory")
    }
    run_in_threads(list(peers.values()))
    honest = [peers[name] for name in HONEST]
    everyone = {t.peer_id for t in peers.values()}
    for t in honest:
        assert t.pos.round == ROUNDS
        # each completed a group with the others, and says so in its signed record
        assert t.vouching.ledger.vouchers(t.pos.round) == everyone - {t.peer_id}
        mine = [r.record for r in t.swarm.live() if r.peer_id == t.peer_id]
        assert set(mine[0].groupmates) == everyone - {t.peer_id}

    # The attack: mallory (a real peer that trained with them) and four fresh identities claim a
    # state ahead (DiLoCo: the next round; NoLoCo: two rounds ahead), each record signed by its own key.
    ahead = ROUNDS + (1 if algorithm == "diloco" else 2)
    served, digest = zero_state(honest[0], ahead)
    for name in ("mallory", "fresh0", "fresh1", "fresh2", "fresh3"):
        group.serve(signers[name].peer_id, lambda: served._snapshots)
        assert swarm_dht.publish_progress(
            attacker.dht, manifest.run_id, signers[name], forged(ahead, digest, manifest.sync.inner_steps), ttl_s=120.0
        )

    for t in honest:
        seen = [r for r in t.swarm.others() if r.record.state_digest == digest]
        assert len(seen) == 5  # every forged record verifies and is read
        before = [f.clone() for f in t.phi]
        t.catchup.catch_up()
        assert not t.reporter.of("adopted_state")
        assert t.pos.round == ROUNDS
        for f, g in zip(t.phi, before):
            assert torch.equal(f, g)  # before: φ = 0

    # A joiner (no history) counts the honest peers, whose signed records name each other as the
    # groupmates of their last round; the forged records (mallory's included) name no one.
    joiner = trainer(corpus, manifest, signers["joiner"], peer, Transport("joiner", group))
    joiner.catchup.catch_up(attempts=1)
    (adopted,) = joiner.reporter.of("adopted_state")
    assert adopted["round"] == ROUNDS and set(adopted["donors"]) <= {t.peer_id for t in honest}
    assert any(torch.equal(f, g) for t in honest for f, g in zip(joiner.phi, t.phi))
    assert all(f.abs().sum() > 0 for f in joiner.phi)


def test_a_zero_phi_is_refused_by_the_sanity_bound_even_from_the_only_class(corpus, node, signers):
    """A joiner follows a swarm of one class even unattested (else a one-peer swarm could never be
    joined); the state those peers serve verifies against its digest, but a φ of norm 0 is not a
    trained φ_0 of this run: refused, φ_0 kept, and not downloaded again."""
    peer, attacker = node
    manifest = tiny_run().replace(name="vouched-sanity")
    protect_run(peer, manifest.run_id)
    group = Group(2)
    downloads = []

    class Counting(Transport):
        def download_state(self, donors_, digest, timeout_s):
            downloads.append(digest)
            return super().download_state(donors_, digest, timeout_s)

    joiner = trainer(corpus, manifest, signers["joiner"], peer, Counting("joiner", group))
    served, digest = zero_state(joiner, 5)
    for name in ("mallory", "fresh0"):
        group.serve(signers[name].peer_id, lambda: served._snapshots)
        assert swarm_dht.publish_progress(
            attacker.dht, manifest.run_id, signers[name], forged(5, digest, manifest.sync.inner_steps), ttl_s=120.0
        )
    phi0 = [f.clone() for f in joiner.phi]
    joiner.catchup.catch_up()
    assert downloads == [digest]  # downloaded once (verified against the digest), then not again
    assert not joiner.reporter.of("adopted_state") and joiner.pos.round == 0
    assert all(torch.equal(f, g) for f, g in zip(joiner.phi, phi0))
    (warning,) = joiner.reporter.of("warning")
    assert "norm 0" in warning["message"] and digest in warning["message"]


class Scripted:
    """A swarm view whose records the test sets."""

    def __init__(self, peer_id: str):
        self.peer_id, self.records, self.max_sync_s = peer_id, [], 5.0

    def others(self, max_age_s=0.0):
        return list(self.records)


@pytest.mark.parametrize("algorithm", ["diloco", "noloco"])
def test_a_round_jump_beyond_elapsed_time_is_ignored(corpus, algorithm):
    """Mallory completed rounds with this peer (a voucher) and is its only partner; a second after
    claiming this peer's round it claims round 5000: no round loop goes that fast, so the record is
    ignored and counted. Before: adopted (DiLoCo: as many peers and ahead; NoLoCo: two rounds ahead)."""
    manifest = tiny_run().replace(name=f"vouched-clock-{algorithm}", sync={"algorithm": algorithm})
    swarm = Scripted("victim")
    t = Trainer(
        manifest=manifest,
        model=build_model(manifest.model, corpus.tokenizer),
        corpus=corpus,
        swarm=swarm,
        transport=Transport("victim"),
        config=TrainerConfig(),
        reporter=Events(),
        stop_event=threading.Event(),
    )
    t.vouching.ledger.record_group(2, ["mallory"])
    t.pos.start_round(5)
    t.state.take_snapshot()

    def claim(round_: int, digest: str) -> None:
        record = forged(round_, digest, manifest.sync.inner_steps)
        swarm.records = [PeerProgress(peer_id="mallory", record=record, expiration=0.0)]

    claim(5, t.state_digest)
    assert t.catchup.resync_target() is None  # the first sight of mallory: its clock starts at round 5
    claim(5000, "0" * 32)
    assert t.catchup.resync_target() is None
    assert t.vouching.clock.ignored == 1
