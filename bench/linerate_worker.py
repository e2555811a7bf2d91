"""One peer of bench/linerate.py, run inside its network namespace. Not meant to be run by hand."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch


def wait_for(path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--address", required=True)
    ap.add_argument("--size-mb", type=float, required=True)
    ap.add_argument("--codecs", required=True)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--piece-elements", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import hivemind

    from peer.net.dht import quiet_hivemind_logs
    from peer.net.identity import ensure_identity
    from peer.sync.transport import NetworkTransport, SyncRequest
    from protocol.manifest import CompressionSpec, SyncSpec
    from protocol.signing import PeerSigner

    quiet_hivemind_logs()
    host = [f"/ip4/{args.address}/tcp/0"]
    # an identity as a peer has one: its key seals the means this worker sends as an owner
    identity = ensure_identity(args.dir / f"identity-{args.index}.key")
    signer = PeerSigner.from_identity(identity)
    if args.index == 0:
        dht = hivemind.DHT(start=True, host_maddrs=host, identity_path=str(identity))
        maddrs = [str(a) for a in dht.get_visible_maddrs() if args.address in str(a)]
        (args.dir / "maddr.tmp").write_text(maddrs[0])
        (args.dir / "maddr.tmp").rename(args.dir / "maddr")
    else:
        wait_for(args.dir / "maddr")
        dht = hivemind.DHT(
            start=True, host_maddrs=host, initial_peers=[(args.dir / "maddr").read_text()], identity_path=str(identity)
        )
    elements = int(args.size_mb * 1e6 / 4)
    rows = 1000
    shapes = [torch.Size([rows, 1000])] * (elements // (rows * 1000))
    gen = torch.Generator().manual_seed(args.index)
    payload = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    sync = SyncSpec(matchmaking_time_s=5.0, allreduce_timeout_s=300.0, next_chunk_timeout_s=60.0)
    out = (args.dir / f"result-{args.index}.jsonl").open("a")
    for codec in args.codecs.split(","):
        spec = CompressionSpec(codec=codec)
        run_id = hashlib.sha256(f"linerate-{codec}".encode()).hexdigest()[:32]
        transport = NetworkTransport(
            dht,
            shapes,
            shapes,
            run_id,
            sync,
            compression=spec,
            piece_elements=args.piece_elements or None,
            signer=signer,
        )
        for trial in range(args.trials):
            tag = f"{codec}-{trial}"
            (args.dir / f"ready-{tag}-{args.index}").touch()
            for i in range(args.n):
                wait_for(args.dir / f"ready-{tag}-{i}")
            time.sleep(1.0)  # let every peer's averager see the others
            row = {"index": args.index, "codec": codec, "trial": trial}
            try:
                result = transport.average(
                    payload, request=SyncRequest(weight=1.0, round_=trial, expected_group_size=args.n)
                )
                row.update(
                    ok=True,
                    group_size=result.group_size,
                    bytes_sent=result.bytes_sent,
                    bytes_received=result.bytes_received,
                    allreduce_s=result.allreduce_s,
                    send_s=result.send_s,
                    sync_s=result.seconds,
                    started_at=result.allreduce_started_at,
                )
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            out.write(json.dumps(row) + "\n")
            out.flush()
            (args.dir / f"done-{tag}-{args.index}").touch()
            for i in range(args.n):
                wait_for(args.dir / f"done-{tag}-{i}")
        transport.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
