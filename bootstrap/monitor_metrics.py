"""The swarm monitor's ``/metrics``: Prometheus gauges built from a fresh snapshot per scrape, in
a registry of their own (not prometheus-client's global one)."""

from __future__ import annotations

from typing import Any, Protocol


class Snapshots(Protocol):
    """What the metrics read of a :class:`~bootstrap.monitor.SwarmMonitor`: its snapshot."""

    def snapshot(self, *, with_samples: bool = True) -> dict[str, Any]: ...


class _Collector:
    """Builds the metric families from a fresh snapshot at every scrape."""

    def __init__(self, monitor: Snapshots):
        self.monitor = monitor

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.monitor.snapshot(with_samples=False)
        per_peer = {
            "round": ("locoswarm_peer_round", "Round (outer step) the peer is at."),
            "inner_step": ("locoswarm_peer_inner_step", "Cumulative inner steps of the peer's phi history."),
            "train_loss": ("locoswarm_peer_train_loss", "Mean training loss of the peer's last round, nats/token."),
            "eval_loss": ("locoswarm_peer_eval_loss", "Latest validation loss of phi the peer published, nats/token."),
            "eval_round": (
                "locoswarm_peer_eval_round",
                "Round of phi the peer's latest validation loss was measured at.",
            ),
            "tokens_per_s": ("locoswarm_peer_tokens_per_second", "Inner-loop throughput, tokens/s."),
            "group_size": ("locoswarm_peer_group_size", "Peers in the peer's last sync group, itself included."),
            "bytes_sent": ("locoswarm_peer_round_bytes_sent", "Sync bytes the peer sent in its last sync."),
            "bytes_received": ("locoswarm_peer_round_bytes_received", "Sync bytes the peer received in its last sync."),
            "last_seen": (
                "locoswarm_peer_last_seen_timestamp_seconds",
                "When the monitor last found the peer's record.",
            ),
        }
        families = {
            key: GaugeMetricFamily(name, doc, labels=["run_id", "peer_id"]) for key, (name, doc) in per_peer.items()
        }
        live = GaugeMetricFamily(
            "locoswarm_live_peers",
            "Peers whose latest progress record is fresh (younger than about one round's deadline).",
            labels=["run_id"],
        )
        tokens = GaugeMetricFamily(
            "locoswarm_swarm_tokens_per_second",
            "Inner-loop throughput of the live peers together, tokens/s.",
            labels=["run_id"],
        )
        max_round = GaugeMetricFamily("locoswarm_run_max_round", "Highest round any peer reached.", labels=["run_id"])
        median_round = GaugeMetricFamily(
            "locoswarm_run_median_round", "The swarm's round: the median of the live peers' rounds.", labels=["run_id"]
        )
        grouped = CounterMetricFamily(
            "locoswarm_peer_rounds_by_group_size",
            "Rounds the monitor saw the peer complete, by sync group size.",
            labels=["run_id", "peer_id", "group_size"],
        )
        for run in snap["runs"]:
            live.add_metric([run["run_id"]], run["live_peers"])
            tokens.add_metric([run["run_id"]], run["tokens_per_s"])
            max_round.add_metric([run["run_id"]], run["max_round"])
            if run.get("median_round") is not None:
                median_round.add_metric([run["run_id"]], run["median_round"])
            for peer in run["peers"]:
                labels = [run["run_id"], peer["peer_id"]]
                values = {**peer, **(peer["last_sync"] or {}), "round": peer["round"]}
                for key, family in families.items():
                    if values.get(key) is not None and (peer["live"] or key == "last_seen"):
                        family.add_metric(labels, float(values[key]))
                for size, count in peer["rounds_by_group_size"].items():
                    grouped.add_metric([*labels, size], count)
        yield live
        yield tokens
        yield max_round
        yield median_round
        yield from families.values()
        yield grouped


def metrics_text(monitor: Snapshots) -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(monitor))
    return generate_latest(registry)
