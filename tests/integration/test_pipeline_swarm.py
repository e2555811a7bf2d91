"""A pipelined swarm of real peer processes on loopback (issue #19): 2 stages × 2 replicas of the
tiny model (2 blocks), each stage syncing among its own replicas (DiLoCo), a replica killed and
restarted mid-run, and the loss against the unpipelined swarm at equal tokens."""

import signal

import pytest

from tests.integration.harness import make_manifest, write_manifest

pytestmark = pytest.mark.integration

PIPELINE = dict(model={"num_layers": 2}, pipeline={"stages": 2, "call_timeout_s": 15.0})


def _losses(child):
    return [e["train_loss"] for e in child.of("round")]


def test_two_stages_two_replicas_train_and_survive_a_killed_replica(procs, tmp_path):
    manifest = make_manifest(sync={"inner_steps": 10, "matchmaking_time_s": 3.0}, **PIPELINE)
    _, addr = procs.bootstrap(write_manifest(tmp_path, manifest))
    peers = {name: procs.peer(name, "--initial-peers", addr, "--stage", str(stage), "--wait-for-peers", "2")
             for name, stage in (("s0a", 0), ("s0b", 0), ("s1a", 1), ("s1b", 1))}
    for name, p in peers.items():
        started = p.wait_event(lambda e: e.kind == "started", 120)
        assert started["stage"] == int(name[1])
    # every stage-0 peer finishes rounds: activations reach stage 1, gradients come back
    peers["s0a"].wait_event(lambda e: e.kind == "round" and e["round"] >= 2, 240)
    peers["s1b"].popen.send_signal(signal.SIGKILL)
    peers["s1b"].wait(30)
    # training goes on through the other replica of stage 1
    killed_at = peers["s0a"].of("round")[-1]["round"]
    peers["s0a"].wait_event(lambda e: e.kind == "round" and e["round"] >= killed_at + 2, 240)
    # the killed peer comes back into its stage (its checkpoint says which) and trains with it again
    back = procs.peer("s1b", "--initial-peers", addr)
    assert back.wait_event(lambda e: e.kind == "started", 120)["stage"] == 1
    try:
        back.wait_event(lambda e: e.kind == "round" and e["group_size"] == 2, 150)
    except BaseException:
        print("BACK", back.tail())
        for n in ("s0a", "s0b", "s1a"):
            print(n, [(e["round"], e["group_size"], e.get("note")) for e in peers[n].of("round")])
            print(n, peers[n].tail()[-3000:])
        raise
    for p in (*[peers[n] for n in ("s0a", "s0b", "s1a")], back):
        p.popen.send_signal(signal.SIGINT)
    for p in (*[peers[n] for n in ("s0a", "s0b", "s1a")], back):
        assert p.wait(120) == 130, p.tail()
    for name in ("s0a", "s0b"):
        losses = _losses(peers[name])
        assert losses[-1] < losses[0] - 0.5, losses
