"""A safetensors file written tensor by tensor from the tensors as the caller holds them (issue
#67, item 2), so that writing one adds at most one tensor's size to the process, never the file's.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header
length N, N bytes of JSON (``__metadata__``: str → str; per tensor ``dtype``, ``shape`` and
``data_offsets`` [begin, end) into the data), then the data, each tensor's bytes little-endian in
C order. The header follows from the shapes and dtypes alone, so it is written first and each
tensor's bytes after it in turn; the loaders (``safetensors.torch.load_file``, ``safe_open``)
accept any order of the data, so a caller's ``first`` tensors come first. Floating-point tensors
are written as fp32 (``F32``), any other as its own dtype.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
"""The dtypes a file holds here, by their safetensors names (floating point: always F32)."""


def _written_dtype(t: torch.Tensor) -> torch.dtype:
    if t.is_floating_point():
        return torch.float32
    if t.dtype not in _DTYPES:
        raise ValueError(
            f"a tensor of dtype {t.dtype} cannot be written: expected a float or {sorted(map(str, _DTYPES))}"
        )
    return t.dtype


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory is written for ``t``: ``t`` itself when it is already a contiguous
    host tensor of the written dtype (no copy), else one copy of it (host, contiguous, fp32 for a
    float). The writer holds at most one such copy at a time."""
    t = t.detach()
    dtype = _written_dtype(t)
    if t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous():
        return t
    return t.to("cpu", dtype).contiguous()


def header(tensors: Mapping[str, torch.Tensor], order: list[str], metadata: Mapping[str, str]) -> bytes:
    """The file's first bytes for ``tensors`` written in ``order``: the 8-byte header length and the
    JSON header, padded with spaces to a multiple of 8 bytes (as safetensors pads it).

    Raises:
        ValueError: a metadata value is not a str, or a tensor's dtype cannot be written.
    """
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map str to str")
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        dtype = _written_dtype(t)
        size = t.numel() * torch.empty((), dtype=dtype).element_size()
        entries[name] = {"dtype": _DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_one(f: BinaryIO, t: torch.Tensor) -> None:
    # its own frame, so that the copy (if any) is freed before the next tensor's is made
    data = host_bytes(t)
    if data.numel():
        array = data.numpy()
        # little-endian as the format says: no copy on a little-endian host (all that run torch today)
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
        f.write(array.reshape(-1).view("uint8").data)


def write_stream(
    f: BinaryIO,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    first: Collection[str] = (),
    released: threading.Event | None = None,
) -> None:
    """Write ``tensors`` (any device, contiguous or not) and ``metadata`` to ``f`` as one
    safetensors file, tensor by tensor: the ``first`` ones, then the rest in ``tensors``' order.
    Sets ``released`` once the ``first`` tensors are written: the caller may change them from then
    on (the others must stay unchanged until this returns). Does not set it on failure.

    Raises:
        OSError: ``f`` cannot be written.
        ValueError: a tensor's dtype or a metadata value cannot be written; nothing is written.
    """
    order = [k for k in tensors if k in first] + [k for k in tensors if k not in first]
    n_first = sum(k in first for k in tensors)
    f.write(header(tensors, order, metadata))
    for i, name in enumerate(order):
        if released is not None and i == n_first:
            released.set()
        _write_one(f, tensors[name])
    if released is not None:
        released.set()


def save_atomically(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    first: Collection[str] = (),
    released: threading.Event | None = None,
) -> None:
    """Write a safetensors file to ``path`` (:func:`write_stream`) through a private directory
    beside it (``.NAME.tmpPID``, out of reach of any other writer in the directory), fsync it,
    rename it over ``path`` and fsync the directory. ``released`` is set once the ``first``
    tensors are in the file, and in any case before this returns or raises.

    Raises:
        OSError: the file cannot be written; ``path`` is untouched and the private directory gone.
        ValueError: a tensor's dtype or a metadata value cannot be written; ``path`` is untouched.
    """
    private = path.with_name(f".{path.name}.tmp{os.getpid()}")
    staged = private / path.name
    try:
        shutil.rmtree(private, ignore_errors=True)
        private.mkdir()
        with open(staged, "wb") as f:
            write_stream(f, tensors, metadata, first=first, released=released)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if released is not None:
            released.set()
        shutil.rmtree(private, ignore_errors=True)
