"""What docs/results.md says about each result file in bench/results/: :data:`REGISTRY`, keyed by the
file's name without ``.json``. Adding a benchmark is an entry here and a rerun of bench/results_doc.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_tables import (  # noqa: E402
    Entry,
    Table,
    adoption_rows,
    codec_rows,
    eager_outer_rows,
    flat,
    from_round_rows,
    gpu_fit_rows,
    key,
    plot_curves,
    plot_utilization,
    round_end_rows,
    sweep_best,
)

RESIDUAL_FIGURES = (
    "bf16_vs_fp32_pct",
    "bf16_vs_fp32_pct_per_seed",
    "goal_pct",
    "met",
    "codec",
    "peers",
    "seeds",
    "tokens_per_run",
    "commits",
)
COMPARE_COLUMNS = [
    ("method", "method"),
    ("peers", "peers"),
    ("seeds", "seeds"),
    ("final_bpb", "final bits/byte"),
    ("vs_data_parallel_pct", "vs data-parallel (%)"),
    ("outer", "outer optimizer"),
]
COMPARE_MEASURES = (
    "Validation bits per byte at equal tokens of DiLoCo, NoLoCo and independent peers against "
    "data-parallel training on the same tokens (in-process simulation: the swarm's own outer "
    "algorithms, group plan and codecs; lower is better)."
)
OVERLAP_QUALITY = Table(
    key("quality"),
    [
        ("overlap", "overlap"),
        ("method", "method"),
        ("peers", "peers"),
        ("final_bpb", "final bits/byte"),
        ("vs_none", "vs blocking (%)"),
        ("tokens_per_run", "tokens"),
    ],
    "validation loss at equal tokens",
)
OVERLAP_VARIANTS = {
    "overlap_alpha": "streaming's mixing weight α",
    "overlap_codec_fp4": "overlap with the fp4 codec",
    "overlap_codec_int8": "overlap with the int8 codec",
    "overlap_cpu32k": "the cpu-32k scale",
    "overlap_cpu32k_from8": "the cpu-32k scale, overlap from round 8",
    "overlap_cpu32k_muon": "the cpu-32k scale with Muon",
    "overlap_cpu32k_p1": "the cpu-32k scale, one streaming fragment",
    "overlap_cpu32k_rounds160": "the cpu-32k scale, 160 rounds",
    "overlap_cpu32k_shift": "the cpu-32k scale, the 'shift' merge",
    "overlap_muon": "with Muon",
    "overlap_rounds192": "192 rounds",
    "overlap_rounds384": "384 rounds",
    "overlap_rounds48": "48 rounds",
    "overlap_rounds96": "96 rounds",
    "overlap_rounds96_from1": "96 rounds, overlap from round 1",
    "overlap_shift": "the 'shift' merge",
}

BYZANTINE_COLUMNS = [
    ("attack", "attack"),
    ("algorithm", "algorithm"),
    ("schedule", "schedule"),
    ("malicious", "malicious"),
    ("peers", "peers"),
    ("loss_change", "loss change"),
    ("loss_change_spread", "spread (min, max)"),
    ("seeds", "seeds"),
    ("takeovers", "takeovers"),
    ("non_finite_rounds", "non-finite rounds"),
    ("honest_exits", "honest exits"),
]
"""The columns of bench/byzantine.py's rows, blocking and delayed alike."""

REGISTRY: dict[str, Entry] = {
    "gpu": Entry(
        "The inner loop on a GPU",
        "Tokens/s, model FLOPs utilisation and peak memory of a peer's inner loop per preset, and its "
        "speed as a share of a bare PyTorch loop on the same model, batches and precision.",
        "python bench/gpu.py --presets llama-125m,default",
        [
            Table(
                key("results"),
                [
                    ("preset", "preset"),
                    ("params", "parameters"),
                    ("precision", "precision"),
                    ("micro_batch", "micro-batch"),
                    ("tokens_per_s", "tokens/s"),
                    ("mfu", "MFU"),
                    ("peak_memory_gib", "peak GiB"),
                    ("inner_vs_bare", "vs bare loop"),
                ],
            )
        ],
    ),
    "gpu_fit": Entry(
        "Which preset fits an 8, 12 or 24 GiB card (computed)",
        "The largest micro-batch (sequences of 1,024 tokens) per preset and card, from the peer's own "
        "memory estimate (peer/train/device.py training_memory_bytes) within the start-up probe's 90 %; "
        "with --activation-checkpointing in brackets. Computed, not measured; the check rows set it "
        "against the measured H200 figure.",
        "python bench/gpu_fit.py",
        [
            Table(
                gpu_fit_rows,
                [
                    ("preset", "preset"),
                    ("params", "parameters"),
                    ("states_gib", "states GiB"),
                    ("activations_gib_per_seq", "GiB per sequence"),
                    ("8 GiB", "8 GiB"),
                    ("12 GiB", "12 GiB"),
                    ("24 GiB", "24 GiB"),
                ],
            ),
            Table(
                key("check"),
                [
                    ("preset", "preset"),
                    ("micro_batch", "micro-batch"),
                    ("measured_gib", "measured GiB"),
                    ("computed_gib", "computed GiB"),
                    ("device", "device"),
                ],
                "the estimate against the measured peak",
            ),
        ],
        device="none (computed)",
    ),
    "compare-cpu": Entry(
        "DiLoCo and NoLoCo against data-parallel: CPU scale",
        COMPARE_MEASURES,
        "python bench/compare.py --jobs 2 --threads 1",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-cpu-muon": Entry(
        "DiLoCo and NoLoCo against data-parallel: CPU scale, Muon inner optimizer",
        COMPARE_MEASURES,
        "python bench/compare.py --jobs 2 --threads 1 --set 'inner_optimizer.kind=\"muon\"'",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-cpu-32k": Entry(
        "DiLoCo and NoLoCo against data-parallel: cpu-32k scale (8,192 tokens per peer)",
        COMPARE_MEASURES,
        "python bench/compare.py --config bench/compare-cpu-32k.toml --jobs 2 --threads 1",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-cpu-32k-muon": Entry(
        "DiLoCo and NoLoCo against data-parallel: cpu-32k scale, Muon",
        COMPARE_MEASURES,
        "python bench/compare.py --config bench/compare-cpu-32k.toml --jobs 2 --threads 1 "
        "--set 'inner_optimizer.kind=\"muon\"'",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-cpu-32k-engine": Entry(
        "cpu-32k rows on the round engine a peer runs",
        "The same comparison with DiLoCo and NoLoCo rows run on N round loops over the "
        "in-process hub (lab/engine_sim.py), the code a peer runs.",
        "python bench/compare.py --config bench/compare-cpu-32k.toml --jobs 2 --threads 1",
        [Table(key("results"), [*COMPARE_COLUMNS, ("source", "ran on")])],
    ),
    "compare-cpu-32k-bpe2048": Entry(
        "cpu-32k scale with a 2,048-id BPE",
        COMPARE_MEASURES,
        "python bench/compare.py --config bench/compare-cpu-32k.toml --methods data-parallel diloco --peers 4 "
        "--set data.vocab_size=2048",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-gpu": Entry(
        "DiLoCo and NoLoCo against data-parallel: GPU scale (partial)",
        COMPARE_MEASURES,
        "python bench/compare.py --config bench/compare-gpu.toml --device cuda --jobs 16 --no-compile",
        [Table(key("results"), COMPARE_COLUMNS)],
    ),
    "compare-gpu-proxy": Entry(
        "A CPU proxy of the GPU scale",
        "Validation bits per byte over training of data-parallel and DiLoCo rows at the GPU scale's "
        "shape ratios, shrunk to run on a CPU, with BPE and byte tokenizers (the plot: each method's best "
        "row among the longest runs of committed code, seed means).",
        "python bench/compare.py --config bench/compare-gpu-proxy.toml --jobs 1 --threads 1 --no-plot --peers 4 --seeds 0 1",
        [
            Table(
                key("results"),
                [
                    ("label", "row"),
                    ("tokenizer", "tokenizer"),
                    ("method", "method"),
                    ("peers", "peers"),
                    ("final_bpb", "final bits/byte"),
                    ("finished", "finished"),
                ],
            )
        ],
        plot=plot_curves,
    ),
    "sweep-outer": Entry(
        "Outer optimizer sweep: the defaults",
        "Validation bits per byte at equal tokens of every outer lr × momentum (DiLoCo) and α, β, γ "
        "(NoLoCo) tried; the table shows the best setting per method and peer count.",
        "python bench/sweep_outer.py --peers 4 --seeds 0 1 --jobs 2",
        [
            Table(
                sweep_best,
                [
                    ("method", "method"),
                    ("peers", "peers"),
                    ("outer", "best outer setting"),
                    ("inner_lr", "inner lr"),
                    ("global_batch_tokens", "global batch (tokens)"),
                    ("final_bpb", "final bits/byte"),
                    ("vs_data_parallel_pct", "vs data-parallel (%)"),
                ],
            )
        ],
    ),
    "codecs": Entry(
        "Codecs: ratio, error and speed",
        "Bytes, compression ratio, relative error and encode/decode speed of every pseudo-gradient codec, "
        "on random tensors of the default run's shapes and on a real pseudo-gradient.",
        "python bench/codecs.py --threads 1 --repeats 5",
        [
            Table(
                codec_rows,
                [
                    ("input", "input"),
                    ("codec", "codec"),
                    ("bytes", "bytes"),
                    ("ratio", "ratio"),
                    ("rel_error", "relative error"),
                    ("encode_mb_s", "encode MB/s"),
                    ("decode_mb_s", "decode MB/s"),
                ],
            )
        ],
    ),
    "soak": Entry(
        "Churn soak: 8 peers under a random fault every ~30 s",
        "Loss at equal tokens of a swarm under kill -9, SIGSTOP, link cuts, joins and the bootstrap node "
        "killed, against the same swarm without faults; hangs, NaNs, bad checkpoints and orphan processes.",
        "sudo .venv/bin/python bench/soak.py --peers 8 --rate 50 --minutes 30 --fault-every 30",
        [Table(flat, [("key", "figure"), ("value", "value")])],
        device="2-core CPU, network namespaces with 50 Mbit/s tbf links",
        extra=("soak.detail.json",),
    ),
    "fuzz": Entry(
        "Fuzzing every decoder and handler of what another peer sends",
        "Messages tried, crashes, hangs, memory growth and refusals per decoder and handler.",
        "python bench/fuzz.py",
        [
            Table(
                key("results"),
                [
                    ("target", "target"),
                    ("messages", "messages"),
                    ("crashes", "crashes"),
                    ("hangs", "hangs"),
                    ("memory_growth_mb", "memory growth MB"),
                    ("refused", "refused"),
                ],
            )
        ],
        device="2-core CPU (x86_64)",
    ),
    "byzantine": Entry(
        "Byzantine peers at 20 rounds",
        "Change in validation loss (fraction, mean over seeds, with its (min, max) over seeds) and takeovers "
        "when malicious peers run each attack, against a clean swarm of the same seed; the `independent` row "
        "is the same peers never syncing (the floor: what averaging is worth at this horizon, over 3 % here). "
        "Round engine, 8 peers, 20 rounds of H = 25, DiLoCo and NoLoCo, blocking and delayed from round 10, the owners clipping at 1.5x the "
        "median norm. The `lying-receipts` rows were measured on real peers (1 liar of 4, 2 colluding liars "
        "of 5), not on the engine (bench/lying_receipts.py).",
        "python bench/byzantine.py --rounds 20 --seeds 0 1 2 --algorithms diloco noloco --schedules none --attacks "
        "alie ipm subclip-flip owner-small-flip --malicious 1 2 --plain --jobs 2, then --schedules delayed "
        "--overlap-from-round 10 --attacks alie ipm owner-small-flip (the rest the same), the two joined with --merge",
        [
            Table(
                key("results"),
                BYZANTINE_COLUMNS,
            )
        ],
        extra=("byzantine.detail.json",),
    ),
    "byzantine-h10": Entry(
        "Byzantine peers at 10 rounds, every attack (the owners' clip at 3x)",
        "Change in validation loss (fraction, mean over seeds, with its (min, max) over seeds) and takeovers "
        "when malicious peers run each attack, against a clean swarm of the same seed; the `independent` row "
        "is the same peers never syncing (the floor: what averaging is worth at this horizon). Round engine, "
        "8 peers, 10 rounds of H = 25, blocking DiLoCo, before the owners' clip went from 3x to 1.5x the "
        "median norm. Its `lying-receipts` row is the real-peer file of that time.",
        "python bench/byzantine.py --algorithms diloco --schedules none --attacks alie ipm stale-phi sign-flip huge "
        "noise zeros subclip-flip subclip-sideways cosine owner-flip owner-flip-x100 owner-zeros owner-noise "
        "owner-scale owner-huge-small owner-small-flip owner-equivocate --malicious 1 2 --plain --seeds 0 1 2 --jobs 2 --threads 1",
        [
            Table(
                key("results"),
                BYZANTINE_COLUMNS,
            )
        ],
        extra=("byzantine-h10.detail.json",),
    ),
    "byzantine-delayed": Entry(
        "Byzantine peers, delayed sync",
        "Change in validation loss (fraction, mean over seeds, with its (min, max) over seeds) and takeovers "
        "when malicious peers run each attack, against a clean swarm of the same seed; the `independent` row "
        "is the same peers never syncing (the floor: what averaging is worth at this horizon). Round engine, "
        "8 peers, sync.overlap = delayed (its own commit: bench/results/byzantine-h10.json has the blocking rows). "
        "The `lying-receipts` row is the real-peer one of the blocking file, repeated.",
        "python bench/byzantine.py --algorithms diloco --schedules delayed --attacks owner-small-flip subclip-flip "
        "--malicious 1 --seeds 0 1 2 --jobs 2 --threads 1 --out bench/results/byzantine-delayed.json",
        [
            Table(
                key("results"),
                BYZANTINE_COLUMNS,
            )
        ],
        extra=("byzantine-delayed.detail.json",),
    ),
    "byzantine-diloco-h20": Entry(
        "Byzantine peers, DiLoCo at 20 rounds (one seed, ALIE)",
        "Blocking DiLoCo at twice the table's horizon, 20 rounds of H = 25, where never averaging costs 5 % "
        "(the `independent` row): two ALIE colluders of 8, seed 0. At 10 rounds (bench/results/byzantine-h10.json) "
        "their cost is +0.91 % against +3.31 %; here it grows with the horizon. A probe, not the 3-seed table.",
        "python bench/byzantine.py --algorithms diloco --schedules none --rounds 20 --attacks alie --malicious 2 "
        "--seeds 0 --jobs 1 --out bench/results/byzantine-diloco-h20.json",
        [
            Table(
                key("results"),
                BYZANTINE_COLUMNS,
            )
        ],
        extra=("byzantine-diloco-h20.detail.json",),
    ),
    "byzantine-delayed-h20": Entry(
        "Byzantine peers, delayed sync at 20 rounds (one seed, before the delayed loss gate)",
        "Delayed DiLoCo and NoLoCo at 20 rounds of H = 25 overlapping from round 10 (sync.overlap_from_round; "
        "from round 0 delayed averaging is worth less than none at 10, 20 and 40 rounds here), the horizon "
        "where it is worth 3 % (the `independent` row). Seed 0 only, the invocation stopped after it: a probe "
        "that found what the 3-seed table has to beat, not that table. Change in validation loss (fraction) "
        "against the clean swarm of the same seed. Round engine, 8 peers; NoLoCo's loss gate then judged "
        "blocking landings only (its delayed rows: byzantine-delayed-h20-gated).",
        "python bench/byzantine.py --algorithms diloco noloco --schedules delayed --overlap-from-round 10 "
        "--rounds 20 --attacks owner-small-flip subclip-flip alie ipm --malicious 1 2 --seeds 0 1 2 --jobs 2 "
        "--threads 1 --out bench/results/byzantine-delayed-h20.json (stopped after seed 0)",
        [
            Table(
                key("results"),
                BYZANTINE_COLUMNS,
            )
        ],
        extra=("byzantine-delayed-h20.detail.json",),
    ),
    "byzantine-delayed-h20-gated": Entry(
        "Byzantine peers, delayed NoLoCo at 20 rounds with the loss gate (one seed)",
        "The NoLoCo rows of byzantine-delayed-h20 that its ungated delayed landings lost most to (IPM and ALIE), "
        "again once NoLoCo's loss gate judges a delayed landing as a blocking one (peer/round/overlapped.py "
        "`OverlapSchedule._gated`). Seed 0, the same horizon (20 × 25 overlapping from round 10).",
        "python bench/byzantine.py --algorithms noloco --schedules delayed --overlap-from-round 10 --rounds 20 "
        "--attacks ipm alie --malicious 1 2 --seeds 0 --jobs 2 --threads 1 "
        "--out bench/results/byzantine-delayed-h20-gated.json",
        [
            Table(
                key("results"),
                BYZANTINE_COLUMNS,
            )
        ],
        extra=("byzantine-delayed-h20-gated.detail.json",),
    ),
    "byzantine-noloco-h20": Entry(
        "Byzantine peers, NoLoCo at 20 rounds",
        "The NoLoCo rows of bench/results/byzantine-h10.json at twice its horizon, 20 rounds of H = 25, where "
        "NoLoCo's averaging is worth over 3 % (the `independent` row: the same peers never syncing). Change in "
        "validation loss (fraction, mean over seeds, with its (min, max) over seeds) against a clean swarm of "
        "the same seed. Round engine, 8 peers, the honest peers' loss gate on.",
        "python bench/byzantine.py --rounds 20 --algorithms noloco --schedules none --attacks alie ipm stale-phi "
        "--malicious 1 2 --seeds 0 1 2 --jobs 2 --threads 1 --out bench/results/byzantine-noloco-h20.json",
        [
            Table(
                key("results"),
                BYZANTINE_COLUMNS,
            )
        ],
        extra=("byzantine-noloco-h20.detail.json",),
    ),
    "byzantine-nogate": Entry(
        "Byzantine peers, NoLoCo without the loss gate",
        "The NoLoCo rows of bench/results/byzantine-h10.json with the honest peers' loss gate off "
        "(peer/round/loss_gate.py; the malicious peers keep theirs, as there): what the gate is worth. Change "
        "in validation loss (fraction, mean over seeds, with its (min, max) over seeds) against a clean swarm "
        "of the same seed; the `independent` row is the same peers never syncing. Round engine, 8 peers.",
        "python bench/byzantine.py --algorithms noloco --schedules none --attacks alie ipm stale-phi --malicious 1 2 "
        "--seeds 0 1 2 --jobs 2 --threads 1 --no-loss-gate --out bench/results/byzantine-nogate.json",
        [
            Table(
                key("results"),
                BYZANTINE_COLUMNS,
            )
        ],
        extra=("byzantine-nogate.detail.json",),
    ),
    "overlap": Entry(
        "Overlapping each sync with the next round",
        "Utilization (the swarm's tokens/s in rounds that averaged with at least one other peer, over the "
        "same peers' tokens/s with no sync, measured in the same rig invocation; the mean group size beside "
        "it), round and sync time of each overlap mode on the network-namespace rig, and "
        "validation loss at equal tokens against blocking sync (in-process simulation). Rows from before "
        "the no-sync reference keep utilization empty and their swarm tokens/s.",
        "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --rounds 8 --jobs 2; "
        "sudo .venv/bin/python bench/overlap_rig.py --peers 8 --rates 100 --inner-steps 40 "
        "--modes none delayed eager streaming",
        [
            Table(
                key("results"),
                [
                    ("overlap", "overlap"),
                    ("peers", "peers"),
                    ("uplink_mbit", "uplink Mbit/s"),
                    ("inner_steps", "H"),
                    ("host_allocator", "allocator"),
                    ("checkpoint_every_s", "checkpoint every s"),
                    ("utilization", "utilization vs no sync"),
                    ("tokens_per_s", "swarm tokens/s"),
                    ("round_s", "round s"),
                    ("sync_s", "sync s"),
                ],
                "utilization on the rig",
            ),
            OVERLAP_QUALITY,
        ],
        plot=plot_utilization,
        extra=("overlap_rig.detail.json",),
    ),
    "overlap_p1": Entry(
        "Streaming with one fragment",
        "Streaming DiLoCo with the whole model as one fragment: swarm tokens/s on the rig and loss at equal "
        "tokens. These rig rows predate the no-sync reference (issue #54), so their utilization is empty; "
        "the old ratio (inner steps' seconds over round wall time) rose when a sync slowed the steps and "
        "was dropped.",
        "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --rounds 8 --jobs 2 --modes none streaming",
        [
            Table(
                key("results"),
                [
                    ("overlap", "overlap"),
                    ("peers", "peers"),
                    ("uplink_mbit", "uplink Mbit/s"),
                    ("inner_steps", "H"),
                    ("payload_mb", "payload MB"),
                    ("utilization", "utilization vs no sync"),
                    ("tokens_per_s", "swarm tokens/s"),
                    ("round_s", "round s"),
                ],
                "the rig",
            ),
            OVERLAP_QUALITY,
        ],
        extra=("overlap_p1_rig.detail.json",),
    ),
    **{
        name: Entry(
            f"Overlap at equal tokens: {what}",
            "Validation loss at equal tokens of each overlap mode against blocking sync (in-process simulation).",
            "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --jobs 2",
            [OVERLAP_QUALITY],
            note=False,  # their note says the rig's utilization was not measured: no column here shows it
        )
        for name, what in OVERLAP_VARIANTS.items()
    },
    "overlap_eager_outer": Entry(
        "Eager overlap with outer momentum",
        "Validation loss at equal tokens of eager overlap against blocking sync, per outer optimizer setting.",
        "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --rounds 8 --jobs 2 --modes none eager "
        "--set outer_optimizer.lr=LR --set outer_optimizer.momentum=M --set outer_optimizer.nesterov=true",
        [Table(eager_outer_rows, [("outer", "outer optimizer"), *OVERLAP_QUALITY.columns])],
        device="CPU (x86_64, 2 cores), torch 2.13.0+cpu",
    ),
    "overlap_from_round": Entry(
        "Overlap from round K",
        "Validation loss at equal tokens when rounds 0..K−1 sync blocking and overlap starts at round K.",
        "python bench/overlap.py --methods diloco --peers 4 --seeds 0 1 --rounds 24 --jobs 2 "
        "--modes none delayed eager --from-round 8",
        [Table(from_round_rows, [*OVERLAP_QUALITY.columns, ("command", "command")])],
    ),
    "round_end": Entry(
        "The round's end on the training thread",
        "Median milliseconds of each step of a round's end, with glibc's own allocator thresholds and with "
        "the ones a peer sets (LOCOSWARM_HOST_ALLOCATOR).",
        "python bench/round_end.py",
        [
            Table(
                round_end_rows,
                [("host_allocator", "allocator"), ("part", "part"), ("median_ms", "median ms")],
            )
        ],
        device="2-core CPU, 1 thread",
    ),
    "pipeline": Entry(
        "Pipeline stages against the unpipelined swarm",
        "Throughput and validation loss of S stages × R replicas against the unpipelined swarm.",
        "python bench/pipeline.py --methods diloco noloco",
        [
            Table(
                key("results"),
                [
                    ("measured", "measured"),
                    ("stages", "stages"),
                    ("replicas_per_stage", "replicas"),
                    ("routing", "routing"),
                    ("method", "method"),
                    ("tokens_per_s", "tokens/s"),
                    ("final_bpb", "final bits/byte"),
                    ("vs_unpipelined", "vs unpipelined (%)"),
                ],
            )
        ],
        extra=("pipeline_rig.detail.json",),
    ),
    "pipeline_memory": Entry(
        "A model that does not fit one peer trains across stages",
        "Peak memory of the whole model and of each stage under a memory cap.",
        "sudo .venv/bin/python bench/pipeline_memory.py",
        [Table(flat, [("key", "figure"), ("value", "value")])],
    ),
    "adoption_margin": Entry(
        "How much worse an honest state looks: the adoption margin",
        "Per round, how much worse the swarm's state (the peers' mean) looks on a peer's validation windows "
        "than the peer's own θ, relative to the own loss: the gap an honest peer must accept when it adopts "
        "the swarm's state after a failed sync. The largest gap sets peer/round/catchup.py's LOSS_MARGIN "
        "(0.10); a poisoned or negated state is many times worse. Tiny preset, in one process.",
        "python bench/adoption_margin.py --peers 4 --rounds 40 --seeds 2",
        [
            Table(flat, [("key", "figure"), ("value", "value")]),
            Table(
                adoption_rows,
                [("seed", "seed"), ("round", "round"), ("swarm", "swarm loss"), ("worst_rel_gap", "worst gap")],
                "every tenth round",
            ),
        ],
        device="2-core CPU, no GPU",
    ),
    "sybil": Entry(
        "A flood of free identities (Sybil records)",
        "Real peers of the tiny preset train while a stock hivemind node stores thousands of progress records "
        "under the run's key, each validly signed by a fresh identity and claiming the current round: the "
        "share of rounds after the flood that still averaged with another peer, and the memory the flood "
        "cost each peer (vouched membership and the bounded DHT read, peer/net/selection.py; the bounded "
        "per-key storage of each node, peer/net/dht_storage.py).",
        "python bench/sybil.py --records 20000 --peers 4 --warmup 3 --rounds 6",
        [
            Table(
                key("rows"),
                [
                    ("algorithm", "algorithm"),
                    ("records", "records flooded"),
                    ("grouped_rounds_frac", "rounds grouped"),
                    ("rss_growth_mib", "memory growth MiB"),
                    ("flood_store_s", "flood stored in s"),
                ],
            )
        ],
        device="2-core CPU, no GPU; real DHT nodes on 127.0.0.1",
    ),
    "lying-receipts": Entry(
        "A groupmate that lies in its receipts (real peers)",
        "Real `peer join` processes of the tiny preset on 127.0.0.1, 8 rounds: a clean swarm of 3 + L, then "
        "the same 3 honest identities (the same data) with L colluding peers that send false RECEIPTs (the same "
        "digests of means no owner sealed, every owner refused, alignment 0). The honest peers' final "
        "validation loss against the clean swarm's, per run, and the floor: the same 3 honest identities never "
        "averaging (`independent`); the Byzantine table's `lying-receipts` rows are their means per L.",
        "python bench/lying_receipts.py --runs 3 --liars 1 2",
        [
            Table(
                key("runs"),
                [
                    ("liars", "liars"),
                    ("clean", "clean losses (nats/token)"),
                    ("attacked", "attacked losses"),
                    ("change", "change"),
                    ("independent", "never averaging"),
                    ("independent_change", "its change"),
                ],
            )
        ],
        device="2-core CPU, no GPU; real peers on 127.0.0.1",
    ),
    "data_stream": Entry(
        "A real corpus streamed over HTTP: small against large",
        "The Linux kernel's source tree (Debian's linux-source-6.1), cut by `peer data prepare`, against its "
        "kernel/ subtree (105x less text), served by a real HTTP server on 127.0.0.1 (the CDN path) and "
        "tokenized with the pinned 16,384-id BPE: seconds from reading the run to the first inner step, peak "
        "memory, the shard store's most bytes on disk (capped below the large corpus), the inner loop's "
        "tokens/s, and one peer's full pass over every training shard with its memory sampled every 0.5 s "
        "(median and highest during the pass, growth over it) and its tokens/s (download, hash check, BPE).",
        "python bench/data_stream.py",
        [
            Table(
                lambda d: flat({k: d[k] for k in ("text", "tokenizer", "shard_mb", "cache_cap_mib")}),
                [("key", "figure"), ("value", "value")],
            ),
            Table(
                key("corpora"),
                [
                    ("name", "corpus"),
                    ("text_bytes", "text bytes"),
                    ("shards", "shards"),
                    ("shards_read", "shards read"),
                    ("time_to_first_step_s", "to first step s"),
                    ("peak_rss_mib", "peak RSS MiB"),
                    ("rss_pass_p50_mib", "RSS in pass p50 MiB"),
                    ("rss_pass_peak_mib", "RSS in pass max MiB"),
                    ("rss_pass_growth_mib", "RSS growth in pass MiB"),
                    ("disk_mib", "disk MiB"),
                    ("loader_tokens_per_s", "pass tokens/s"),
                    ("inner_tokens_per_s", "inner tokens/s"),
                ],
            ),
            Table(
                lambda d: [{"key": k, "value": v} for k, v in d["ratios"].items()],
                [("key", "figure"), ("value", "large / small")],
                "large over small",
            ),
        ],
    ),
    "waits": Entry(
        "Where a person waits",
        "Seconds to each line real processes print while a person waits: bootstrap node and monitor start, "
        'a peer\'s first line, start line and first round, its longest silence, Ctrl-C from "stopped" to '
        "exit, and a restart on the same data dir to its first round; then each command's longest silence "
        "(stdout and stderr together) up to its first round line, its address line or its exit.",
        "python bench/waits.py",
        [
            Table(
                lambda d: flat({k: v for k, v in d.items() if k not in ("commands", "results_note")}),
                [("key", "figure"), ("value", "value")],
            ),
            Table(
                lambda d: [{"command": name, **c} for name, c in d.get("commands", {}).items()],
                [
                    ("command", "command"),
                    ("longest_silence_s", "longest silence s"),
                    ("first_line_s", "first line at s"),
                    ("longest_silence_after_first_line_s", "longest after it s"),
                    ("until", "until"),
                    ("until_s", "at s"),
                    ("after", "the line before the silence"),
                    ("load_average", "1-min load average"),
                ],
            ),
        ],
    ),
    "rig125m": Entry(
        "A GPU host's swarm on the rig, with a compute stand-in",
        "Real peer processes in network namespaces behind tbf uplinks, each inner step replaced by a stand-in "
        "that holds the preset's real φ, θ and Δ and waits the card's step time (lab/standin.py): "
        "utilization (swarm tokens/s in rounds that averaged with at least one other peer, over the same "
        "peers' tokens/s with no sync, same invocation; the share of rounds that averaged and the mean group "
        "size beside it), sync "
        "seconds against the uplink's floor, bytes per token and memory per peer; and a joiner's catch-up "
        "from 3 donors. Several invocations (rig125m.detail.json lists each with its command): the chaos preset "
        "(0.49 M parameters), and llama-125m cut to 2 of its blocks (26.0 M parameters, the H200's step time "
        "scaled by the parameter share, H = 1700: rounds of 60 s) with 4 and with 8 peers; the full llama-125m's rows wait for a host "
        "with the memory (bench/device_session.sh, stage 5a, on a lent card).",
        "sudo .venv/bin/python bench/rig125m.py --preset chaos --peers 4 --rates 100 --modes nosync none delayed "
        "streaming --codecs fp32 int8 --rounds 3 --warmup 1 --inner-steps 40 --step-s 0.05 --catch-up-rates 100 "
        "--donors 3; sudo .venv/bin/python bench/rig125m.py --preset llama-125m --layers 2 --codecs int8 --rounds 3 "
        "--warmup 1 --inner-steps 1700 --step-s 0.0354 --peers 4 --rates 100 1000 --modes nosync none delayed "
        "streaming --catch-up-rates 1000 100 --donors 3; the same with --peers 8 --rates 100 --catch-up-rates",
        [
            Table(
                key("results"),
                [
                    ("preset", "preset"),
                    ("peers", "peers"),
                    ("uplink_mbit", "uplink Mbit/s"),
                    ("codec", "codec"),
                    ("overlap", "overlap"),
                    ("utilization", "utilization vs no sync"),
                    ("averaged_share", "share of rounds averaged"),
                    ("mean_group_size", "mean group"),
                    ("sync_s", "sync s"),
                    ("floor_s", "link floor s"),
                    ("bytes_per_token", "bytes/token"),
                    ("rss_mib", "MiB per peer"),
                ],
            ),
            Table(
                key("catch_up"),
                [
                    ("uplink_mbit", "uplink Mbit/s"),
                    ("donors", "donors"),
                    ("state_bytes", "state bytes"),
                    ("seconds", "to first step s"),
                    ("floor_s", "link floor s"),
                ],
                "a joiner's catch-up",
            ),
        ],
        device="2-core CPU shared by every peer, a compute stand-in of 0.05 s (chaos) or 0.0354 s (llama-125m "
        "cut to 2 blocks) per step, network namespaces with tbf uplinks",
        extra=("rig125m.detail.json",),
    ),
    "caps": Entry(
        "A volunteer's caps",
        "Real peers in network namespaces, one with a cap: --max-upload-mbit (its link's send rate over its "
        "syncs against the cap) or --max-gb-per-day (sent plus received bytes in its ledger against the day's "
        "pro-rata share, and how many syncs it sat out); loss change is the peers' mean final validation loss "
        "minus the uncapped run's at equal tokens (the repeated uncapped run shows the run-to-run noise).",
        "sudo .venv/bin/python bench/caps.py --peers 3 --rounds 12 --cap-mbit 5 --gb-per-day 0.8",
        [
            Table(
                key("rows"),
                [
                    ("cap", "cap"),
                    ("peers", "peers"),
                    ("sent_mib", "sent MiB"),
                    ("limit_mib", "limit MiB"),
                    ("within_cap", "within cap"),
                    ("rounds_sat_out", "rounds sat out"),
                    ("max_rounds_ahead", "rounds ahead of the swarm"),
                    ("ledger_mib", "ledger MiB"),
                    ("wire_mib", "wire MiB"),
                    ("ledger_vs_wire", "ledger vs wire"),
                    ("loss_change", "loss change"),
                ],
            )
        ],
        device="2-core CPU, no GPU; network namespaces on one machine",
    ),
    "checkpoint_memory": Entry(
        "The memory a checkpoint adds while it is written",
        "A llama-shaped state of a 202 MiB model (φ, outer state, θ, AdamW's moments, the residuals) written "
        "the way the round loop writes it: the peak RSS added over the RSS before, how long the next update "
        "waits and the whole write, before (whole copies, then safetensors' save_file) and after (streamed "
        "tensor by tensor from the tensors as held).",
        "python bench/checkpoint_memory.py",
        [Table(flat, [("key", "figure"), ("value", "value")])],
    ),
    "residual-precision": Entry(
        "Error-feedback residuals in bf16: the loss cost",
        "Validation bits per byte at equal tokens of DiLoCo with a lossy codec whose error-feedback residuals "
        "each peer keeps in fp32 (the default) or bf16 (`compression.residual_dtype`, half their memory), "
        "beside the same peers never averaging (the floor) and data-parallel training (the ceiling); the share "
        "of the floor-to-ceiling gap each row recovers. Goal: bf16 at most +0.2 % against fp32 (issue #67).",
        "python bench/residual_precision.py",
        [
            Table(
                key("rows"),
                [
                    ("row", "row"),
                    ("final_bpb", "final bits/byte (mean)"),
                    ("final_bpb_per_seed", "per seed"),
                    ("gap_recovered_pct", "share of the gap recovered (%)"),
                ],
            ),
            Table(
                lambda d: [{"key": k, "value": d[k]} for k in RESIDUAL_FIGURES],
                [("key", "figure"), ("value", "value")],
                "bf16 against fp32 residuals (percent: their mean, per seed), the goal, and what ran",
            ),
        ],
    ),
}
