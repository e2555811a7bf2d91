"""The peer's network runtime, shared with bootstrap/: the DHT client (dht.py: bounded calls, manifests,
records; dht_node.py: starting a node), the record validator, published addresses and devices, the
dial-back and uplink services, identity key files, process lifetime, and the CLI's parameter types.

Everything here may import hivemind or click; protocol/ stays free of both.
"""
