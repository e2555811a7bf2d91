"""protocol.errors: one tree, drawn in its docstring; sync errors survive the pipe between processes."""

from __future__ import annotations

import inspect
import pickle
import re
import subprocess
import sys

import pytest

from protocol import errors

ALL = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, errors.LocoError) and cls.__module__ == errors.__name__
]
SYNC = [cls for cls in ALL if issubclass(cls, errors.SyncError)]


def _drawn_tree() -> dict[str, str | None]:
    """Each class drawn in the docstring's tree → the class drawn as its parent."""
    block = errors.__doc__.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        match = re.match(r"([\s│├└─]*)([A-Z]\w+)", line)
        depth, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[name] = stack[-1][1] if stack else None
        stack.append((depth, name))
    return parents


def test_every_error_is_drawn_in_the_tree_under_its_parent():
    assert _drawn_tree() == {cls.__name__: None if cls is errors.LocoError else cls.__mro__[1].__name__ for cls in ALL}


def test_the_incomplete_all_reduce_is_one_error():
    assert issubclass(errors.PartialAverage, errors.AllreduceIncomplete)
    assert issubclass(errors.AllreduceIncomplete, errors.AllreduceFailed)
    assert issubclass(errors.StateDownloadFailed, errors.SyncError)


@pytest.mark.parametrize("cls", SYNC, ids=lambda cls: cls.__name__)
def test_sync_errors_pickle_with_their_attributes(cls):
    exc = cls(f"round 3: {cls.__name__}", bytes_sent=1234, bytes_received=5678, deadline_s=42.5)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and str(back) == str(exc) and back.args == exc.args
    assert (back.bytes_sent, back.bytes_received, back.deadline_s) == (1234, 5678, 42.5)
    default = pickle.loads(pickle.dumps(cls("no bytes")))
    assert (default.bytes_sent, default.bytes_received, default.deadline_s) == (0, 0, 0.0)
    assert back.exit_code == exc.exit_code == 1


def test_download_failure_survives_the_pipe_to_the_trainer():
    """The averager process hands the failure to the trainer through a (local) pipe: it must pickle."""
    exc = errors.StateDownloadFailed("state ab: no donor left", {"QmDonor": "timed out"})
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, errors.StateDownloadFailed) and str(back) == str(exc) and back.failed == exc.failed


def test_exit_codes_are_kept():
    assert (
        errors.ConfigError.exit_code,
        errors.ManifestError.exit_code,
        errors.BootstrapUnreachable.exit_code,
        errors.BadPeerAddress.exit_code,
        errors.VersionMismatch.exit_code,
        errors.ManifestNotFound.exit_code,
    ) == (78, 78, 69, 2, 78, 69)
    assert errors.LocoError.exit_code == errors.SyncError.exit_code == errors.CheckpointError.exit_code == 1


def test_errors_import_neither_torch_nor_hivemind():
    code = "import sys, protocol.errors; print(sorted({'torch', 'hivemind'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
