"""A corpus as a hashed list of shard files that each peer streams (issue #52).

index.py: the shard list (``shards.json``) and its hash; fetch.py: getting one shard from a local
directory, an HTTP(S) base URL or a Hugging Face dataset repository, resumed and hash-checked;
store.py: the bounded on-disk cache; assign.py: which shard a peer trains on next; stream.py: the
sampler that tokenizes shards ahead of the inner loop; serve.py, share.py: shards and the run's
tokenizer.json to and from the other peers over libp2p.
"""
