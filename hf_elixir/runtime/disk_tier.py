"""The disk tier: trainable chunks' fp32 master, optimizer state and gradient in files.

A plan may put a trainable chunk's optimizer side on ``"disk"`` when neither the device nor
the host can hold it. Such a chunk keeps, in host memory, only what every pass needs (its
compute-dtype shard, which forward gathers); its fp32 master shard, its optimizer state and
its fp32 gradient shard (the "planes" of its region) live in one file per rank under the
directory the user names (``nvme_path``, else ``ELIXIR_NVME_PATH``). In fp32 with the shard
in host memory, the master *is* that shard (as on the host tier), so the file holds no
master. The gradient plane is written by backward and read by the update
(``disk_grads.py``); the file's reads, writes and threads are ``disk_io.py``'s.

The host update thread (``host_update.py``) works through the disk chunks in the order the
next forward needs them. A small ring of host buffers (``ring``, 3 by default) lets three
things run at once: the next chunk's planes are read while the current one is updated, and
the previous one is written back behind it. Reads and writes run on two I/O threads with
``os.preadv``/``os.pwritev``, which release the GIL; the file is opened once. With
``O_DIRECT`` (used where the file system allows it) buffers, offsets and sizes are aligned
to ``ALIGN`` bytes, so every plane is padded to it and the page cache is bypassed.

The scratch files are the run's own, never a checkpoint:

- each rank works in ``<nvme_path>/hf_elixir-<uid>-rank<r>/`` (the user's number in the
  name), a folder only this user can write, claimed with a lock file holding the run's
  identity (``disk_folder.py``: a symlink, another user's folder or lock, or a folder
  others can write is refused untouched; a folder another live run holds is refused naming
  it). One a crashed run left is emptied (with a warning) and rebuilt from this run's own
  state, from initialisation or from the checkpoint it loads;
- ``O_DIRECT`` is probed when the file opens (one aligned block written and read back): a
  file system that takes the flag but refuses its transfers is used through the page
  cache, with a warning, instead of failing in the middle of a step;
- a plane is read from the file only once this run has written it, and it counts as
  written only once its write returned; before that it reads as zeros (fresh optimizer
  state), so nothing a file held before this run is ever state;
- a transfer that fails (a full disk, an I/O error) is a ``DiskTierError``, raised on this
  rank where the run next waits for the tier (the next read, the optimizer step's wait
  for the gradients, a save, ``flush``) and at every use after it (``DiskFile.failure``);
  the other ranks stop at their next collective with this one, or when the launcher ends
  them (torchrun sends SIGTERM to the others when one worker fails);
- the files are removed when the module is closed, at a normal exit, when the tier is
  garbage collected, or on SIGTERM (``disk_folder._on_sigterm``); never by a forked
  child, which shares the parent's files.

One consumer of the optimizer ring at a time: the host update thread during its step, the
main thread otherwise (every reader of the whole state waits for that thread first); the
gradient ring is backward's. The I/O threads touch only buffers handed to them.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import stat
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from hf_elixir.planner.record import ElixirPlan, chunk_layout
from hf_elixir.profile.params import chunk_numel
from hf_elixir.runtime.disk_grads import GRAD, DiskGrads
from hf_elixir.runtime.disk_folder import DATA_NAME, DIR_PREFIX, ENV, LOCK_NAME, claim
from hf_elixir.runtime.disk_io import (ALIGN, DiskFile, DiskTierError, RingBuffer, aligned, byte_view, pad,
                                        settle_all)
from hf_elixir.optimizers import MAX_STATE_PLANES
from hf_elixir.vocab import format_bytes

# MAX_STATE_PLANES: the most state tensors any optimizer of the table keeps. The files are
# laid out when the model is wrapped, before its optimizer is known, so every disk chunk
# reserves that many state planes; the planner prices disk and ring bytes by the same figure
# (planner/disk.py).
#: named here too: the tier's callers and tests import them from this module
__all__ = ["ALIGN", "DATA_NAME", "DIR_PREFIX", "ENV", "GRAD", "LOCK_NAME", "DiskChunk", "DiskPlan", "DiskTier",
           "DiskTierError", "batch_views", "check_path", "clear_grad", "open_chunk", "prepare", "resolve_path"]


@dataclass(frozen=True)
class DiskChunk:
    """Where one chunk's planes lie in the rank's file: ``planes`` names them in order
    ("master" first unless the master is the in-memory shard, then "state0", "state1",
    and last "grad", the gradient shard: ``disk_grads.py``)."""

    cid: int
    numel: int                 #: elements of the rank's shard
    offset: int                #: first byte of the chunk's region
    planes: tuple[str, ...]

    @property
    def plane_bytes(self) -> int:
        return pad(self.numel * 4)

    @property
    def region_bytes(self) -> int:
        return self.plane_bytes * len(self.planes)

    @property
    def update_bytes(self) -> int:
        """The planes an update writes back: all but the gradient (the last)."""
        return self.plane_bytes * (len(self.planes) - (self.planes[-1] == GRAD))


@dataclass
class DiskPlan:
    """The disk tier a plan asks for, checked before the model is touched (``prepare``)."""

    root: Path
    chunks: list[DiskChunk]

    @property
    def bytes_per_rank(self) -> int:
        return sum(c.region_bytes for c in self.chunks)

    def open(self, rank: int, ring: int = 3) -> "DiskTier":
        return DiskTier(self.root, rank, self.chunks, ring=ring)


def resolve_path(nvme_path: Optional[str | os.PathLike]) -> Optional[str]:
    """The path the user named: the argument, else ``ELIXIR_NVME_PATH``, else None."""
    if nvme_path is not None and str(nvme_path) != "":
        return str(nvme_path)
    return os.environ.get(ENV) or None


def prepare(plan: ElixirPlan, model: torch.nn.Module, world_size: int, device: torch.device,
            nvme_path: Optional[str | os.PathLike]) -> Optional[DiskPlan]:
    """The disk tier ``plan`` needs on this rank, with its path checked (``check_path``);
    None when no trainable chunk is on disk. Raises before anything is changed."""
    disk = [i for i, c in enumerate(plan.chunks) if c.optim_placement == "disk" and not c.frozen]
    if not disk:
        return None
    path = resolve_path(nvme_path)
    if path is None:
        raise DiskTierError(
            f"the plan keeps the optimizer state of {len(disk)} chunk(s) on disk (optim_placement "
            f"\"disk\") but no directory was given for it; pass nvme_path= (the elixir option "
            f"nvme_path, or {ENV}) naming a directory on a fast local disk")
    named = dict(model.named_parameters())
    itemsize = plan.dtype.itemsize
    chunks, offset = [], 0
    for cid in disk:
        cplan = plan.chunks[cid]
        size, _ = chunk_layout([chunk_numel(named[n], itemsize) for n in cplan.params], itemsize, world_size)
        # as the runtime builds it: in fp32, a master on the host is the host shard itself
        aliased = plan.dtype == torch.float32 and (device.type == "cpu" or cplan.param_placement == "cpu")
        planes = ("master",) * (not aliased) + tuple(f"state{i}" for i in range(MAX_STATE_PLANES)) + (GRAD,)
        chunks.append(DiskChunk(cid, size // world_size, offset, planes))
        offset += chunks[-1].region_bytes
    out = DiskPlan(Path(path), chunks)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    check_path(path, out.bytes_per_rank * max(local_ranks, 1), local_ranks)
    return out


def check_path(path: str | os.PathLike, needed: int, ranks: int = 1) -> Path:
    """Refuse a directory that does not exist, cannot be written or lacks ``needed`` bytes
    of free space (what ``ranks`` ranks of this machine write there together), saying
    what to do. Scratch directories this file's runs left behind count as free: a run
    replaces them."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DiskTierError(f"nvme_path {str(root)!r} does not exist; create the directory (on a fast local "
                            "disk) or name another one")
    if not root.is_dir():
        raise DiskTierError(f"nvme_path {str(root)!r} is not a directory; name a directory on a fast local disk")
    try:
        fd, probe = tempfile.mkstemp(prefix=".hf_elixir_probe_", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise DiskTierError(f"nvme_path {str(root)!r} is not writable ({e.strerror or e}); name a directory "
                            "this user can write, or change its permissions") from None
    free = shutil.disk_usage(root).free + sum(  # this user's own, real files only
        f.lstat().st_size for f in root.glob(f"{DIR_PREFIX}*/{DATA_NAME}")
        if not f.parent.is_symlink() and stat.S_ISREG(f.lstat().st_mode))
    if needed > free:
        raise DiskTierError(
            f"nvme_path {str(root)!r} has {format_bytes(free)} free ({free} bytes) but the disk tier needs "
            f"{format_bytes(needed)} ({needed} bytes{f' for {ranks} ranks' if ranks > 1 else ''}); free "
            f"{format_bytes(needed - free)} there, name a larger disk, or keep fewer chunks on disk")
    return root


# ---------------------------------------------------------------------- the tier
def _close_at_exit(ref: "weakref.ReferenceType[DiskTier]", pid: int) -> None:
    tier = ref()
    if tier is not None and os.getpid() == pid:  # a forked child's copies never finish I/O
        tier.close()


class DiskTier:
    """This rank's disk-tier files and ring of host buffers (see the module docstring)."""

    def __init__(self, root: Path, rank: int, chunks: Sequence[DiskChunk], ring: int = 3) -> None:
        if ring < 2:
            raise ValueError(f"the disk tier needs a ring of at least 2 buffers, got {ring}")
        self.chunks = {c.cid: c for c in chunks}
        #: the rank's folder, claimed (``disk_folder.py``: private, locked, removed on SIGTERM)
        self.folder = claim(Path(root), rank)
        self.directory = self.folder.directory
        # removed when the tier is collected (or its opening fails); at exit, after the host
        # update thread is done with it and its transfers are over (``_close_at_exit``)
        self._finalizer = weakref.finalize(self, self.folder.remove)
        try:
            fd = self._open(sum(c.region_bytes for c in chunks))
        except BaseException:
            self._finalizer()
            raise
        self.folder.fds.append(fd)
        self.file = DiskFile(fd, self.directory / DATA_NAME, self.direct)
        atexit.register(_close_at_exit, weakref.ref(self), os.getpid())
        largest = max((c.region_bytes for c in chunks), default=ALIGN)
        self._ring = [RingBuffer(aligned(largest)) for _ in range(ring)]
        #: the chunks' gradient shards, in the last plane of each region
        self.grads = DiskGrads(self.file, self.chunks)
        #: (chunk, plane) this run has written: only those are ever read from the file
        #: (the gradient plane is the gradients' own: ``DiskGrads.stored``)
        self._written: set[tuple[int, str]] = set()
        self.state_names: tuple[str, ...] = ()
        self._clock = 0

    @property
    def counters(self):
        """The file's I/O counters (``disk_io.Counters``), both consumers' transfers."""
        return self.file.counters

    def _open(self, total: int) -> int:
        """The state file, new and ``total`` bytes long, its space reserved now: running out
        of it in the middle of a step would lose the state. ``O_DIRECT`` where the file
        system takes it and its transfers (``_probe``), else through the page cache."""
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        path = self.directory / DATA_NAME
        self.direct = hasattr(os, "O_DIRECT")
        fd = -1
        if self.direct:
            with contextlib.suppress(OSError):  # a file system without direct I/O (tmpfs, older kernels)
                fd = os.open(DATA_NAME, flags | os.O_DIRECT, 0o600, dir_fd=self.folder.dfd)
            refused = self._probe(fd, path) if fd >= 0 else None
            if refused is not None:
                os.close(fd)
                fd = -1
                warnings.warn(f"hf_elixir: the file system of {path} accepts O_DIRECT but refused an aligned "
                              f"{ALIGN}-byte transfer ({refused}); the disk tier reads and writes through "
                              "the page cache instead (slower for large state; a local ext4 or xfs disk "
                              "takes direct I/O)", stacklevel=4)
        if fd < 0:
            self.direct = False
            fd = os.open(DATA_NAME, flags, 0o600, dir_fd=self.folder.dfd)
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:
                os.close(fd)
                raise DiskTierError(f"reserving {format_bytes(total)} in {path} failed ({e.strerror or e}); "
                                    "free space there or name another nvme_path") from None
            os.ftruncate(fd, total)
        return fd

    @staticmethod
    def _probe(fd: int, path: Path) -> Optional[str]:
        """Write and read back one aligned block through ``fd`` (opened with ``O_DIRECT``), as
        every transfer of the tier is aligned; the refusal's reason if the file system
        refuses it (EINVAL: it wants another alignment, or no direct I/O after all), None if
        it works. Other errors (a full disk) are the tier's errors, raised now."""
        view = byte_view(aligned(ALIGN).zero_())
        try:
            written = os.pwritev(fd, [view], 0)
            read = os.preadv(fd, [view], 0) if written == ALIGN else 0
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return f"{errno.errorcode.get(e.errno)}: {e.strerror}"
            os.close(fd)
            raise DiskTierError(f"the disk tier could not write its first block to {path} ({e.strerror or e}); "
                                "free space there or name another nvme_path") from None
        if written != ALIGN or read != ALIGN:
            return f"a short transfer ({written} of {ALIGN} bytes written, {read} read)"
        os.ftruncate(fd, 0)
        return None

    # ------------------------------------------------------------------ setup
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def holds(self, cid: int) -> bool:
        return cid in self.chunks

    @property
    def state_bytes(self) -> int:
        """Bytes of state the files hold for this rank (masters, optimizer state and gradient
        shards, without the alignment padding): what the disk tier keeps out of host memory."""
        per = {c.cid: ("master" in c.planes) + len(self.state_names) + 1 for c in self.chunks.values()}
        return sum(c.numel * 4 * per[c.cid] for c in self.chunks.values())

    @property
    def ring_bytes(self) -> int:
        return sum(b.data.numel() * 4 for b in self._ring) + self.grads.ring_bytes

    def set_state_names(self, names: Sequence[str]) -> None:
        """The optimizer's state, in plane order; every state plane starts as zeros (a new
        optimizer's state), whatever was written before."""
        if len(names) > MAX_STATE_PLANES:
            raise ValueError(f"the disk tier holds at most {MAX_STATE_PLANES} optimizer state tensors per chunk")
        self._settle_all()
        self.state_names = tuple(names)
        self._written = {(cid, plane) for cid, plane in self._written if plane == "master"}
        for buf in self._ring:  # cached copies of the old state are gone
            buf.cid = None

    def put_master(self, cid: int, values: torch.Tensor) -> torch.Tensor:
        """Write chunk ``cid``'s initial fp32 master shard to its file; returns the stand-in
        ``chunk.master`` keeps (a meta tensor: using it by mistake fails loudly)."""
        with self.opened(cid, write=True) as views:
            views["master"].copy_(values.reshape(-1))
        return torch.empty(values.numel(), dtype=torch.float32, device="meta")

    def io_counters(self) -> dict[str, float]:
        """A copy of the I/O counters (``disk_io.Counters``: bytes and seconds since the
        tier opened), read between two steps or during one."""
        return self.file.counted()

    # ------------------------------------------------------------------ buffers
    def _find(self, cid: int) -> Optional[RingBuffer]:
        return next((b for b in self._ring if b.cid == cid), None)

    def _settle_all(self) -> None:
        settle_all([*self._ring, *self.grads.buffers])

    def _free_buffer(self, block: bool) -> Optional[RingBuffer]:
        """A buffer to read into: an empty one, else the least recently used one not held,
        preferring those whose I/O is over, then those writing back, then a read-ahead.
        Without ``block``, only one that is free now (a read-ahead never waits)."""
        def rank(b: RingBuffer) -> tuple:
            return (b.cid is not None, b.busy and not b.writing, b.busy, b.used)

        idle = sorted((b for b in self._ring if not b.held), key=rank)
        if not block:
            idle = [b for b in idle if b.future is None or b.future.done()]
        if not idle:
            if block:
                raise RuntimeError("hf_elixir disk tier: every ring buffer is held")
            return None
        buf = idle[0]
        buf.settle()  # its write-back reaches the file before the buffer is reused
        buf.cid = None
        return buf

    def _start_read(self, buf: RingBuffer, cid: int) -> None:
        buf.cid = cid
        buf.version = self.grads.version(cid)  # the gradient the read sees
        buf.future = self.file.submit(self._read, buf, cid)

    def _views(self, buf: RingBuffer, cid: int) -> dict[str, torch.Tensor]:
        chunk = self.chunks[cid]
        per = chunk.plane_bytes // 4
        names = dict(zip((f"state{i}" for i in range(MAX_STATE_PLANES)), self.state_names))
        out = {}
        for i, plane in enumerate(chunk.planes):
            if plane in ("master", GRAD) or plane in names:
                out[names.get(plane, plane)] = buf.data[i * per : i * per + chunk.numel]
        return out

    # ------------------------------------------------------------------ I/O (on the I/O threads)
    def _read(self, buf: RingBuffer, cid: int) -> None:
        chunk = self.chunks[cid]
        per = chunk.plane_bytes // 4
        with self.file.lock:
            written = {plane for c, plane in self._written if c == cid}
        for i, plane in enumerate(chunk.planes):
            view = buf.data[i * per : (i + 1) * per]
            if plane == GRAD:
                self.grads.load(cid, view)
            elif plane in written:
                self.file.read(view, chunk.offset + i * chunk.plane_bytes)
            else:  # never written in this run: fresh (zero) state, not whatever the file holds
                view.zero_()

    def _write(self, buf: RingBuffer, cid: int) -> None:
        """Write the chunk's planes back; only once that returned do they count as written
        (a failed write leaves them as they were: read as zeros if never written before)."""
        chunk = self.chunks[cid]
        self.file.write(buf.data[: chunk.update_bytes // 4], chunk.offset)
        with self.file.lock:
            self._written.update((cid, plane) for plane in chunk.planes if plane != GRAD)

    def _fresh_grad(self, buf: RingBuffer, cid: int) -> None:
        """The buffer's gradient plane as an in-memory shard would hold it now: read again
        if it was read before the gradient changed (or already used), then scaled."""
        chunk = self.chunks[cid]
        version = self.grads.version(cid)
        if buf.version != version:
            start = chunk.planes.index(GRAD) * chunk.plane_bytes // 4
            self.grads.load(cid, buf.data[start : start + chunk.plane_bytes // 4])
        self.grads.apply_scales(cid, self._views(buf, cid)[GRAD])
        buf.version = -1  # scaled: read again before the next use

    # ------------------------------------------------------------------ the consumer's calls
    def _check_open(self) -> None:
        if self.closed:
            raise DiskTierError(f"the disk tier in {self.directory} was closed (ElixirModule.close() or exit); "
                                "its state is gone: save a checkpoint before closing")
        self.file.check()  # a transfer failed: nothing more is read from or written to the file

    def prefetch(self, cid: int) -> None:
        """Start reading chunk ``cid``'s planes into a free buffer, if one is free now."""
        self._check_open()
        if cid not in self.chunks or self._find(cid) is not None:
            return
        buf = self._free_buffer(block=False)
        if buf is not None:
            self._start_read(buf, cid)

    def acquire(self, cid: int) -> dict[str, torch.Tensor]:
        """Chunk ``cid``'s planes in a ring buffer, by name ("master" when the file holds it,
        then the optimizer's state names): read now unless a prefetch did it already.
        Writable until ``release``."""
        self._check_open()
        buf = self._find(cid)
        if buf is None:
            self._start_read(self._free_buffer(block=True), cid)
            buf = self._find(cid)
        buf.settle()  # its read, or the write-back of the values it still holds
        self._fresh_grad(buf, cid)
        self._clock += 1
        buf.held, buf.used = True, self._clock
        return self._views(buf, cid)

    def release(self, cid: int, write: bool) -> None:
        """Done with chunk ``cid``'s planes; ``write``: write them back (behind, on an I/O
        thread). The buffer keeps them: an ``acquire`` before it is reused reads nothing."""
        buf = self._find(cid)
        if buf is None or not buf.held:
            raise RuntimeError(f"hf_elixir disk tier: chunk {cid} released without being acquired")
        buf.held = False
        if write:  # the planes count as written once the write returns (``_write``)
            buf.future, buf.writing = self.file.submit(self._write, buf, cid), True

    @contextlib.contextmanager
    def opened(self, cid: int, write: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """``acquire`` for the block, then ``release`` (written back when ``write``)."""
        views = self.acquire(cid)
        try:
            yield views
        except BaseException:
            self.release(cid, write=False)
            raise
        self.release(cid, write=write)

    def flush(self) -> None:
        """Wait until every write-back has reached the file (a failed one raises here)."""
        if not self.closed:
            self._settle_all()
            self.file.check()

    def close(self) -> None:
        """Finish the I/O, close the files and remove the run's directory. Idempotent. A
        failed transfer is not raised again here: it was raised where the run met it, and
        the files it spoilt are being removed."""
        if self.closed:
            return
        try:
            self._settle_all()
        except DiskTierError:
            if self.file.failure is None:
                raise
        finally:
            self.file.io.shutdown()
            self._finalizer()


@contextlib.contextmanager
def open_chunk(tier: Optional[DiskTier], chunk, state: Optional[dict[str, torch.Tensor]] = None,
               write: bool = False) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """(master, optimizer state) of one chunk, wherever they live: the chunk's own tensors,
    or for a chunk on the disk tier its planes loaded for the block (written back after it
    when ``write``). A master the file does not hold is the chunk's (its in-memory shard)."""
    state = {} if state is None else state
    if tier is None or not tier.holds(chunk.index):
        yield chunk.master, state
        return
    with tier.opened(chunk.index, write=write) as views:
        yield views.get("master", chunk.master), {name: views[name] for name in state}


def clear_grad(tier: Optional[DiskTier], chunk) -> None:
    """Zero one chunk's gradient shard, wherever it lives (``zero_grad``). A chunk whose
    gradient comes down through a staging buffer is only marked zero: every backward brings
    each such chunk's gradient down, and the first download is copied in over the old values
    (``GradReducer._drain_downloads``), which saves a pass over the shard. Downloads must be
    the shard's only writer for that: not so for a chunk with direct gradients (one rank with
    its shard where it computes), which is cleared. A pending clipping factor goes with the
    gradient it scaled."""
    chunk.grad_factor = None
    if tier is not None and tier.holds(chunk.index):
        tier.grads.forget(chunk.index)
    elif chunk.staging is not None and not chunk.direct_grads:
        chunk.grad_zeroed = True
    else:
        chunk.grad_shard.zero_()


def batch_views(batch: dict[str, list], master: torch.Tensor, views: dict[str, torch.Tensor]) -> dict[str, list]:
    """An optimizer batch of a disk-tier chunk (its ``ranges`` in the shard) with master,
    gradient and state views taken from the planes as read into the ring; ``master``: the
    chunk's own, used when the file holds none (it is the in-memory shard)."""
    master = views.get("master", master)
    ranges = batch["ranges"]
    out = dict(batch, params=[master[lo:hi] for lo, hi in ranges], grads=[views[GRAD][lo:hi] for lo, hi in ranges])
    out.update({name: [t[lo:hi] for lo, hi in ranges] for name, t in views.items() if name not in ("master", GRAD)})
    return out
