"""Streaming safetensors files: write tensor by tensor, read slice by slice, no mmap.

The safetensors format is an 8-byte little-endian header length, a JSON header
(``{key: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``, padded with spaces to
8 bytes) and the raw little-endian tensor bytes. Writing it ourselves lets a rank write its
shards straight from the fp32 master views (no copy of the shard, no gather), hash the bytes
as they go out, and stop at a fault-injection point between any two tensors. Reading with
``pread`` into preallocated tensors keeps the memory of an export to the tensors being
assembled: a memory-mapped reader would count every touched page of the checkpoint in the
process's resident set. Files written here are read by ``safetensors.safe_open`` and
``from_pretrained`` like any other (tests check both).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from hf_elixir.checkpoint.errors import CheckpointError

DTYPE_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
if hasattr(torch, "float8_e4m3fn"):
    DTYPE_TO_ST[torch.float8_e4m3fn] = "F8_E4M3"
    DTYPE_TO_ST[torch.float8_e5m2] = "F8_E5M2"
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}

_MAX_HEADER = 100 * 2**20     # safetensors' own limit
_WRITE_PIECE = 4 * 2**20      # bytes per write() call for large tensors


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class TensorSpec:
    """What the header says about one tensor."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, without a copy when it is contiguous on the CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class SafetensorsWriter:
    """Write one safetensors file whose header is known up front, one tensor at a time.

    ``specs`` fixes the keys, dtypes, shapes and order; ``write(key, tensor)`` must then be
    called for each key in that order. The sha256 and the byte count are computed on the way
    out; ``close()`` fsyncs the file.
    """

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: Optional[dict[str, str]] = None,
                 before_write: Optional[Callable[[str], None]] = None) -> None:
        self.path = Path(path)
        self.specs = specs
        self._before_write = before_write
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for spec in specs:
            if spec.dtype not in DTYPE_TO_ST:
                raise CheckpointError(f"cannot write dtype {spec.dtype} to safetensors ({spec.key})")
            header[spec.key] = {"dtype": DTYPE_TO_ST[spec.dtype], "shape": list(spec.shape),
                                "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._next = 0
        self._hash = hashlib.sha256()
        self.size = 0
        self._file = open(self.path, "wb")
        self._emit(struct.pack("<Q", len(text)) + text)

    def _emit(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        spec = self.specs[self._next]
        if key != spec.key:
            raise AssertionError(f"tensor {key!r} written out of order (expected {spec.key!r})")
        if tensor.dtype != spec.dtype or tensor.numel() != spec.numel:
            raise AssertionError(f"tensor {key!r}: {tensor.dtype} x {tensor.numel()} does not match its header")
        if self._before_write is not None:
            self._before_write(f"write {self.path.name}:{key}")
        data = _as_bytes(tensor)
        for start in range(0, len(data), _WRITE_PIECE):
            self._emit(data[start : start + _WRITE_PIECE])
        self._next += 1

    def close(self, before_fsync: Optional[Callable[[str], None]] = None) -> tuple[int, str]:
        """Flush and fsync; return (size in bytes, sha256 hex)."""
        if self._next != len(self.specs):
            raise AssertionError(f"{self.path.name}: {len(self.specs) - self._next} tensors were not written")
        self._file.flush()
        if before_fsync is not None:
            before_fsync(f"fsync {self.path.name}")
        os.fsync(self._file.fileno())
        self._file.close()
        return self.size, self._hash.hexdigest()


def write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: Optional[dict[str, str]] = None,
                      fault: Optional[Callable[[str], None]] = None) -> tuple[int, str]:
    """Write (key, tensor) pairs; returns (size, sha256). Tensors are not copied."""
    items = list(tensors)
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in items]
    writer = SafetensorsWriter(path, specs, metadata, before_write=fault)
    for key, t in items:
        writer.write(key, t)
    return writer.close(before_fsync=fault)


class SafetensorsReader:
    """Read tensors or element ranges of 1-D tensors from a safetensors file with pread.

    The header is validated on open (sizes, offsets, dtypes, that the file is long enough),
    so a truncated or mangled file fails here with its name, before anything is copied.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file is missing") from None
        try:
            self._parse()
        except Exception:
            os.close(self._fd)
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a valid safetensors file ({why}); the file is "
                               "truncated or corrupted")

    def _parse(self) -> None:
        file_size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad(f"{file_size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > file_size:
            raise self._bad(f"header length {n} does not fit in {file_size} bytes")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.specs: dict[str, TensorSpec] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        end_max = 0
        for key, info in header.items():
            try:
                dtype = ST_TO_DTYPE[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"entry {key!r} has a malformed header") from None
            spec = TensorSpec(key, dtype, shape)
            if end - begin != spec.nbytes or begin < 0:
                raise self._bad(f"entry {key!r}: offsets {begin}..{end} do not match its shape and dtype")
            self.specs[key] = spec
            self._offsets[key] = (begin, end)
            end_max = max(end_max, end)
        if self.data_start + end_max != file_size:
            raise self._bad(f"the header describes {self.data_start + end_max} bytes, the file has {file_size}")

    def keys(self) -> list[str]:
        return list(self.specs)

    def read(self, key: str, begin: int = 0, end: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Elements [begin, end) of the flattened tensor ``key``, as a 1-D tensor (into ``out``)."""
        if key not in self.specs:
            raise CheckpointError(f"{self.path}: has no tensor {key!r}; the file does not belong to "
                                  "this checkpoint's index")
        spec = self.specs[key]
        end = spec.numel if end is None else end
        if not 0 <= begin <= end <= spec.numel:
            raise CheckpointError(f"{self.path}: {key!r} has {spec.numel} elements, cannot read [{begin}, {end})")
        if out is None:
            out = torch.empty(end - begin, dtype=spec.dtype)
        elif out.dtype != spec.dtype or out.numel() != end - begin or not out.is_contiguous():
            raise AssertionError("output buffer does not match the slice")
        if end == begin:
            return out
        item = spec.dtype.itemsize
        pos = self.data_start + self._offsets[key][0] + begin * item
        view = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.device.type == "cpu" else None
        if view is None:
            raise AssertionError("read into a CPU tensor")
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], pos + done)
            if got <= 0:
                raise self._bad(f"unexpected end of file reading {key!r}")
            done += got
        return out

    def read_tensor(self, key: str) -> torch.Tensor:
        spec = self.specs.get(key)
        if spec is None:
            return self.read(key)  # raises the clear error
        return self.read(key).view(spec.shape)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def file_sha256(path: Path, piece: int = 2**20) -> str:
    """sha256 of a file, read through one reused 1 MiB buffer."""
    h = hashlib.sha256()
    buf = bytearray(piece)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def write_json(path: Path, data, fault: Optional[Callable[[str], None]] = None) -> tuple[int, str]:
    """Write JSON and fsync it; returns (size, sha256)."""
    text = (json.dumps(data, indent=1, sort_keys=False) + "\n").encode()
    if fault is not None:
        fault(f"write {Path(path).name}")
    with open(path, "wb") as f:
        f.write(text)
        f.flush()
        if fault is not None:
            fault(f"fsync {Path(path).name}")
        os.fsync(f.fileno())
    return len(text), hashlib.sha256(text).hexdigest()
