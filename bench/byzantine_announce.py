"""The bogus run announcement of bench/byzantine.py, on real DHT nodes on 127.0.0.1 (issue #17, item 1).

An honest bootstrap node (``peer.net.dht_node.start_dht``, the node ``peer join`` starts, with its record
validator) announces the run, signed by its owner. Each attacker is a stock hivemind node joined to
it, which stores in its own storage whatever it likes and asks the honest node to store the same
(the honest node's validator may refuse). Per attacker, in the runs index:

* a run of the same name (other settings), validly signed by the attacker's own key;
* a copy of the honest run's content, validly signed by the attacker (another owner, another run id);
* under the honest run's id, for 7 days: the attacker's signed manifest (attacker 0, 2, ...) or the
  honest manifest with the attacker spliced in as owner (attacker 1, 3, ...);
* an unsigned announcement (the format before owners).

Then a fresh node joins and decides, with peer/node.py's own run choice (``_find_run``: the signed
announcements it reads, peer/run_choice.py, the signature check of the manifest it fetches), once
per way of joining: with the ``--run-id`` it was given, a plain join, with the run's manifest file
(ownerless content, as ``--run FILE`` gives it), and a plain join of a peer holding a checkpoint of
the honest run.
"""

from __future__ import annotations

import tempfile
import time
import types
from pathlib import Path

from protocol.errors import LocoError
from protocol.manifest import RunManifest, sign_manifest
from protocol.signing import REJECTED, OwnerKey

WEEK_S = 7 * 86400.0


def _announce_bogus(stock, honest, index: int) -> None:
    """What attacker ``index`` stores from its stock node ``stock`` (see the module docstring)."""
    from hivemind.utils import get_dht_time

    from protocol import keys

    key = OwnerKey.generate()
    now = get_dht_time()
    same_name = sign_manifest(honest.manifest.with_owner("").replace(sync={"inner_steps": 50}), key)
    copy = sign_manifest(honest.manifest.with_owner(""), key)
    for signed in (same_name, copy):
        stock.store(keys.RUNS_KEY, signed.to_wire(), now + WEEK_S, subkey=signed.run_id)
    if index % 2 == 0:
        forged = same_name.to_wire()
    else:
        forged = {"m": honest.manifest.with_owner(key.public_hex).encode(), "s": honest.signature}
    stock.store(keys.RUNS_KEY, forged, now + WEEK_S, subkey=honest.run_id)
    unsigned = RunManifest(name=honest.manifest.name)
    stock.store(keys.RUNS_KEY, unsigned.name, now + WEEK_S, subkey=unsigned.run_id)


def _joins(honest, data_dir: Path, holder_dir: Path) -> list[tuple[str, types.SimpleNamespace]]:
    content = honest.manifest.with_owner("")

    def cfg(**kw):
        base = dict(
            new_run=None,
            manifest_wait_s=0.0,
            run_flag="--run compare.toml",
            run_id=None,
            start_new_run=False,
            data_dir=data_dir,
            owner_key_path=None,
        )
        return types.SimpleNamespace(**{**base, **kw})

    return [
        ("--run-id (given by the owner)", cfg(run_id=honest.run_id)),
        ("plain join", cfg()),
        ("--run FILE (the run's content, no owner)", cfg(new_run=content)),
        ("plain join, holds a checkpoint of the run", cfg(data_dir=holder_dir)),
    ]


def announcement_attack(manifest: RunManifest, *, malicious: int) -> list[dict]:
    """Run the attack with ``malicious`` attacker nodes; one dict per way of joining:
    ``{"malicious", "join", "chose": "honest" | "attacker" | "none", "outcome", "announcements_rejected"}``
    (the run chosen, or the error that refused the join; the announcements the joiner read and
    ignored as unsigned or wrongly signed)."""
    import hivemind

    from peer import node
    from peer.net import dht as swarm_dht, dht_node

    honest = sign_manifest(manifest.with_owner(""), OwnerKey.generate())
    reporter = types.SimpleNamespace(emit=lambda *args, **fields: None)
    nodes = []
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, holder_dir = Path(tmp) / "fresh", Path(tmp) / "holder"
        checkpoint = holder_dir / "runs" / honest.run_id / "checkpoint.safetensors"
        checkpoint.parent.mkdir(parents=True)
        checkpoint.write_bytes(b"")  # run choice only looks for the file
        try:
            boot = dht_node.start_dht()
            nodes.append(boot)
            if not swarm_dht.store_manifest(boot, honest):
                raise RuntimeError("the honest node did not store its own run's announcement")
            maddrs = swarm_dht.visible_maddrs(boot)
            for index in range(malicious):
                stock = hivemind.DHT(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
                nodes.append(stock)
                _announce_bogus(stock, honest, index)
            joiner = dht_node.start_dht(initial_peers=maddrs)
            nodes.append(joiner)
            time.sleep(1.0)
            for join, cfg in _joins(honest, data_dir, holder_dir):
                before = REJECTED.counts.get("manifest", 0)
                try:
                    chosen = node._find_run(joiner, cfg, reporter)
                except LocoError as exc:
                    chose, outcome = "none", f"{type(exc).__name__}: {exc}"[:400]
                else:
                    chose = "honest" if chosen.run_id == honest.run_id else "attacker"
                    outcome = f"run {chosen.run_id} ({chosen.manifest.name})"
                out.append(
                    {
                        "malicious": malicious,
                        "join": join,
                        "chose": chose,
                        "outcome": outcome,
                        "announcements_rejected": REJECTED.counts.get("manifest", 0) - before,
                    }
                )
        finally:
            for n in reversed(nodes):
                n.shutdown()
    return out
