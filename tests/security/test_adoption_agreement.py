"""Issue #51, item 2: no adoption without agreement.

A real :class:`peer.round.Trainer` (the tiny preset) reads scripted, signed-record-shaped progress
records and downloads the states the test serves through the in-process transport (checked as a
network download is: digest, run id, shapes, finiteness). Its own φ is trained (a few dozen AdamW
steps), so the validation losses the loss check compares are those of real states:

* a state one voucher holds is not adopted, one two vouchers hold is;
* a state clearly worse on the peer's validation windows (an untrained φ, −φ) is refused, and not
  downloaded again;
* the tie-break takeover of the issue (a one-member class with a ground, smaller digest) works no
  more: in a swarm of three its class is too small; in a swarm of two the tie needs a lower loss;
* a joiner picks the class with the most attested members, not the most records, and refuses a
  state worse than its own φ_0;
* a joiner refuses a state more than ``CLAIM_MARGIN`` above the best loss the counted records
  claim (issue #65, item 6: Sybils that name each other and serve a state better than random but
  far worse than the swarm's), checks the claiming class's state next, and believes a claim no
  more once its own state fails it or cannot be downloaded;
* a client-mode peer that raced ahead alone steps back to the swarm's less trained state (held
  against φ_0, not its own φ), but not to a state worse than φ_0.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lab.inprocess import InProcessHub, InProcessTransport
from peer.config import TrainerConfig
from peer.net.dht import PeerProgress
from peer.round import Trainer
from peer.round.catchup import CLAIM_MARGIN, LOSS_MARGIN, loss_refusal, phi_loss
from peer.state.snapshot import make_snapshot
from peer.train.data import BatchSampler, validation_batch
from peer.train.model import build_model, lm_loss
from protocol.errors import BadPayload
from protocol.presets import tiny_run
from protocol.records import ProgressRecord
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)
from tests.unit.test_round_overlap import Events

pytestmark = pytest.mark.timeout(300)

ROUND = 4
"""The round the victim is at."""


class Scripted:
    """A swarm view whose records the test sets; what the victim publishes is kept."""

    def __init__(self, peer_id: str):
        self.peer_id, self.records, self.published, self.max_sync_s = peer_id, [], [], 5.0

    def others(self, max_age_s=0.0):
        return list(self.records)

    def live(self, max_age_s=0.0):
        return list(self.records)

    def publish(self, record, *, wait=False):
        self.published.append(record)

    def step_now(self, round_, *, inner_steps, batch_size_tokens):
        return 0


@pytest.fixture(scope="module")
def manifest():
    return tiny_run().replace(name="adoption-agreement")


@pytest.fixture(scope="module")
def trained(corpus, manifest):
    """φ after 40 AdamW steps from φ_0 (validation loss well under φ_0's)."""
    model = build_model(manifest.model, corpus.tokenizer)
    sampler = BatchSampler(corpus.train, seq_len=manifest.data.seq_len_tokens, batch_sequences=8, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):
        loss = lm_loss(model, sampler.next_batch().to(torch.int64))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def victim(corpus, manifest, hub, phi=None, *, peer_id="victim", round_=ROUND, serves=True) -> Trainer:
    t = Trainer(
        manifest=manifest,
        model=build_model(manifest.model, corpus.tokenizer),
        corpus=corpus,
        swarm=Scripted(peer_id),
        transport=InProcessTransport(peer_id, hub),
        config=TrainerConfig(serves_state=serves),
        reporter=Events(),
        stop_event=threading.Event(),
    )
    if phi is not None:
        with torch.no_grad():
            for dst, src in zip(t.phi, phi):
                dst.copy_(src)
        t.state.set_theta_to_phi()
    if round_:
        t.pos.start_round(round_)
    t.state.take_snapshot()
    return t


def serve(hub, t: Trainer, holders, phi, round_: int, *, salt: float = 0.0) -> str:
    """Serve a state (``phi``, zero outer state, at ``round_``) as every one of ``holders``'; its digest."""
    meta = {"run_id": t.m.run_id, "round": round_, "inner_step": round_ * t.H}
    tensors = [f.clone() for f in phi] + [torch.zeros_like(m) for m in t.outer.state_tensors()]
    tensors[0].view(-1)[0] += salt  # another digest for (almost) the same state
    snapshot = make_snapshot(meta, tensors)
    for holder in holders:
        hub.serve(holder, lambda: [snapshot])
    return snapshot.digest.hex()


def record(peer: str, round_: int, digest: str, H: int, groupmates=(), *, loss: float = 2.0) -> PeerProgress:
    return PeerProgress(
        peer_id=peer,
        expiration=0.0,
        record=ProgressRecord(
            round=round_,
            inner_step=round_ * H,
            train_loss=loss,
            tokens_per_s=100.0,
            group_size=3,
            bytes_sent=1,
            state_digest=digest,
            groupmates=tuple(groupmates),
        ),
    )


def same(t: Trainer, phi) -> bool:
    return all(torch.equal(f, g) for f, g in zip(t.phi, phi))


def test_a_state_one_voucher_holds_is_not_adopted_two_are_needed(corpus, manifest, trained):
    hub = InProcessHub()
    t = victim(corpus, manifest, hub, trained)
    t.vouching.ledger.record_group(1, ["m", "h1"])  # both completed groups with the victim before
    mine = [f.clone() for f in t.phi]
    # m and h1 each hold a state of the next round, each its own (near-identical: 1e-6 apart)
    x = serve(hub, t, ["m"], trained, ROUND + 1, salt=1e-6)
    y = serve(hub, t, ["h1"], trained, ROUND + 1, salt=2e-6)
    t.swarm.records = [record("m", ROUND + 1, x, t.H), record("h1", ROUND + 1, y, t.H)]
    assert t.catchup.resync_target() is None  # before: "as big and ahead" adopted one of them
    t.catchup.catch_up(attempts=1)
    assert not t.reporter.of("adopted_state") and t.pos.round == ROUND and same(t, mine)

    # two vouchers hold the same state: adopted (its loss is the victim's, well within the margin)
    t.swarm.records = [record("m", ROUND + 1, x, t.H), record("h1", ROUND + 1, x, t.H)]
    hub.serve("h1", hub.provider("m"))
    t.catchup.catch_up(attempts=1)
    (adopted,) = t.reporter.of("adopted_state")
    assert adopted["round"] == ROUND + 1 and t.pos.round == ROUND + 1 and t.state_digest == x


@pytest.mark.parametrize("bad", ["untrained", "negated"])
def test_the_loss_check_refuses_a_clearly_worse_state(corpus, manifest, trained, bad):
    hub = InProcessHub()
    t = victim(corpus, manifest, hub, trained)
    t.vouching.ledger.record_group(1, ["m1", "m2", "m3"])
    worse = [p.detach().clone() for p in build_model(manifest.model, corpus.tokenizer).parameters()]
    if bad == "negated":
        worse = [-f for f in trained]
    windows = validation_batch(corpus, manifest.data)
    model = build_model(manifest.model, corpus.tokenizer)
    own, theirs = phi_loss(model, windows, trained), phi_loss(model, windows, worse)
    assert theirs > own * (1 + LOSS_MARGIN)  # the premise: clearly worse, yet within the norm bound
    digest = serve(hub, t, ["m1", "m2", "m3"], worse, ROUND + 1)
    t.swarm.records = [record(p, ROUND + 1, digest, t.H) for p in ("m1", "m2", "m3")]
    mine = [f.clone() for f in t.phi]
    downloads = []
    download = t.transport.download_state
    t.transport.download_state = lambda *a: downloads.append(a[1]) or download(*a)
    t.catchup.catch_up()
    assert downloads == [digest]  # refused once, not downloaded again
    assert not t.reporter.of("adopted_state") and t.pos.round == ROUND and same(t, mine)
    (warning,) = t.reporter.of("warning")
    assert "validation loss" in warning["message"] and digest in warning["message"]
    assert digest in t.vouching.refused


def ground(hub, t: Trainer, holder: str, phi, round_: int, *, below=()) -> str:
    """Serve ``phi`` as ``holder``'s with a digest below the victim's and every one of ``below``
    (ground, as the attacker did). The salts are tried in order until one digest is smaller: a
    geometric number of tries with mean 1 / (the smallest digest's share of the digest space)."""
    bound = min([t.state_digest, *below])
    for salt in range(1, 100_000):
        digest = serve(hub, t, [holder], phi, round_, salt=salt * 1e-7)
        if digest < bound:
            return digest
    raise AssertionError(f"no digest below {bound} in 100,000 tries")


def test_the_tie_break_takeover_no_longer_works(corpus, manifest, trained):
    """The attack of issue #51: equivocation split the honest peers into one-member classes, and the
    attacker's −φ, ground to a small digest, won the tie-break (adopted 9 times in 16 rounds)."""
    hub = InProcessHub()
    t = victim(corpus, manifest, hub, trained)
    t.vouching.ledger.record_group(1, ["mallory", "h1", "h2"])
    mine = [f.clone() for f in t.phi]
    h1 = serve(hub, t, ["h1"], trained, ROUND, salt=1e-6)
    h2 = serve(hub, t, ["h2"], trained, ROUND, salt=2e-6)
    # the attacker's digest below every honest one (the victim's and both others'): it wins any
    # tie-break by digest, so only the rules of the class size and the loss can refuse it
    evil = ground(hub, t, "mallory", [-f for f in trained], ROUND, below=[h1, h2])
    assert evil < min(h1, h2, t.state_digest)
    t.swarm.records = [
        record("mallory", ROUND, evil, t.H),
        record("h1", ROUND, h1, t.H),
        record("h2", ROUND, h2, t.H),
    ]
    # a split swarm (every class a single holder): the smallest digest is considered only as a tie,
    # which needs a lower validation loss: −φ is not better, refused
    target = t.catchup.resync_target()
    assert target is not None and target[1] == evil and target.tie
    t.catchup.catch_up(attempts=1)
    assert not t.reporter.of("adopted_state") and same(t, mine)
    (warning,) = t.reporter.of("warning")
    assert "tie" in warning["message"]
    # refused once, never considered again (a swarm of two: the victim and mallory)
    t.swarm.records = [record("mallory", ROUND, evil, t.H)]
    assert t.catchup.resync_target() is None
    # h1 and h2 agree (a class of two): mallory's single state is no longer even considered
    t.swarm.records = [
        record("mallory", ROUND, evil, t.H),
        record("h1", ROUND, h1, t.H),
        record("h2", ROUND, h1, t.H),
    ]
    target = t.catchup.resync_target()
    assert target is not None and target[1] == h1 and not target.tie


def test_a_tie_goes_to_the_state_with_the_lower_loss(corpus, manifest, trained):
    """Two honest peers that diverged still settle on one state: the one with the lower loss."""
    hub = InProcessHub()
    untrained = [p.detach().clone() for p in build_model(manifest.model, corpus.tokenizer).parameters()]
    t = victim(corpus, manifest, hub, [f + 0.01 * torch.randn_like(f) for f in untrained])
    t.vouching.ledger.record_group(1, ["other"])
    better = ground(hub, t, "other", trained, ROUND)
    t.swarm.records = [record("other", ROUND, better, t.H)]
    t.catchup.catch_up(attempts=1)
    (adopted,) = t.reporter.of("adopted_state")
    assert adopted["reason"] == "diverged" and t.state_digest == better


def test_a_joiner_prefers_the_most_attested_class_and_checks_its_loss(corpus, manifest, trained):
    hub = InProcessHub()
    joiner = victim(corpus, manifest, hub, round_=0)
    phi0 = [f.clone() for f in joiner.phi]
    # four records of one state, none naming a groupmate: the most records, no attested member
    unattested = serve(hub, joiner, [f"u{i}" for i in range(4)], trained, ROUND, salt=1e-6)
    # three identities that name each other (as Sybils can) hold a poisoned state
    poisoned_phi = [f.clone() for f in trained]
    poisoned_phi[-1].mul_(-3.0)  # the output side flipped and scaled: confidently wrong
    poisoned = serve(hub, joiner, ["s0", "s1", "s2"], poisoned_phi, ROUND)
    # two honest peers that completed their last round together
    honest = serve(hub, joiner, ["h0", "h1"], trained, ROUND)
    sybils = ("s0", "s1", "s2")
    joiner.swarm.records = [
        *(record(f"u{i}", ROUND, unattested, joiner.H) for i in range(4)),
        *(record(s, ROUND, poisoned, joiner.H, groupmates=[m for m in sybils if m != s]) for s in sybils),
        # what honest peers claim: a training loss a little below their state's validation loss (2.89)
        record("h0", ROUND, honest, joiner.H, groupmates=["h1"], loss=2.5),
        record("h1", ROUND, honest, joiner.H, groupmates=["h0"], loss=2.5),
    ]
    windows = validation_batch(corpus, manifest.data)
    model = build_model(manifest.model, corpus.tokenizer)
    assert phi_loss(model, windows, poisoned_phi) > phi_loss(model, windows, phi0) * (1 + LOSS_MARGIN)
    # the most attested members first: the Sybils' three; refused by the loss check against φ_0
    first = joiner.catchup.resync_target()
    assert first is not None and first[1] == poisoned
    joiner.catchup.catch_up(attempts=1)
    assert [w for w in joiner.reporter.of("warning") if poisoned in w["message"]]
    (adopted,) = joiner.reporter.of("adopted_state")
    assert joiner.state_digest == honest and set(adopted["donors"]) <= {"h0", "h1"}
    assert not same(joiner, phi0)


@pytest.mark.parametrize("behind", ["less-trained", "negated"])
def test_a_client_mode_peer_that_raced_ahead_alone_steps_back(corpus, manifest, trained, behind):
    """A peer nobody can dial trained rounds alone (its state cannot be downloaded); the swarm behind
    it holds a less trained state. Held against its own φ that state is clearly worse, and before,
    the peer refused it every round and never averaged with the swarm again; held against φ_0 it is
    taken. A state worse than φ_0 (−φ) is still refused."""
    hub = InProcessHub()
    t = victim(corpus, manifest, hub, trained, serves=False)
    t.vouching.ledger.record_group(1, ["h1", "h2"])
    phi0 = [p.detach().clone() for p in build_model(manifest.model, corpus.tokenizer).parameters()]
    theirs = phi0 if behind == "less-trained" else [-f for f in trained]
    windows = validation_batch(corpus, manifest.data)
    model = build_model(manifest.model, corpus.tokenizer)
    assert phi_loss(model, windows, theirs) > phi_loss(model, windows, trained) * (1 + LOSS_MARGIN)
    digest = serve(hub, t, ["h1", "h2"], theirs, ROUND - 2, salt=1e-6)
    t.swarm.records = [record(p, ROUND - 2, digest, t.H) for p in ("h1", "h2")]
    mine = [f.clone() for f in t.phi]
    t.catchup.catch_up(attempts=1)
    if behind == "less-trained":
        (adopted,) = t.reporter.of("adopted_state")
        assert adopted["reason"] == "raced ahead" and t.pos.round == ROUND - 2 and t.state_digest == digest
        assert not t.reporter.of("warning")
    else:
        assert not t.reporter.of("adopted_state") and t.pos.round == ROUND and same(t, mine)
        (warning,) = t.reporter.of("warning")
        assert "the run's initial φ's" in warning["message"] and digest in warning["message"]
    # a peer that can be dialed still holds a state behind it against its own φ: refused, it keeps
    # its own (the swarm can download it, and their losses draw closer as training goes on)
    served = victim(corpus, manifest, hub, trained, peer_id="open")
    served.vouching.ledger.record_group(1, ["h1", "h2"])
    served.swarm.records = list(t.swarm.records)
    served.catchup.catch_up(attempts=1)
    assert served.pos.round == ROUND and same(served, trained)


def test_loss_refusal():
    assert loss_refusal(3.0, 3.0, tie=False) is None
    assert loss_refusal(3.0 * (1 + LOSS_MARGIN) * 0.999, 3.0, tie=False) is None
    assert "more than 10%" in (loss_refusal(3.0 * (1 + LOSS_MARGIN) * 1.001, 3.0, tie=False) or "")
    assert "not below" in (loss_refusal(3.0, 3.0, tie=True) or "")
    assert loss_refusal(2.9, 3.0, tie=True) is None
    assert loss_refusal(float("nan"), 3.0, tie=False) is not None


def test_an_error_while_adopting_leaves_the_peer_on_its_own_state(corpus, manifest, trained):
    """Copying a state in fails half-way (its last tensor is not one a CPU tensor can be copied
    from): φ, the outer state and the round are this peer's own again. A state of other tensors is
    refused before anything changes (before: zip() copied what matched)."""
    from peer.state.download import DownloadedState

    hub = InProcessHub()
    t = victim(corpus, manifest, hub, trained)
    mine = [f.clone() for f in [*t.phi, *t.outer.state_tensors()]]
    good = [f.clone() + 1e-6 for f in trained]
    outer = [torch.zeros_like(m) for m in t.outer.state_tensors()]
    outer[-1] = torch.empty(outer[-1].shape, device="meta")
    broken = DownloadedState(round=ROUND + 1, inner_step=(ROUND + 1) * t.H, phi=good, outer_state=outer)
    with pytest.raises(NotImplementedError, match="meta"):
        t.catchup.adopt(broken)
    assert all(torch.equal(f, g) for f, g in zip([*t.phi, *t.outer.state_tensors()], mine))
    assert t.pos.round == ROUND
    wrong = DownloadedState(round=ROUND + 1, inner_step=0, phi=good[:-1], outer_state=outer[:-1])
    with pytest.raises(BadPayload, match="tensors"):
        t.catchup.adopt(wrong)
    assert same(t, trained) and t.pos.round == ROUND


@pytest.fixture(scope="module")
def half_trained(corpus, manifest):
    """φ after 3 AdamW steps from φ_0: better than random, far from the swarm's trained φ."""
    model = build_model(manifest.model, corpus.tokenizer)
    sampler = BatchSampler(corpus.train, seq_len=manifest.data.seq_len_tokens, batch_sequences=8, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        loss = lm_loss(model, sampler.next_batch().to(torch.int64))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def losses(corpus, manifest, *phis) -> list[float]:
    windows = validation_batch(corpus, manifest.data)
    model = build_model(manifest.model, corpus.tokenizer)
    return [phi_loss(model, windows, phi) for phi in phis]


def counting_downloads(t: Trainer) -> list[str]:
    downloads: list[str] = []
    download = t.transport.download_state
    t.transport.download_state = lambda *a: downloads.append(a[1]) or download(*a)
    return downloads


@pytest.mark.parametrize("sybil_claim", ["true", "forged"])
def test_a_joiner_refuses_sybils_state_better_than_random_but_worse_than_the_claims(
    corpus, manifest, trained, half_trained, sybil_claim
):
    """Issue #65, item 6: four fresh identities name each other (the most attested class) and
    serve a state better than φ_0, which the loss check against φ_0 let through. The two honest
    peers claim the loss their state has; the Sybils claim their own state's loss (outclaimed by
    the honest claim: the honest class's state is checked next and adopted) or a forged low one
    (their state fails their own claim: refused, their claim believed no more)."""
    hub = InProcessHub()
    joiner = victim(corpus, manifest, hub, round_=0)
    phi0 = [f.clone() for f in joiner.phi]
    initial, sybil_loss, honest_loss = losses(corpus, manifest, phi0, half_trained, trained)
    claim = honest_loss * 0.9  # a training loss, a little below the state's validation loss
    # the premise: not worse than φ_0 (adopted before), far above what the honest records claim
    assert sybil_loss < initial and loss_refusal(sybil_loss, initial, tie=False) is None
    assert sybil_loss > claim * (1 + CLAIM_MARGIN)
    sybils = [f"s{i}" for i in range(4)]
    poisoned = serve(hub, joiner, sybils, half_trained, ROUND)
    honest = serve(hub, joiner, ["h0", "h1"], trained, ROUND)
    claimed = sybil_loss if sybil_claim == "true" else 0.5
    joiner.swarm.records = [
        *(record(s, ROUND, poisoned, joiner.H, [m for m in sybils if m != s], loss=claimed) for s in sybils),
        record("h0", ROUND, honest, joiner.H, ["h1"], loss=claim),
        record("h1", ROUND, honest, joiner.H, ["h0"], loss=claim),
    ]
    first = joiner.catchup.resync_target()
    assert first is not None and first[1] == poisoned  # the rule alone would take the Sybils' state
    downloads = counting_downloads(joiner)
    joiner.catchup.catch_up(attempts=1)
    assert downloads == [poisoned, honest]
    (warning,) = joiner.reporter.of("warning")
    assert poisoned in warning["message"] and "claim" in warning["message"]
    (adopted,) = joiner.reporter.of("adopted_state")
    assert joiner.state_digest == honest and set(adopted["donors"]) <= {"h0", "h1"} and same(joiner, trained)
    assert poisoned in joiner.vouching.refused
    assert (poisoned in joiner.vouching.unbacked) == (sybil_claim == "forged")


def test_a_forged_claim_its_class_cannot_show_delays_a_joiner_by_one_download(corpus, manifest, trained):
    """Two identities naming each other claim a loss far below the honest state's and serve
    nothing. The honest state is outclaimed, the claim checked: its download fails, the claim is
    believed no more, and the honest state, tried again, is adopted."""
    hub = InProcessHub()
    joiner = victim(corpus, manifest, hub, round_=0)
    (honest_loss,) = losses(corpus, manifest, trained)
    honest = serve(hub, joiner, ["h0", "h1", "h2"], trained, ROUND)
    ghost = "0123456789abcdef" * 2  # a digest nobody serves
    joiner.swarm.records = [
        *(
            record(h, ROUND, honest, joiner.H, [m for m in ("h0", "h1", "h2") if m != h], loss=honest_loss)
            for h in ("h0", "h1", "h2")
        ),
        record("f0", ROUND, ghost, joiner.H, ["f1"], loss=honest_loss / 4),
        record("f1", ROUND, ghost, joiner.H, ["f0"], loss=honest_loss / 4),
    ]
    downloads = counting_downloads(joiner)
    joiner.catchup.catch_up(attempts=1)
    assert downloads == [honest, ghost, honest]
    (adopted,) = joiner.reporter.of("adopted_state")
    assert joiner.state_digest == honest and set(adopted["donors"]) <= {"h0", "h1", "h2"}
    assert ghost in joiner.vouching.unbacked and honest not in joiner.vouching.refused


def test_a_peer_with_history_is_not_held_to_the_claims(corpus, manifest, trained):
    """The claims bind only the joiner's rule: a peer whose vouchers hold a state adopts it on their
    word and its own loss check, whatever loss some records claim."""
    hub = InProcessHub()
    t = victim(corpus, manifest, hub, trained)
    t.vouching.ledger.record_group(1, ["h1", "h2"])
    digest = serve(hub, t, ["h1", "h2"], trained, ROUND + 1, salt=1e-6)
    t.swarm.records = [record(p, ROUND + 1, digest, t.H, loss=0.01) for p in ("h1", "h2")]
    t.catchup.catch_up(attempts=1)
    assert t.catchup.claims is None and t.state_digest == digest


def test_claimed_loss_and_the_claims_that_stand():
    from peer.state.vouching import Vouching, class_claims

    def rec(peer, train_loss, eval_loss=None):
        return PeerProgress(
            peer_id=peer,
            expiration=0.0,
            record=ProgressRecord(
                round=1,
                inner_step=1,
                train_loss=train_loss,
                tokens_per_s=1.0,
                group_size=1,
                bytes_sent=0,
                eval_loss=eval_loss,
            ),
        )

    assert rec("a", 2.5).record.claimed_loss == 2.5
    assert rec("a", 2.5, eval_loss=2.7).record.claimed_loss == 2.7  # φ's own, measured on the windows
    assert rec("a", 0.0).record.claimed_loss is None  # a peer that has not finished a round yet
    records = [rec("a", 3.0), rec("b", 2.0), rec("c", 9.0), rec("d", 0.0), rec("e", 1.0)]
    claims = class_claims(records, {(1, "x"): ["a", "b", "c"], (1, "y"): ["d"], (1, "z"): ["e"]})
    assert claims == {(1, "x"): 3.0, (1, "z"): 1.0}  # lower median; a class without a claim: none
    v = Vouching(min_round_s=1.0)
    v.refuse("t", outclaimed_by="k")
    v.refuse("u")
    assert v.refused == {"t", "u"} and v.unbacked == {"u"}
    v.refuse("k")  # the claiming class's own state failed: its claim falls, what it outclaimed is free
    assert v.refused == {"u", "k"} and v.unbacked == {"u", "k"} and not v.outclaimed
