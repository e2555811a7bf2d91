"""`peer join`'s assembly (peer/node.py `join`/`_assemble`): every resource is released in reverse
order of acquisition on every way out, the checkpoint is written and `stopped` emitted before
anything is released, and the reachability decision (not a rewritten JoinConfig) reaches the parts.

The network, the data and the round loop are replaced by fakes in peer.node's namespace only; the
data directory's lock, the identity, the owner key and the run's signature are the real ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import peer.node as node
from peer.config import JoinConfig
from peer.progress import TrainSummary
from peer.reachability import Reachability
from peer.state.data_dir import hold_data_dir
from protocol.errors import ConfigError, HelperDied

SHUTDOWN_ORDER = [
    "devices.stop",
    "inner.close",
    "swarm.close",
    "watch.stop",
    "transport.shutdown",
    "keeper.stop",
    "announcer.stop",
    "dht.shutdown",
]
"""Released after a full assembly, in this order (the reverse of acquisition; no pipeline stage)."""


class Events:
    """A reporter that keeps the event names in the shared log."""

    def __init__(self, log: list[str]):
        self.log, self.fields = log, {}

    def emit(self, event: str, **fields) -> None:
        self.log.append(f"event {event}")
        self.fields[event] = fields

    def tick_until_first_round(self) -> None:  # the real reporter's "still training" lines: none here
        pass

    def stop_ticking(self) -> None:
        pass


def resource(log: list[str], name: str, **attrs):
    """A class whose instances log their release as ``<name>.<method>``."""

    class Resource:
        def __init__(self, *args, **kwargs):
            self.args, self.kwargs = args, kwargs
            self.__dict__.update(attrs)
            log.append(f"{name} acquired")

        def start(self):
            return self

        start_background = start

        def watch_dht(self, *args):
            return self

        watch = watch_dht

        def raise_if_died(self) -> None:
            pass

        def stop(self) -> None:
            log.append(f"{name}.stop")

        def close(self) -> None:
            log.append(f"{name}.close")

        def shutdown(self) -> None:
            log.append(f"{name}.shutdown")

    Resource.__name__ = name
    return Resource


@pytest.fixture
def rig(tmp_path, monkeypatch):
    """Fakes for everything of `peer join` that needs the network, a corpus or training; returns a
    namespace: ``log`` (acquisitions, releases, events in order), ``built`` (the fakes by name),
    ``cfg``, ``summary`` (what the trainer's run returns), ``fail_at`` (a step that raises) and
    ``reach`` (what reach_out decides; ``restart``: it hands back a new DHT node)."""
    log: list[str] = []
    built: dict[str, object] = {}
    r = SimpleNamespace(
        log=log,
        built=built,
        cfg=JoinConfig(data_dir=tmp_path / "data"),
        summary=TrainSummary(peer_id="p"),
        fail_at=None,
        reach=Reachability("unchecked"),
        restart=False,
    )

    def keep(name, cls):
        def make(*args, **kwargs):
            built[name] = cls(*args, **kwargs)
            return built[name]

        return make

    def start_dht(start, initial_peers, book):
        peer_id = node.PeerSigner.from_identity(r.cfg.data_dir / "identity.key").peer_id
        return keep("dht", resource(log, "dht", peer_id=peer_id))()

    def reach_out(dht, cfg, reporter, *, identity_path):
        if r.restart:
            return keep("dht2", resource(log, "dht2", peer_id=dht.peer_id))(), r.reach
        return dht, r.reach

    class Trainer:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            self.inner = resource(log, "inner")()
            built["trainer"] = self

        def fit_micro_batch(self):
            if r.fail_at == "fit_micro_batch":
                raise RuntimeError("late failure")
            return None

        def run(self) -> TrainSummary:
            log.append("run")
            return r.summary

        def save(self):
            log.append("save")
            return "checkpoint.safetensors"

    placement = SimpleNamespace(devices=["cpu"], device="cpu", event_fields=lambda: {"device": "cpu"})
    fakes = dict(
        tune_host_allocator=lambda: None,
        with_local_data=lambda *a, **k: SimpleNamespace(source="text"),
        describe=str,
        load_data=lambda data, **kwargs: SimpleNamespace(tokenizer=None, make_sampler=None),
        start_dht_remembering=start_dht,
        reachability=SimpleNamespace(
            reach_out=reach_out,
            start_node=None,
            printable_maddrs=lambda dht, reach: [],
            relay_maddrs=lambda dht, reach: list(reach.relays),
        ),
        protect_run=lambda dht, key: None,
        swarm_dht=SimpleNamespace(ManifestAnnouncer=keep("announcer", resource(log, "announcer"))),
        AddressKeeper=keep("keeper", resource(log, "keeper")),
        build_model=lambda cfg, tok: torch.nn.Linear(2, 2),
        NetworkTransport=keep("transport", resource(log, "transport", averager=None, max_sync_seconds=1.0)),
        lifetime=SimpleNamespace(
            HelperWatch=keep("watch", resource(log, "watch")),
            PEER_RESTART="run again",
            freeze_for_fork=lambda: None,
        ),
        SwarmView=keep("swarm", resource(log, "swarm")),
        place=lambda device, **k: (placement, ["a note"]),
        Trainer=Trainer,
        DeviceAnnouncer=keep("devices", resource(log, "devices")),
        DeviceRecord=SimpleNamespace(from_event=lambda fields: None),
    )
    for name, fake in fakes.items():
        monkeypatch.setattr(node, name, fake)
    return r


def released(log: list[str]) -> list[str]:
    return [e for e in log if e.endswith((".stop", ".close", ".shutdown"))]


def assert_data_dir_free(cfg: JoinConfig) -> None:
    with hold_data_dir(cfg.data_dir):  # ConfigError if join still held it
        pass


@pytest.mark.parametrize("interrupted, code", [(False, 0), (True, node.EXIT_INTERRUPTED)])
def test_a_finished_join_releases_everything_in_reverse_order_after_the_checkpoint(rig, interrupted, code):
    rig.summary.interrupted = interrupted
    assert node.join(rig.cfg, Events(rig.log)) == (code, rig.summary)
    assert released(rig.log) == SHUTDOWN_ORDER
    stopped = rig.log.index("event stopped")
    assert rig.log.index("run") < rig.log.index("save") < stopped < rig.log.index("devices.stop")
    acquired = [e.split()[0] for e in rig.log if e.endswith(" acquired")]
    assert acquired == ["dht", "announcer", "keeper", "transport", "watch", "swarm", "inner", "devices"]
    assert_data_dir_free(rig.cfg)


def test_a_late_failure_releases_what_was_acquired_before_it(rig):
    rig.fail_at = "fit_micro_batch"  # after the trainer, before the device announcer
    with pytest.raises(RuntimeError, match="late failure"):
        node.join(rig.cfg, Events(rig.log))
    assert released(rig.log) == SHUTDOWN_ORDER[1:]
    assert "event started" not in rig.log and "save" not in rig.log
    assert_data_dir_free(rig.cfg)


def test_a_dead_helper_is_raised_after_the_checkpoint_and_the_stopped_event(rig):
    rig.summary.interrupted, rig.summary.fatal = True, HelperDied("this peer's averager process died")
    reporter = Events(rig.log)
    with pytest.raises(HelperDied, match="averager"):
        node.join(rig.cfg, reporter)
    assert rig.log.index("save") < rig.log.index("event stopped") < rig.log.index("devices.stop")
    assert released(rig.log) == SHUTDOWN_ORDER
    assert reporter.fields["stopped"]["interrupted"] is True and "fatal" not in reporter.fields["stopped"]
    assert_data_dir_free(rig.cfg)


def test_a_peer_that_fell_back_to_client_mode_is_built_from_the_reachability_found(rig):
    rig.restart = True  # reach_out shut the first node down and started a relayed one
    rig.reach = Reachability("unreachable", client_mode=True, relays=("/ip4/198.51.100.1/tcp/1/p2p/QmA",))
    reporter = Events(rig.log)
    assert node.join(rig.cfg, reporter)[0] == 0
    assert not rig.cfg.client_mode  # the config is not rewritten
    b = rig.built
    assert b["transport"].kwargs["client_mode"] is True and b["keeper"].kwargs["publish"] is False
    assert b["trainer"].kwargs["config"].serves_state is False
    assert b["announcer"].args[0] is b["dht2"] and b["transport"].args[0] is b["dht2"]
    assert reporter.fields["started"]["relayed_at"] == list(rig.reach.relays)
    assert released(rig.log)[-2:] == ["dht2.shutdown", "dht.shutdown"]  # shutting the first down again does nothing


def test_the_data_dir_held_by_another_peer_is_refused_before_anything_starts(rig):
    with hold_data_dir(rig.cfg.data_dir):
        with pytest.raises(ConfigError, match="in use by another peer"):
            node.join(rig.cfg, Events(rig.log))
    assert rig.log == []
