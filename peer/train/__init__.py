"""Training on one peer: model, tokenizer, data shard, inner loop (AdamW) and outer algorithms.

bpe.py: a byte-level BPE named by the SHA-256 of its tokenizer.json: found, fetched, checked
cache.py: corpus hashing and the on-disk token cache
data.py: corpus, train/validation split, each peer's random shard of training windows
ddp.py: several devices in one peer: data-parallel inner steps (torch.distributed)
device.py: where this peer trains: device, memory cap, largest micro-batch, peak for MFU
host_memory.py: host memory: freed tensor memory kept for reuse (glibc's malloc)
inner.py: the inner loop: AdamW (or Muon) on θ over this peer's data
model.py: the Llama-style causal LM built from the manifest's config
outer.py: outer algorithms: pure tensor code
overlap.py: the update rules of a sync overlapped with the next round, pure tensor code
precision.py: mixed precision per card: the autocast dtype, whether a gradient scaler is needed
resync.py: the re-sync rule: which state a peer adopts from the swarm
sources.py: a corpus's documents, streamed from the source the run's ``[data]`` names
step_bound.py: how far one outer step may move φ: the bound a landing checks
streaming.py: Streaming DiLoCo's rules: fragments, their sync schedule, the merge
tokenizer.py: tokenizers: byte-level (the default) and BPE
"""
