"""Exceptions raised by locoswarm.

Every error the project raises on purpose derives from :class:`LocoError`, so a command-line
entry point can catch one base class and print one actionable line::

    LocoError
    ├── ConfigError                 bad manifest, TOML or flag value (exit 78)
    │   └── ManifestError           a run manifest field is missing or out of range
    ├── NetworkError                the DHT or a peer could not be reached
    │   ├── BootstrapUnreachable    no initial peer answered (exit 69)
    │   └── BadPeerAddress          an --initial-peers value is not a usable multiaddr (exit 2)
    ├── ProtocolError               what came over the wire is not what this client speaks
    │   ├── VersionMismatch         the manifest's protocol version differs from ours
    │   ├── ManifestNotFound        no manifest for the run id in the DHT
    │   └── BadPayload              a record or state download failed validation
    ├── SyncError                   an outer step's communication failed; the round is recoverable
    │   ├── GroupNotFound           no group formed before the matchmaking deadline
    │   └── AllreduceFailed         the all-reduce failed or averaged only part of the tensors
    └── CheckpointError             a local checkpoint is unreadable or belongs to another run

Library errors are wrapped where they enter (``raise AllreduceFailed(...) from exc``).
"""

from __future__ import annotations


class LocoError(Exception):
    """Base class of every error locoswarm raises on purpose."""

    exit_code: int = 1


class ConfigError(LocoError):
    """A configuration value is invalid; fix the file or flag named in the message."""

    exit_code = 78  # sysexits EX_CONFIG: restarting will not help


class ManifestError(ConfigError):
    """A run manifest field is missing, of the wrong type, or out of its allowed range."""


class NetworkError(LocoError):
    """The DHT or a peer could not be reached."""


class BootstrapUnreachable(NetworkError):
    """None of the initial peers answered."""

    exit_code = 69  # sysexits EX_UNAVAILABLE


class BadPeerAddress(NetworkError):
    """An --initial-peers value is not a multiaddr with a /p2p/ peer id."""

    exit_code = 2


class ProtocolError(LocoError):
    """Data received from the network does not match what this client speaks."""


class VersionMismatch(ProtocolError):
    """The run manifest's protocol version is not the one this client implements."""

    exit_code = 78


class ManifestNotFound(ProtocolError):
    """The DHT holds no manifest for the requested run."""

    exit_code = 69


class BadPayload(ProtocolError):
    """A record or downloaded state failed validation (shape, dtype, finiteness, size)."""


class SyncError(LocoError):
    """One outer step's communication failed; φ is left unchanged by the failed exchange."""


class GroupNotFound(SyncError):
    """No group formed before the matchmaking deadline."""


class AllreduceFailed(SyncError):
    """The all-reduce raised, timed out, or averaged only part of the tensors."""


class CheckpointError(LocoError):
    """A local checkpoint cannot be read or belongs to another run."""
