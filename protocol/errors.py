"""Exceptions raised by locoswarm.

Every error the project raises on purpose derives from :class:`LocoError`, so a command-line
entry point can catch one base class and print one actionable line::

    LocoError
    ├── ConfigError                 bad manifest, TOML or flag value (exit 78)
    │   ├── ManifestError           a run manifest field is missing or out of range
    │   └── NotText                 a corpus file is binary or not UTF-8 (file sources skip it)
    ├── NetworkError                the DHT or a peer could not be reached
    │   ├── BootstrapUnreachable    no initial peer answered (exit 69)
    │   ├── BadPeerAddress          an --initial-peers value is not a usable multiaddr (exit 2)
    │   ├── StageCallFailed         no replica of a pipeline stage answered a call validly
    │   └── NoReplica               no live replica serves a pipeline stage: the pipeline pauses
    ├── ProtocolError               what came over the wire is not what this client speaks
    │   ├── VersionMismatch         the manifest's protocol version differs from ours
    │   ├── ManifestNotFound        no manifest for the run id in the DHT
    │   └── BadPayload              a record or state download failed validation
    │       └── BadSignature        a signed value's signature or signer does not match
    ├── SyncError                   an outer step's communication failed; the round is recoverable
    │   ├── GroupNotFound           no group formed before the matchmaking deadline
    │   ├── AllreduceFailed         the all-reduce failed, timed out or mixed rounds
    │   │   └── AllreduceIncomplete the group formed, this peer missed a valid mean; nothing applied
    │   │       └── PartialAverage  the all-reduce session ended with some piece's mean missing
    │   └── StateDownloadFailed     no donor is left to deliver a joiner's missing chunks
    ├── CheckpointError             a local checkpoint is unreadable or belongs to another run
    ├── RankFailed                  a local data-parallel rank of this peer died or stopped answering
    ├── HelperDied                  a helper process (DHT, p2pd, averager) died (exit 75: run it again)
    ├── RunChoiceNeeded             the swarm's runs and the flags do not name one run (exit 64)
    └── LaunchError                 a child process of a launcher (peer/launch.py) misbehaved
        ├── ChildTimeout            no awaited event, or no exit, in time (also a TimeoutError)
        └── ChildExited             the child's output ended before the awaited event

Library errors are wrapped where they enter (``raise AllreduceFailed(...) from exc``).

A :class:`SyncError` says what the failed exchange cost (``bytes_sent``, ``bytes_received``) and
under which bound it ran (``deadline_s``), so a caller records a failed round from the exception
alone. SyncErrors cross process pipes (the averager runs in a forked process): each pickles with
its message and every attribute, and a subclass's ``__init__`` must accept the message alone.

Pure: imports neither hivemind nor torch. No error of ours crosses into hivemind's code: the
averager process returns an incomplete all-reduce as its step's outcome (peer/sync/averager.py).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any, NoReturn, Self


class LocoError(Exception):
    """Base class of every error locoswarm raises on purpose."""

    exit_code: int = 1


class ConfigError(LocoError):
    """A configuration value is invalid; fix the file or flag named in the message."""

    exit_code = 78  # sysexits EX_CONFIG: restarting will not help


class ManifestError(ConfigError):
    """A run manifest field is missing, of the wrong type, or out of its allowed range."""


class NotText(ConfigError):
    """A corpus file is binary (holds NUL bytes) or not UTF-8; the files and jsonl sources skip it
    and count it (peer/train/sources.py), so it stops nothing by itself."""


class NetworkError(LocoError):
    """The DHT or a peer could not be reached."""


class BootstrapUnreachable(NetworkError):
    """None of the initial peers answered."""

    exit_code = 69  # sysexits EX_UNAVAILABLE


class BadPeerAddress(NetworkError):
    """An --initial-peers value is not a multiaddr with a /p2p/ peer id."""

    exit_code = 2


class StageCallFailed(NetworkError):
    """A pipeline stage call got no valid answer: a timeout, a STAGE_ERROR, a broken stream or an
    invalid reply (peer/pipeline/rpc.py). Nothing was applied on the caller's side; the request may
    be retried as it is.

    Args:
        message: what failed, naming each replica and its reason.
        failures: ``(peer_id, reason)`` for each replica tried, in the order tried.
    """

    def __init__(self, message: str, failures: Iterable[tuple[Any, str]] = ()):
        super().__init__(message)
        self.failures = list(failures)

    def __reduce__(self) -> tuple[type[Self], tuple[str, list[tuple[Any, str]]]]:
        return type(self), (str(self), self.failures)


class NoReplica(NetworkError):
    """No live replica serves a pipeline stage: the pipeline pauses until one joins or recovers
    (peer/pipeline/routing.py).

    Args:
        stage: index of the stage without a live replica.
        cooling: replicas of the stage skipped because a recent call to them failed.
    """

    def __init__(self, stage: int, cooling: int = 0):
        self.stage = stage
        self.cooling = cooling
        why = f" ({cooling} cooling down after a failed call)" if cooling else ""
        super().__init__(
            f"no live replica of pipeline stage {stage}{why}: the pipeline pauses "
            f"until a peer serving stage {stage} joins or recovers"
        )

    def __reduce__(self) -> tuple[type[Self], tuple[int, int]]:
        return type(self), (self.stage, self.cooling)


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


class BadSignature(BadPayload):
    """A signed DHT value (a run announcement, a peer's record) is unsigned, signed by another key
    than the one its run id or subkey names, or its signature does not verify (protocol/signing.py)."""


class SyncError(LocoError):
    """One outer step's communication failed; φ is left unchanged by the failed exchange.

    Args:
        *args: the message (``str(exc)``).
        bytes_sent: sync bytes this peer wrote before the failure (frames, headers included).
        bytes_received: sync bytes this peer read before the failure.
        deadline_s: the bound the failed call ran under, s (retries included); 0 if none.
    """

    def __init__(self, *args: object, bytes_sent: int = 0, bytes_received: int = 0, deadline_s: float = 0.0):
        super().__init__(*args)
        self.bytes_sent, self.bytes_received, self.deadline_s = bytes_sent, bytes_received, deadline_s

    def __reduce__(self) -> tuple[type[Self], tuple[Any, ...], dict[str, Any]]:
        # Rebuilt from the message, then every attribute restored: keyword attributes are not in
        # ``args``, and a subclass's own attributes (StateDownloadFailed.failed) travel the same way.
        return type(self), self.args, self.__dict__


class GroupNotFound(SyncError):
    """No group formed before the matchmaking deadline."""


class AllreduceFailed(SyncError):
    """The all-reduce raised, timed out, or the group's members were at different rounds."""


class AllreduceIncomplete(AllreduceFailed):
    """The group formed but this peer did not get a valid mean for every piece; nothing was applied.

    The tensors and error-feedback residuals are left as they were before the all-reduce; the
    round may be retried at once with the groupmates that are left.
    """


class PartialAverage(AllreduceIncomplete):
    """An all-reduce session (peer/sync/allreduce.py) ended without a valid mean for some piece."""


class StateDownloadFailed(SyncError):
    """No donor is left to deliver the chunks still missing; nothing was returned.

    Args:
        message: names the state's digest and each donor's reason.
        failed: each donor that failed (peer handle) → its reason.
    """

    def __init__(self, message: str = "", failed: dict[Any, str] | None = None, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.failed = dict(failed or {})


class CheckpointError(LocoError):
    """A local checkpoint cannot be read or belongs to another run."""


class RankFailed(LocoError):
    """A rank process of a peer that trains on several local devices (peer/train/ddp.py) died,
    failed to start, or a collective between the ranks failed; the peer stops (θ on rank 0 is left
    as it was before the failed step, φ untouched)."""


class HelperDied(LocoError):
    """A helper process of a command died while the command still needed it, most often killed for
    memory: a peer's DHT process, the p2pd (libp2p daemon) below it, or its averager process
    (hivemind's, which runs the all-reduce and serves its state); a bootstrap node's DHT or p2pd.
    The command stops as on a signal (a peer's round in progress is not applied, its checkpoint is
    written) and exits 75; run again, a peer resumes from its checkpoint. Raised by every wait on
    the averager instead of waiting forever, and by peer/net/lifetime.py's ``HelperWatch``."""

    exit_code = 75  # sysexits EX_TEMPFAIL: starting the command again is the fix


class RunChoiceNeeded(LocoError):
    """``peer join`` cannot tell which run to train: the swarm announces several and no ``--run-id``
    (or local checkpoint) picks one, or ``--run``/``--preset`` names another run than the swarm's
    and ``--new-run`` does not say to start it. The message lists the runs and the flag to pass."""

    exit_code = 64  # sysexits EX_USAGE: the same command fails again until a flag changes


class LaunchError(LocoError):
    """A child process started by peer/launch.py (``peer swarm``, the chaos harness, the tests)
    did not do what its launcher waited for."""


class ChildTimeout(LaunchError, TimeoutError):
    """A child did not print the awaited event, or did not exit, in time."""


class ChildExited(LaunchError):
    """A child's output ended before the awaited event; ``returncode`` is its exit code (None: unknown)."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode

    def __reduce__(self) -> tuple[type[Self], tuple[str, int | None]]:
        return type(self), (str(self), self.returncode)


def exit_with(exc: LocoError, *, verbose: bool) -> NoReturn:
    """End a command on one of our errors: one line ``error: <message>`` on stderr (the traceback
    too with ``verbose``) and the error's exit code. Shared by the ``peer`` and ``bootstrap`` CLIs."""
    if verbose:
        logging.getLogger("locoswarm").exception("failed")
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(exc.exit_code)
