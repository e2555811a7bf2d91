"""Fixtures shared by the simulation tests: one torch thread and two stdlib files as the corpus."""

import pathlib
import sysconfig

import pytest
import torch

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
