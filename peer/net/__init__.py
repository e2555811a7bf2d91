"""The peer's network runtime, shared with bootstrap/.

Everything here may import hivemind or click; protocol/ stays free of both.

addresses.py: where a run's peers can be dialled: each peer's published multiaddrs
cli_types.py: click parameter types shared by peer/cli.py and bootstrap/cli.py
devices.py: what each peer trains on, published for `peer status` and the monitor
dht.py: DHT access: bounded calls, addresses, stream handlers, run manifests, progress records
dht_node.py: starting a DHT node of ours as a helper process that dies with its parent
dht_storage.py: what a DHT node of ours keeps per key: bounded entries in storage, cache and reads
home_run.py: the run a bootstrap node announces as its own, signed by its identity
identity.py: persistent libp2p identities: a private key file that fixes a peer id
lifetime.py: helper processes die with their parent; one clean stop on Ctrl-C or SIGTERM
limits.py: bounds on what a remote peer can make the averager process hold, do or send
pacing.py: the upload cap (``--max-upload-mbit``): a shared token bucket, per-stream byte counters
periodic.py: a daemon thread that calls a tick every period (keeps signed DHT values alive)
reachability.py: dial-back: can the swarm open a connection to this node?
rejoin.py: finding the swarm again after losing every DHT neighbour
selection.py: which entries of a DHT key with subkeys a reader keeps
traffic.py: the daily traffic budget (``--max-gb-per-day``): a 24 h ledger and the policy that sits out syncs
uplink.py: uplink probe: how fast this machine sends to the swarm
validator.py: the record validator: unsigned values under protected keys are refused
wiremeter.py: the bytes this peer's processes move, as the kernel's TCP socket counters show
"""
