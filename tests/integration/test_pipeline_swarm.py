"""A pipelined swarm of real peer processes on loopback (issue #19): 2 stages × 2 replicas of the
tiny model (2 blocks), each stage syncing among its own replicas (DiLoCo), a replica killed and
restarted mid-run, and the loss against the unpipelined swarm at equal tokens."""

import signal

import pytest

from peer.train.model import spec_parameter_count
from tests.integration.harness import make_manifest, write_manifest

pytestmark = pytest.mark.integration

PIPELINE = dict(model={"num_layers": 2}, pipeline={"stages": 2, "call_timeout_s": 15.0})


def _losses(child):
    return [e["train_loss"] for e in child.of("round")]


def _final_loss(children, last: int = 2) -> float:
    """Mean training loss over the last ``last`` rounds of ``children`` (nats per token)."""
    values = [loss for c in children for loss in _losses(c)[-last:]]
    return sum(values) / len(values)


def test_pipelined_loss_falls_like_the_unpipelined_swarm_at_equal_tokens(procs, tmp_path):
    """2 stages × 2 replicas against 2 unpipelined peers: the same batches per step, H and rounds,
    so equal tokens (the stage-0 peers read the data). Training loss, as a pipelined peer holds no
    whole model to evaluate."""
    rounds = 8
    finals = {}
    for stages in (2, 1):
        manifest = make_manifest(
            sync={"inner_steps": 10, "matchmaking_time_s": 3.0}, model={"num_layers": 2}, pipeline={"stages": stages}
        )
        run_dir = tmp_path / f"stages{stages}"
        run_dir.mkdir()
        boot, addr = procs.bootstrap(write_manifest(run_dir, manifest))
        if stages == 2:
            names = [("a0", 0), ("b0", 0), ("a1", 1), ("b1", 1)]
            peers = {
                n: procs.peer(
                    f"{n}-{stages}",
                    "--initial-peers",
                    addr,
                    "--stage",
                    str(k),
                    "--wait-for-peers",
                    "2",
                    "--max-rounds",
                    str(rounds),
                )
                for n, k in names
            }
            readers = [peers["a0"], peers["b0"]]
        else:
            peers = {
                n: procs.peer(
                    f"{n}-{stages}", "--initial-peers", addr, "--wait-for-peers", "2", "--max-rounds", str(rounds)
                )
                for n in ("a", "b")
            }
            readers = list(peers.values())
        for p in peers.values():  # every stage ends its last round with its callers and exits
            assert p.wait(240) == 0, p.tail()
        for p in readers:
            assert [e["round"] for e in p.of("round")] == list(range(1, rounds + 1))
            assert p.of("round")[-1]["group_size"] == 2, [(e["round"], e.get("note")) for e in p.of("round")]
        finals[stages] = _final_loss(readers)
        first = sum(_losses(p)[0] for p in readers) / len(readers)
        assert finals[stages] < first - 1.5, (stages, first, finals[stages])
        boot.send(signal.SIGINT)
        boot.wait(30)
    print("final training loss (pipelined, unpipelined):", finals)
    # measured here: +0.4 %, +0.6 %, +2.4 % in 3 runs, then +7.9 % in a fresh-clone CI (2026-11-27);
    # the unpipelined runs alone spread 2.6 %: a short run of real processes, one seed. A pipeline
    # that did not train would not pass the loss drop above; this bounds how much worse it learns.
    assert finals[2] < finals[1] * 1.10, finals


def test_two_stages_two_replicas_train_and_survive_a_killed_replica(procs, tmp_path):
    manifest = make_manifest(sync={"inner_steps": 10, "matchmaking_time_s": 3.0}, **PIPELINE)
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    peers = {
        name: procs.peer(name, "--initial-peers", addr, "--stage", str(stage), "--wait-for-peers", "2")
        for name, stage in (("s0a", 0), ("s0b", 0), ("s1a", 1), ("s1b", 1))
    }
    for name, p in peers.items():
        started = p.wait_event(lambda e: e.kind == "started", 120)
        assert started["stage"] == int(name[1])
    # activations reach stage 1 and gradients come back: the stage-0 peers finish rounds, and each
    # stage's replicas sync among themselves (a group of 2 per stage)
    # (stage 1's rounds end just after stage 0's, and a replica that started later may sync its
    # first round alone: wait for a joint round rather than read the events at one moment)
    joint = {
        name: peers[name].wait_event(lambda e: e.kind == "round" and e["group_size"] == 2, 240)
        for name in ("s0a", "s1a")
    }
    # each stage syncs its own half of the parameters (fp32 pseudo-gradients), not the whole model
    whole = 4 * spec_parameter_count(manifest.model, 259)
    for name, event in joint.items():
        sent = event["bytes_sent"]
        assert 0.4 * whole < sent < 0.6 * whole, (name, sent, whole)

    peers["s1b"].popen.send_signal(signal.SIGKILL)
    assert peers["s1b"].wait(30) == -signal.SIGKILL
    # training goes on through the other replica of stage 1: a dead replica costs a retry
    killed_at = peers["s0a"].of("round")[-1]["round"]
    for name in ("s0a", "s0b"):
        peers[name].wait_event(lambda e: e.kind == "round" and e["round"] >= killed_at + 2, 240)

    # the killed peer comes back into its stage (its checkpoint says which), catches up with the
    # swarm's state of that stage and trains in a group with the other replica again
    back = procs.peer("s1b", "--initial-peers", addr)
    assert back.wait_event(lambda e: e.kind == "started", 120)["stage"] == 1
    joint = back.wait_event(lambda e: e.kind == "round" and e["group_size"] == 2, 240)
    assert back.of("adopted_state") or back.of("resumed"), back.tail()
    survivors = [peers[n] for n in ("s0a", "s0b", "s1a")]
    for p in (*survivors, back):
        p.popen.send_signal(signal.SIGINT)
    for p in (*survivors, back):
        assert p.wait(120) == 130, p.tail()
    assert joint["round"] in {e["round"] for e in peers["s1a"].of("round") if e["group_size"] == 2}
    for name in ("s0a", "s0b"):
        losses = _losses(peers[name])
        assert losses[-1] < losses[0] - 0.5, losses
