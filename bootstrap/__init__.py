"""Bootstrap node: a well-known, persistent entry into the DHT that also announces a run manifest.

Imports only ``protocol``; never the peer's training code.
"""
