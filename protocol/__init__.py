"""What crosses the wire: run manifest, DHT key names, record schemas, identities, errors.

Pure: no training loop, no CLI. Both ``peer`` and ``bootstrap`` import from here; this package
imports neither.

codecs/: pseudo-gradient codecs: fp32 tensors to self-describing bytes and back
errors.py: exceptions raised by locoswarm
groups.py: the group plan: which peers average together in a round, their pieces' codec seeds
keys.py: DHT key names
liveness.py: when a peer is live: one rule, from a progress record and the run manifest
manifest.py: the run manifest: everything peers must agree on to train one model together
presets.py: named run presets
records.py: progress records peers publish to the DHT, validated on receipt
signing.py: signatures on what run owners and peers write to the DHT
specs.py: the run manifest's sections: one frozen dataclass per component
text.py: strings from the network, made safe to print and log
version.py: the wire protocol version
wire/: what peers send each other on libp2p streams, frame by frame
"""

from protocol.version import PROTOCOL_VERSION

__version__ = "0.1.0"
__all__ = ["PROTOCOL_VERSION", "__version__"]
