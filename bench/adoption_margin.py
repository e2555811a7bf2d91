"""How far apart the validation losses of honest states lie (issue #51 item 2): the measurement
behind ``peer.round.catchup.LOSS_MARGIN``, the margin by which a state a peer may adopt can be
worse on its validation windows than its own.

Each round, ``peers`` replicas train H inner steps (AdamW at the run's lr, betas, weight decay and
clip; no warm-up or lr schedule) from the same φ on their own shards; the swarm's state is their mean (DiLoCo with outer lr 1, no momentum). A peer
whose sync failed holds its own θ (it fell back to its own Δ) while the swarm holds the mean: the
re-sync rule makes it adopt the mean. The gap measured is loss(mean) − loss(own θ), relative to
loss(own θ): how much worse a state an honest peer must be able to adopt looks on the validation
windows. The attacks of issue #51 for scale: −φ 14.19 vs 2.54, a poisoned state 8.77 vs 2.3.

    .venv/bin/python bench/adoption_margin.py --peers 4 --rounds 40 --seeds 2
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sysconfig

import torch

from peer.train.data import BatchSampler, Corpus, peer_seed, validation_batch
from peer.train.model import build_model, evaluate, lm_loss
from protocol.presets import tiny_run


def stdlib(name: str) -> torch.Tensor:
    raw = (pathlib.Path(sysconfig.get_paths()["stdlib"]) / name).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int16)


def run(peers: int, rounds: int, seed: int) -> list[dict]:
    m = tiny_run().replace(model={"init_seed": seed})
    corpus = Corpus(train=stdlib("argparse.py"), validation=stdlib("textwrap.py"), train_files=1, validation_files=1)
    windows = validation_batch(corpus, m.data)
    model = build_model(m.model, corpus.tokenizer)
    phi = [p.detach().clone() for p in model.parameters()]
    samplers = [
        BatchSampler(
            corpus.train,
            seq_len=m.data.seq_len_tokens,
            batch_sequences=m.batch_sequences,
            seed=peer_seed(f"sim-peer-{i}", seed),
        )
        for i in range(peers)
    ]
    opt_spec = m.inner_optimizer
    rows = []

    def load(tensors):
        with torch.no_grad():
            for p, t in zip(model.parameters(), tensors):
                p.copy_(t)

    states = [None] * peers
    for r in range(rounds):
        thetas = []
        for i in range(peers):
            load(phi)
            opt = torch.optim.AdamW(
                model.parameters(),
                lr=opt_spec.lr,
                weight_decay=opt_spec.weight_decay,
                betas=(opt_spec.beta1, opt_spec.beta2),
                eps=opt_spec.eps,
            )
            if states[i] is not None:
                opt.load_state_dict(states[i])
            for _ in range(m.sync.inner_steps):
                loss = lm_loss(model, samplers[i].next_batch().to(torch.int64))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), opt_spec.grad_clip_norm)
                opt.step()
            states[i] = opt.state_dict()
            thetas.append([p.detach().clone() for p in model.parameters()])
        mean = [torch.stack(ts).mean(0) for ts in zip(*thetas)]
        load(mean)
        swarm = evaluate(model, windows)
        own = []
        for t in thetas:
            load(t)
            own.append(evaluate(model, windows))
        rows.append({"round": r + 1, "swarm": swarm, "own": own, "worst_rel_gap": max((swarm - o) / o for o in own)})
        phi = mean
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"peers": args.peers, "rounds": args.rounds, "runs": []}
    print(f"{'seed':>4} {'round':>5} {'swarm loss':>10} {'best own':>9} {'worst own':>9} {'max rel gap':>11}")
    for seed in range(args.seeds):
        rows = run(args.peers, args.rounds, seed)
        for row in rows:
            if row["round"] in (1, 2, 5, 10, 20, 40) or row["round"] == args.rounds:
                print(
                    f"{seed:>4} {row['round']:>5} {row['swarm']:>10.4f} {min(row['own']):>9.4f} "
                    f"{max(row['own']):>9.4f} {row['worst_rel_gap']:>+11.4f}"
                )
        out["runs"].append({"seed": seed, "rows": rows})
    gaps = [row["worst_rel_gap"] for run_ in out["runs"] for row in run_["rows"]]
    out["max_rel_gap"] = max(gaps)
    print(f"largest relative gap (swarm state worse than a peer's own θ): {max(gaps):+.4f}")
    pathlib.Path("bench/results").mkdir(exist_ok=True)
    pathlib.Path("bench/results/adoption_margin.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
