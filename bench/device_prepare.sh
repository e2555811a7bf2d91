#!/usr/bin/env bash
# Prepare, on this machine, what bench/device_session.sh needs on a lent GPU (the `device` tool),
# which reaches no registry: the packages its image lacks, as Python 3.12 x86-64 wheels, and the
# GPU-scale corpus, both under .devcarry/ (ignored by git; the call carries it).
#
#   bash bench/device_prepare.sh          # about 1 minute with a warm pip cache; idempotent
#
# The image has torch, transformers, tokenizers, safetensors, click, msgpack, rich, pyarrow,
# prometheus-client, pytest and hypothesis (/work/.library/device/KINDS.md); it lacks hivemind and
# its helpers (multihash needs blake3 and mmh3), cryptography and platformdirs, and its numpy (2.5) is one that hivemind
# 1.1.12's quantization decoders break on (docs/architecture.md), so numpy 2.3 travels too. Versions are this
# venv's, so the device runs what CI tests. Three of hivemind's helpers are published as sources
# only: they are built into wheels here (pure Python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=.devcarry
mkdir -p "$DEST/whl"

version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
BINARY=(hivemind base58 blake3 mmh3 configargparse cryptography cffi pycparser netaddr py-cid py-multihash py-multibase
        py-multicodec morphys pydantic pydantic_core annotated-types typing-inspection numpy platformdirs protobuf)
SOURCE_ONLY=(prefetch_generator python-baseconv varint)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do PLATFORMS+=(--platform "$p"); done

pins=(); for name in "${BINARY[@]}"; do pins+=("$name==$(version "$name")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST/whl" "${pins[@]}"
pins=(); for name in "${SOURCE_ONLY[@]}"; do pins+=("$name==$(version "$name")"); done
"$PY" -m pip wheel -q --no-deps -w "$DEST/whl" "${pins[@]}"

if [ ! -s "$DEST/linux-doc.tar.xz" ]; then
    if [ ! -d bench/data/linux-doc ]; then "$PY" bench/linux_doc_corpus.py; fi
    tar -C bench/data -cJf "$DEST/linux-doc.tar.xz" linux-doc
fi

count=$(ls "$DEST"/whl/*.whl | wc -l)
size=$(du -sm "$DEST" | cut -f1)
echo "$DEST: $count wheels and the corpus, $size MiB (a call carries at most 64 MiB with the working tree)"
if [ "$size" -gt 56 ]; then
    echo "too large to carry beside the working tree: remove stale wheels from $DEST/whl and run this again" >&2
    exit 1
fi
