#!/usr/bin/env bash
# One prepared call on a lent GPU for the measurements issues #14 and #15 leave to one: a session
# that is lent the `device` tool has 15 minutes of device time, the machine's start included, and
# one command may run 10 minutes; this script fits everything in one command (BUDGET_S, default
# 540 s) and writes what it finds under $OUT as it goes, so a stage cut short keeps what it had.
#
#   bash bench/device_prepare.sh                                  # here, first: .devcarry/
#   device run: command "bash bench/device_session.sh", carry [".devcarry"], timeout_s 600
#   OUT=/tmp/dry bash bench/device_session.sh --dry-run           # here, on the CPU: the plumbing
#
# Stages, in this order, each under `timeout` with what the budget has left:
#   1. #14 item 10: bench/gpu.py on llama-125m and default ($OUT/gpu.json): MFU, inner vs bare.
#   2. #14 item 11: the CUDA-peer + CPU-peer swarm over libp2p (identical φ after every round), and
#      the unit tests of the device, precision, accumulation and inner-step code, now with a card.
#   3. #15 item 4: bench/compare.py at the GPU scale (bench/compare-gpu.toml), data-parallel vs
#      DiLoCo N = 4, seeds 0 and 1, two jobs at once on the card (8 simulations):
#      lr4-adamw: the scale as the 2026-11-27 run had it (16,384-token step, H = 15, 60 rounds),
#        inner lr 4e-3 where that run had 2e-3 (DiLoCo +20.1 % behind data-parallel): on its CPU
#        proxy (bench/compare-gpu-proxy.toml) DiLoCo at twice data-parallel's inner lr took the gap
#        from +9 % to +4.4 % (BPE) and +0.2 % (bytes) (docs/notes/benchmarks-log.md, "A CPU proxy of the GPU
#        scale"); data-parallel at 4e-3 says whether 2e-3 was its best;
#      b32k-muon: inner_optimizer.kind = "muon", set as the CPU scale that met its target (`cpu-32k`:
#        8,192 tokens per peer and step, H = 10, inner lr 3e-3): a 32,768-token global step, 60
#        rounds, 19.7M tokens per run (2.4 passes over the corpus).
#      Every evaluation lands in a temporary folder's <job>/compare_progress.jsonl as it is made,
#      copied to $OUT/compare-gpu-<job>.progress.jsonl after the stage, so runs the budget cuts short
#      still give the gaps at equal tokens up to their last evaluation.
#   4. If 150 s are left: bench/gpu.py on llama-350m and llama-1b ($OUT/gpu_large.json).
#   5. Only with --rig (instead of 1-4: `device run: command "bash bench/device_session.sh --rig"`,
#      carry [".devcarry"]; needs root for network namespaces): #54 item 6, bench/rig125m.py's one
#      row with the real inner step on the card (2 llama-125m peers sharing it, 1 Gbit/s, delayed,
#      int8, H = 50, 3 rounds; its nosync run first), then the same row with lab/standin.py at the
#      tokens/s the card gave each peer without sync ($OUT/rig125m-card.json, rig125m-standin.json):
#      the two utilizations should agree if the stand-in's figure holds.
#   6. Only with --byzantine (instead of 1-4: `device run: command "bash bench/device_session.sh
#      --byzantine"`, carry [".devcarry"]): #65 items 3 and 4, the delayed rows the 2-core host has
#      not run yet, at the horizon where delayed averaging is worth 3 % there (bench/compare.toml,
#      20 rounds × H = 25, overlapping from round 10; from round 0 it is worth less than none at 10,
#      20 and 40 rounds): bench/byzantine.py on the card, every peer's θ there, 8 runs at once,
#      DiLoCo and NoLoCo, clean and independent, then sign-flip, stale-phi, owner-flip,
#      owner-equivocate, subclip-sideways and cosine at 1 and 2 of 8, seed-major, so a run the budget
#      cuts short has every row at its first seeds ($OUT/byzantine-delayed-card.json and its detail).
# Everything a stage prints goes to $OUT/session.log. At most 8 files come back: this writes 7.
set -u
cd "$(dirname "$0")/.."
DRY=0 RIG=0 BYZ=0
for arg in "$@"; do
    [ "$arg" = "--dry-run" ] && DRY=1
    [ "$arg" = "--rig" ] && RIG=1
    [ "$arg" = "--byzantine" ] && BYZ=1
done
: "${OUT:?set OUT to the folder for results (the device tool sets it)}"
mkdir -p "$OUT"
LOG=$OUT/session.log
BUDGET=${BUDGET_S:-540}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
say() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$LOG"; }

# the carried wheels go in on the device; a dry run uses this venv, or installs them as there with
# INSTALL=1 PYTHON=<a Python 3.12 with the device image's packages> (how they were checked here)
if [ "$DRY" = 1 ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
if [ "${INSTALL:-$(( 1 - DRY ))}" = 1 ]; then
    if [ -d .devcarry/whl ]; then
        rm -rf /tmp/site
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .devcarry/whl/*.whl >>"$LOG" 2>&1 || { say "installing the carried wheels failed (above)"; exit 1; }
        export PYTHONPATH=/tmp/site:$PWD
    else
        say "no .devcarry/whl: run bash bench/device_prepare.sh here and carry .devcarry"
    fi
fi
export PYTHONUNBUFFERED=1
if [ ! -d bench/data/linux-doc ] && [ -s .devcarry/linux-doc.tar.xz ]; then
    mkdir -p bench/data && tar -C bench/data -xJf .devcarry/linux-doc.tar.xz
fi
say "$("$PY" -c 'import sys, torch; c = torch.cuda.is_available(); v = sys.version.split()[0]
print("python", v, "torch", torch.__version__, torch.cuda.get_device_name(0) if c else "no CUDA")' 2>&1 | tail -1)"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
fi

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log its output and its exit status
    local name=$1 limit=$2; shift 2
    if [ "$limit" -lt 20 ]; then say "$name: skipped, ${limit} s left"; return; fi
    say "$name: start, limit ${limit} s: $*"
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
    say "$name: exit $? "
}

if [ "$DRY" = 1 ]; then
    GPU_ARGS=(--device cpu --presets tiny --steps 1 --repeats 1)
    CMP=(--config bench/compare.toml --device cpu --jobs 2 --peers 2 --rounds 2 --global-batch 2048)
    B32K=()
    LARGE=(--device cpu --presets default --steps 1 --repeats 1)
else
    GPU_ARGS=(--presets llama-125m,default)
    CMP=(--config bench/compare-gpu.toml --device cuda --jobs 4 --peers 4)
    B32K=(--global-batch 32768 --set sync.inner_steps=10)
    LARGE=(--presets llama-350m,llama-1b)
fi
if [ "$RIG" = 1 ]; then  # stage 5 only (#54 item 6)
    if [ "$DRY" = 1 ]; then RIG_ARGS=(--preset chaos --inner-steps 20); DEV=cpu
    else RIG_ARGS=(--preset llama-125m --inner-steps 50 --max-memory 60); DEV=cuda; fi
    RIG_ARGS+=(--peers 2 --rates 1000 --codecs int8 --rounds 3 --warmup 1 --catch-up-rates --timeout 400)
    stage "5a bench/rig125m.py, real inner step on $DEV" $(( $(left) * 3 / 5 )) \
        "$PY" bench/rig125m.py "${RIG_ARGS[@]}" --modes nosync delayed --device "$DEV" --out "$OUT/rig125m-card.json"
    # the stand-in at what the card gave each peer with no sync (the nosync run's tokens/s per peer)
    RATE=$("$PY" -c 'import json, sys; r = json.load(open(sys.argv[1]))["runs"][0]
print(r["tokens_per_s"] / r["peers"])' "$OUT/rig125m-card.detail.json" 2>>"$LOG")
    if [ -n "$RATE" ]; then
        stage "5b bench/rig125m.py, stand-in at $RATE tokens/s" $(( $(left) - 10 )) \
            "$PY" bench/rig125m.py "${RIG_ARGS[@]}" --modes delayed --tokens-per-s "$RATE" --out "$OUT/rig125m-standin.json"
    fi
    say "done; $(left) s of the budget left"
    exit 0
fi
if [ "$BYZ" = 1 ]; then  # stage 6 only (#65 items 3 and 4, delayed)
    if [ "$DRY" = 1 ]; then BYZ_ARGS=(--device cpu --rounds 2 --overlap-from-round 1 --seeds 0 --jobs 2 --malicious 2 --attacks alie)
    else BYZ_ARGS=(--device cuda --rounds 20 --overlap-from-round 10 --seeds 0 1 2 --jobs 8 --threads 2
                   --malicious 1 2 --attacks sign-flip stale-phi owner-flip owner-equivocate subclip-sideways cosine); fi
    # seed-major: a run the budget cuts short still leaves every row's first seeds
    stage "6 bench/byzantine.py, delayed" $(( $(left) - 10 )) \
        "$PY" bench/byzantine.py "${BYZ_ARGS[@]}" --algorithms diloco noloco --schedules delayed \
        --out "$OUT/byzantine-delayed-card.json"
    say "done; $(left) s of the budget left"
    exit 0
fi
ADAMW_ARGS=("${CMP[@]}" --set inner_optimizer.lr=0.004)
MUON_ARGS=("${CMP[@]}" "${B32K[@]}" --set inner_optimizer.lr=0.003 --set 'inner_optimizer.kind="muon"')

stage "1 bench/gpu.py" $(( $(left) < 200 ? $(left) : 200 )) \
    "$PY" bench/gpu.py "${GPU_ARGS[@]}" --out "$OUT/gpu.json"
stage "2 tests with a card" $(( $(left) < 170 ? $(left) : 170 )) \
    "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/integration/test_gpu_cpu_swarm.py \
    tests/unit/test_device.py tests/unit/test_devices.py tests/unit/test_device_presets.py \
    tests/unit/test_precision.py tests/unit/test_accumulation.py tests/unit/test_inner.py tests/unit/test_inner_sync.py
# stage 3 gets what is left; stage 4 runs only if stage 3 ended with 150 s to spare
CMP_DIR=$(mktemp -d)  # the runs' curves; only the progress files are copied to $OUT (8 files at most)
limit=$(( $(left) - 15 ))
compare_job() {  # compare_job NAME ARGS...: data-parallel and DiLoCo, seeds 0 and 1, under the stage's limit
    local job=$1; shift
    stage "3 bench/compare.py, GPU scale, $job" "$limit" \
        "$PY" bench/compare.py "$@" --methods data-parallel diloco --seeds 0 1 --out-dir "$CMP_DIR/$job" \
        --results "$OUT/compare-gpu-$job.json" --no-plot
}
compare_job lr4-adamw "${ADAMW_ARGS[@]}" &  # both at once on the card, each under its own timeout
compare_job b32k-muon "${MUON_ARGS[@]}" &
wait
for job in lr4-adamw b32k-muon; do
    cp "$CMP_DIR/$job/compare_progress.jsonl" "$OUT/compare-gpu-$job.progress.jsonl" 2>>"$LOG"
done
if [ "$(left)" -ge 150 ]; then
    stage "4 bench/gpu.py, large presets" $(( $(left) - 10 )) \
        "$PY" bench/gpu.py "${LARGE[@]}" --out "$OUT/gpu_large.json"
fi
say "done; $(left) s of the budget left"
ls -la "$OUT" >>"$LOG" 2>&1
