"""Which preset fits an 8, 12 or 24 GiB card: the largest micro-batch each preset's inner step takes
on a card of that size, **computed** from the code's own memory estimate, not measured.

    python bench/gpu_fit.py [--cards 8,12,24] [--out bench/results/gpu_fit.json]

For each real-size preset (protocol/presets.py) the parameter count comes from
:func:`peer.train.model.spec_parameter_count` (no model is built) and the memory of one inner step
from :func:`peer.train.device.training_memory_bytes` (bf16 autocast, AdamW: 20 bytes per parameter
of states, plus activations per sequence). A micro-batch of ``n`` sequences fits a card of ``G`` GiB
when states + n·activations ≤ 0.9·G, the margin ``peer join``'s start-up probe keeps
(:func:`peer.train.device.probe_micro_batch`). With ``--activation-checkpointing`` only each decoder
layer's fp32 input (4·hidden bytes per token and layer) is kept, plus one layer's activations while
it is recomputed and the logits: this script's reading of the same terms, also computed.

The one measured point in bench/results (gpu.json, an H200: llama-125m, 64 sequences in one
micro-batch) is printed beside its computed figure, so the estimate's error is in view. Writes
``--out`` with keys: cards_gib, margin, results[preset, params, states_gib, activations_gib_per_seq,
activations_gib_per_seq_ckpt, fit{card: {micro_batch, micro_batch_ckpt}}], check[preset,
micro_batch, measured_gib, computed_gib, device].
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from peer.train.device import GIB, training_memory_bytes
from peer.train.model import spec_parameter_count
from protocol.presets import PRESETS

MARGIN = 0.9
"""Share of the card's memory the start-up probe lets one inner step take."""


def preset_memory(name: str) -> dict:
    """Computed memory of ``name``'s inner step: states and activations per sequence, in GiB."""
    m = PRESETS[name]()
    spec = m.model
    params = spec_parameter_count(spec, m.data.vocab_size)
    states, per_seq = training_memory_bytes(
        params=params,
        layers=spec.num_layers,
        hidden=spec.hidden_size,
        intermediate=spec.intermediate_size,
        vocab_size=m.data.vocab_size,
        micro_batch=1,
        seq_len=m.data.seq_len_tokens,
    )
    # checkpointed: every layer's input kept, one layer's activations live while it is recomputed
    one_layer = 22.0 * spec.hidden_size + 8.0 * spec.intermediate_size
    per_token_ckpt = spec.num_layers * 4.0 * spec.hidden_size + one_layer + 10.0 * m.data.vocab_size
    return {
        "preset": name,
        "params": params,
        "batch_sequences": m.batch_sequences,
        "states_gib": states / GIB,
        "activations_gib_per_seq": per_seq / GIB,
        "activations_gib_per_seq_ckpt": per_token_ckpt * m.data.seq_len_tokens / GIB,
    }


def largest_micro_batch(states_gib: float, per_seq_gib: float, card_gib: float, upper: int) -> int:
    """Sequences per micro-batch that fit ``card_gib`` (0: not even one), at most ``upper``."""
    room = MARGIN * card_gib - states_gib
    return max(0, min(upper, int(room // per_seq_gib)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cards", default="8,12,24", help="card sizes in GiB, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_fit.json"))
    args = ap.parse_args()
    cards = [float(c) for c in args.cards.split(",")]
    rows = []
    for name in ("llama-125m", "llama-350m", "llama-1b"):
        row = preset_memory(name)
        row["fit"] = {
            f"{c:g}": {
                "micro_batch": largest_micro_batch(
                    row["states_gib"], row["activations_gib_per_seq"], c, row["batch_sequences"]
                ),
                "micro_batch_ckpt": largest_micro_batch(
                    row["states_gib"], row["activations_gib_per_seq_ckpt"], c, row["batch_sequences"]
                ),
            }
            for c in cards
        }
        rows.append(row)
    check = []
    measured = Path("bench/results/gpu.json")
    if measured.exists():
        gpu = json.loads(measured.read_text())
        for r in gpu["results"]:
            if r["preset"] in PRESETS and r.get("peak_memory_gib"):
                mem = preset_memory(r["preset"])
                computed = mem["states_gib"] + r["micro_batch"] * mem["activations_gib_per_seq"]
                check.append(
                    {
                        "preset": r["preset"],
                        "micro_batch": r["micro_batch"],
                        "measured_gib": r["peak_memory_gib"],
                        "computed_gib": computed,
                        "device": gpu["device"],
                    }
                )
    print(f"computed, not measured: largest micro-batch (sequences) within {MARGIN:.0%} of the card")
    print(
        f"{'preset':<11} {'params':>8} {'states':>9} {'per seq':>9}  " + "  ".join(f"{c:g} GiB (ckpt)" for c in cards)
    )
    for r in rows:
        fits = "  ".join(
            f"{r['fit'][f'{c:g}']['micro_batch']:>4} ({r['fit'][f'{c:g}']['micro_batch_ckpt']:>3})    " for c in cards
        )
        print(
            f"{r['preset']:<11} {r['params'] / 1e6:>7.1f}M {r['states_gib']:>6.1f} GiB "
            f"{r['activations_gib_per_seq']:>5.2f} GiB  {fits}"
        )
    for c in check:
        print(
            f"check: {c['preset']} at {c['micro_batch']} sequences on {c['device']}: measured "
            f"{c['measured_gib']:.1f} GiB, computed {c['computed_gib']:.1f} GiB"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"computed": True, "cards_gib": cards, "margin": MARGIN, "results": rows, "check": check}
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
