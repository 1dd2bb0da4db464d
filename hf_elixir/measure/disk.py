"""The disk tier's calibration: sequential read and write bandwidth of a directory.

The planner prices a disk chunk's update by the time to read its fp32 master and optimizer
state from disk and write them back (``planner/cost.py``). What that costs depends on the
disk under ``nvme_path``, so it is measured there, in the I/O style of the runtime's tier
(``runtime/disk_tier.py``): one file opened once, whole chunk-sized blocks moved with
``os.pwritev`` / ``os.preadv`` from page-aligned buffers, ``O_DIRECT`` where the file system
accepts it.

The page cache must not flatter either figure, since the tier's working set is by design
larger than host memory:

- **write**: the timed span ends after ``fsync``, so bytes only copied into the page cache
  are not counted as written;
- **read**: with ``O_DIRECT`` the cache is bypassed; where the file system refuses
  ``O_DIRECT`` (tmpfs, some overlay mounts) the written file is synced and then dropped from
  the cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before it is read back. On tmpfs the
  "disk" is memory, and the figures say so.

Results are cached per machine and per path, beside the machine's calibration
(``hardware.cache_path()``'s folder, ``disk-<host>.json``), so planning with ``--nvme PATH``
measures a disk once. A measurement takes a second or two (``DEFAULT_TOTAL`` bytes each way).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import socket
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from hf_elixir.hardware import MEASURED, HardwareProfile, cache_path

#: O_DIRECT's alignment of buffers, offsets and sizes, as the runtime's tier uses
ALIGN = 4096
#: a block as large as one plane of a mid-sized chunk's shard (8M fp32 elements)
DEFAULT_BLOCK = 32 * 2**20
#: bytes written and read back per measurement: enough to pass a disk's write cache burst
DEFAULT_TOTAL = 256 * 2**20


@dataclass(frozen=True)
class DiskFigures:
    """One directory's measured sequential bandwidths (bytes/s) at ``block_bytes`` blocks;
    ``direct`` says whether ``O_DIRECT`` was used (else reads were made cold with
    ``posix_fadvise``)."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    block_bytes: int
    path: str
    direct: bool = False
    total_bytes: int = 0


def _open(path: Path) -> tuple[int, bool]:
    """The probe file, opened once, with O_DIRECT when the file system allows it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError:  # EINVAL on tmpfs and file systems without direct I/O
            pass
    return os.open(path, flags, 0o600), False


def _all(call, fd: int, buf: memoryview, offset: int) -> None:
    """One whole block at ``offset`` (short transfers continued, as the runtime does)."""
    done = 0
    while done < len(buf):
        n = call(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"disk calibration: {'read' if call is os.preadv else 'write'} stopped at byte "
                          f"{offset + done}")
        done += n


def measure_disk(path: str | os.PathLike, block_bytes: int = DEFAULT_BLOCK,
                 total_bytes: int = DEFAULT_TOTAL) -> DiskFigures:
    """Write ``total_bytes`` sequentially in ``block_bytes`` blocks to a scratch file under
    ``path`` (timed up to and including ``fsync``), then read them back cold (module
    docstring), and remove the file. Sizes are rounded to ``ALIGN``; ``total_bytes`` is cut to
    half the free space if the disk has less."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"disk calibration: {str(root)!r} is not a directory")
    block = max(ALIGN, block_bytes // ALIGN * ALIGN)
    total = min(total_bytes, shutil.disk_usage(root).free // 2)
    blocks = max(1, total // block)
    buf = mmap.mmap(-1, block)  # anonymous maps are page-aligned, as O_DIRECT needs
    buf.write(os.urandom(min(block, 2**20)) * (block // min(block, 2**20)))
    view = memoryview(buf)
    fd_probe, probe = tempfile.mkstemp(prefix=".hf_elixir_disk_probe_", dir=root)
    os.close(fd_probe)
    fd, direct = _open(Path(probe))
    try:
        start = time.perf_counter()
        for i in range(blocks):
            _all(os.pwritev, fd, view, i * block)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for i in range(blocks):
            _all(os.preadv, fd, view, i * block)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(probe)
        view.release()
        buf.close()
    nbytes = blocks * block
    return DiskFigures(read_bytes_per_s=nbytes / read_s, write_bytes_per_s=nbytes / write_s,
                       block_bytes=block, path=str(root.resolve()), direct=direct, total_bytes=nbytes)


def disk_cache_path() -> Path:
    """Where disk calibrations are cached: beside the machine's (``hardware.cache_path``)."""
    return cache_path().with_name(f"disk-{socket.gethostname()}.json")


def _read_cache(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError) as e:
        warnings.warn(f"hf_elixir: the disk calibrations cached in {path} cannot be read ({e}); measuring again",
                      stacklevel=3)
        return {}


def disk_figures(path: str | os.PathLike, refresh: bool = False, block_bytes: int = DEFAULT_BLOCK,
                 total_bytes: int = DEFAULT_TOTAL) -> DiskFigures:
    """The cached figures of the disk under ``path`` on this machine, measured (and cached)
    the first time or when ``refresh``. Keyed by the resolved path: two names of one
    directory share a measurement."""
    key = str(Path(path).expanduser().resolve())
    store = disk_cache_path()
    cached = _read_cache(store)
    if not refresh and key in cached:
        try:
            return DiskFigures(**cached[key])
        except TypeError:  # written by another version: measure again
            pass
    figs = measure_disk(key, block_bytes=block_bytes, total_bytes=total_bytes)
    cached[key] = asdict(figs)
    store.parent.mkdir(parents=True, exist_ok=True)
    tmp = store.with_suffix(f".{os.getpid()}.tmp")  # ranks of one machine may race here
    tmp.write_text(json.dumps(cached, indent=1))
    os.replace(tmp, store)
    return figs


def with_disk(hw: "HardwareProfile | str | None", path: str | os.PathLike) -> HardwareProfile:
    """A copy of ``hw`` (a profile, a preset name, or None for this machine) that plans a disk
    tier under ``path``: its bandwidth as measured there (``disk_figures``, cached) and its
    free space now, so the search neither prices nor sizes the tier from a guess."""
    base = HardwareProfile.detect() if hw is None else HardwareProfile.preset(hw) if isinstance(hw, str) else hw
    out = base.with_cluster()
    figs = disk_figures(path)
    out.disk_read_bandwidth, out.disk_write_bandwidth = figs.read_bytes_per_s, figs.write_bytes_per_s
    out.sources["disk_read_bandwidth"] = out.sources["disk_write_bandwidth"] = MEASURED
    out.disk_free = shutil.disk_usage(figs.path).free
    return out
