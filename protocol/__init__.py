"""What crosses the wire: run manifest, DHT key names, record schemas, identities, errors.

Pure: no training loop, no CLI. Both ``peer`` and ``bootstrap`` import from here; this package
imports neither.
"""

from protocol.version import PROTOCOL_VERSION

__version__ = "0.1.0"
__all__ = ["PROTOCOL_VERSION", "__version__"]
