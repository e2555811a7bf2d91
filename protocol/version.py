"""Wire protocol version. Bump on any change to what crosses the network."""

PROTOCOL_VERSION = 1
