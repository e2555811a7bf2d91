"""The locoswarm peer: inner training, outer algorithms, transports, CLI.

__main__.py: ``python -m peer``
assets/: package data: the llama-* presets' BPE tokenizer.json
cli.py: the `peer` command group: the flags of `peer join` and `peer swarm`
cli_common.py: what the `peer` commands share: data directory, logging, the run a command names
cli_tools.py: the commands that look rather than train: `peer status`, `peer doctor`, `peer data prepare`
config.py: the settings of one peer, as opposed to the run manifest
doctor.py: `peer doctor`: the checks a volunteer runs on this machine before joining
events.py: the JSON event lines of ``--log-format json``
launch.py: child processes that print JSON event lines: start, read their events, signal, stop
net/: the network runtime shared with bootstrap/: DHT client, validator, dial-back, uplink, traffic
node.py: `peer join`: DHT node, run manifest, assembly, training until told to stop
pipeline/: pipeline stages: a model split across peers
progress.py: the small types a round is told with: position, outcome, run counters
reachability.py: whether this peer is reachable and at which address, found at `peer join`'s start
reporting.py: what a peer prints: a progress line per round, or JSON lines
round/: the round loop, its sync schedules, catch-up, checkpointing, progress publishing
run_choice.py: which run a joining peer trains
shards/: a corpus as a hashed list of shard files that each peer streams
state/: state that outlives a round: checkpoints, state transfer to joiners, vouching
status.py: `peer status`: a swarm seen from its progress records, without training
swarm.py: `peer swarm`: a bootstrap node and N peers as OS processes on 127.0.0.1
swarm_data.py: what `peer swarm` trains on, read once before any process starts
sync/: network sync of one round: transports, averager, group all-reduce, screening, deadlines
train/: training on one peer: model, tokenizer, data, inner loop, outer algorithms
"""

import os as _os

# Tensors the peer's processes pass each other (the averager's buffers, the residuals a checkpoint
# fetches) go through torch's shared memory with the strategy hivemind reads from this variable
# when it is imported (hivemind/utils/mpfuture.py; its default is "file_system"). With
# "file_system" each is a named file in /dev/shm that only its last user removes, so a process
# that is killed while it holds one (kill -9, the OOM killer, the SIGKILL a helper gets when the
# peer's main process dies) leaves it there: memory gone until a reboot. With "file_descriptor"
# the file is unlinked as soon as it is made and the kernel frees it with the last process that
# maps it. A user's own setting is kept.
_os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
