"""Bootstrap node: a well-known, persistent entry into the DHT that also announces a run manifest.

Imports ``protocol``, the peer's network layer (``peer.net``) and ``peer.progress``; never its training code.

__main__.py: ``python -m bootstrap``
cli.py: the `bootstrap` command: `bootstrap run` and `bootstrap monitor`
monitor.py: the live swarm monitor: progress records polled, kept as history, served over HTTP
monitor_history.py: what the monitor keeps per run and per peer between polls
monitor_metrics.py: the monitor's ``/metrics``: Prometheus gauges from a fresh snapshot per scrape
monitor_page.py: the monitor's web page: one self-contained HTML document
node.py: a bootstrap node: DHT entry, run manifest announced, circuit relay, optional monitor
"""
