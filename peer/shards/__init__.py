"""A corpus as a hashed list of shard files that each peer streams (issue #52).

assign.py: which shard a peer trains on next
build.py: ``peer data prepare SOURCE --out DIR``: one's own corpus cut into hashed shards
corpus.py: a run's data as the peer reads it: a whole corpus or its shards
fetch.py: one shard from a directory, HTTP(S) or a Hugging Face repository, resumed and hash-checked
index.py: the shard list (``shards.json``): each shard's name, size and SHA-256, and its hash
prepare.py: ``peer data prepare --shards DIR`` / ``--hub-repo``: the operator's side of cut shards
serve.py: serving the shard files a peer holds to others over a libp2p stream
share.py: shards and the run's tokenizer.json to and from the run's other peers
store.py: the bounded on-disk shard cache (``--data-cache-gb``)
stream.py: the sampler: this peer's shards, tokenized ahead of the inner loop
text.py: the documents of a tree of one's own files, for ``peer data prepare SOURCE``
"""
