"""State that outlives a round: checkpoints, state transfer to joiners, who may vouch for a state.

address_book.py: the swarm a peer has seen, remembered in its data dir
checkpoint.py: local checkpoints: one safetensors file per peer and run, written atomically
data_dir.py: one peer per data directory: an advisory lock
disk.py: free disk space for two checkpoints and the shard cache, checked at start
download.py: the joiner side of a state download: a verified state from several donors
memory_check.py: whether a run's model fits this host's RAM and the card's memory, refused in one line
memory_need.py: the memory a peer of a run needs on this machine, buffer by buffer
safetensors_stream.py: a safetensors file written tensor by tensor
serve.py: the donor side of a state download: one joiner's REQUEST on one stream
sharing.py: the averager's state-transfer half: snapshots served to joiners, downloads from donors
snapshot.py: content-addressed state snapshots, what donors serve
vouching.py: who may vouch for a state this peer adopts
"""
