"""Fixtures shared by the simulation tests: one torch thread and two stdlib files as the corpus."""

import pathlib
import sysconfig

import pytest
import torch

import peer.round.catchup as catchup_module
import peer.round.publishing as publishing_module
from peer.reporting import Reporter
from peer.train.data import Corpus


def stdlib_stream(name: str) -> torch.Tensor:
    """Bytes of one stdlib file as int16 tokens (the bytes tokenizer's ids)."""
    raw = (pathlib.Path(sysconfig.get_paths()["stdlib"]) / name).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tensors this small run slower on two threads, many times slower when the cores are shared.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus():
    # Two stdlib files instead of the whole library: loading it takes seconds.
    return Corpus(
        train=stdlib_stream("argparse.py"), validation=stdlib_stream("textwrap.py"), train_files=1, validation_files=1
    )


class Events(Reporter):
    """A Reporter that keeps every event (``{"event": kind, **fields}``) instead of printing it."""

    def __init__(self):
        super().__init__()
        self.events: list[dict] = []

    def emit(self, event, **fields):
        self.events.append({"event": event, **fields})

    def of(self, kind):
        return [e for e in self.events if e["event"] == kind]

    def index(self, kind, **match):
        return next(
            i for i, e in enumerate(self.events) if e["event"] == kind and all(e.get(k) == v for k, v in match.items())
        )


@pytest.fixture
def evaluations(monkeypatch):
    """Counts every evaluation of a φ on the validation windows (the publisher's and the catch-up's):
    the number of windows of each call."""
    calls: list[int] = []
    real = publishing_module.evaluate

    def counted(model, windows, *args, **kwargs):
        calls.append(windows.shape[0])
        return real(model, windows, *args, **kwargs)

    monkeypatch.setattr(publishing_module, "evaluate", counted)
    monkeypatch.setattr(catchup_module, "evaluate", counted)
    return calls
