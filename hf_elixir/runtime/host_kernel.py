"""Adam on the host in one pass: the update and the compute-dtype copy, in one loop.

An offloaded chunk's update is bound by memory bandwidth, not arithmetic: Adam reads the
fp32 master, the gradient and two moments and writes three of them back, 28 bytes per
parameter. PyTorch's fused kernel does exactly that; the copy the device needs next (the
master cast to bf16, into the staging buffer or the host shard) is then a second pass that
reads the master again and converts it: 6 bytes more, and a conversion this VM's cores do
at about 3 G elements/s each. One loop that writes the bf16 copy from the values it has just
computed moves 30 bytes per parameter, once. It also takes the gradient clipping's factor
(``grad_shards.clip`` leaves it pending on a host chunk, ``Chunk.grad_factor``) and multiplies
each gradient by it as it reads it, as ``grad.mul_(factor)`` would have in a pass of its own
(8 more bytes per parameter, on the main thread, before any update could start). In fp16
the copy is fp16 (where the compiler converts to it: ``OnePassAdam.copy_dtypes``; the
vectorised loop writes a cache-sized fp32 block, which the hardware conversion then reads).

The loop is a few lines of C (``host_adam.c``, beside this module), compiled for this
machine's CPU the first time a process needs it (``cc -O3 -march=native``, about a second)
and kept in the calibration cache (``hardware.cache_root()/kernels``), one file per source,
compiler and CPU; later processes load it in milliseconds. Loading a library runs its
constructors, before any check of its numbers, so the cache is trusted only as far as it is
this user's alone: the folder must be a real folder of this user's that no one else can
write (else nothing in it is loaded or built, and the update falls back, saying why), and a
file in it is loaded only if it is this user's, no one else can write it, and its sha256 is
the one recorded beside it at its build (``host_adam-<key>.so.sha256``). The file checked is
the file loaded (through its open descriptor). A file that fails these checks, or does not
load (a corrupt file, a missing function), is built again under its name, with a warning
that says why. It is called through ``ctypes``, which releases the GIL for the
call, so the host-update thread runs it while the main thread drives the next forward
(``torch.compile`` would also fuse the loop, but its CPU kernels hold the GIL under the
default wrapper, and every process pays seconds to trace and load them). The rank's host
threads each take a contiguous part of a long run. Those are the threads of the OpenMP
runtime PyTorch loaded (``openmp_runtime``; the library links that very file): after each
of its parallel kernels PyTorch's threads spin a while on their cores, and threads of the
loop's own waited for those cores (the loop at two threads took 1.2x to 1.45x its time so).
Where no such runtime is found, or in a forked child of the process that loaded the
library, the parts run on Python threads.

It computes what ``torch._fused_adamw_`` / ``torch._fused_adam_`` compute, in their order of
operations, on fp32 values, and rounds the copy as PyTorch's cast does (to nearest, ties to
even; a bf16 NaN to the canonical NaN, an fp16 one as the hardware converts it). It is not
held to agree with them bit for bit (their vectorised code may group an operation
differently): ``check`` compares the two on sample data when the library loads, within
:data:`TOLERANCE`, and the copy with PyTorch's own cast exactly. Every host update of one
run goes through the same loop (overlapped and inline, the host and the disk tiers), so
those agree with each other exactly.

Where no C compiler is found, the build fails or runs past :data:`BUILD_TIMEOUT_S`, the
kernel folder is not private, or ``HF_ELIXIR_HOST_KERNEL=torch`` is set,
``OnePassAdam.usable`` is False and the optimizer keeps PyTorch's fused kernel and a
separate cast; ``why_not`` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import torch

from hf_elixir.optimizers import OptimizerSpec, spec
from hf_elixir.hardware import cache_root
from hf_elixir.runtime.private_dir import UntrustedFolderError, private_directory

#: ``torch`` keeps PyTorch's fused kernel and a separate cast for the host update
KERNEL_ENV = "HF_ELIXIR_HOST_KERNEL"
#: how far the loop's results may be from PyTorch's fused kernel's (relative to each
#: tensor's largest value, after a few steps on sample data) before the runtime refuses it
TOLERANCE = 1e-6
#: runs shorter than this are not split between threads (a part's hand-over costs more)
SPLIT_AT = 1 << 16

#: the loop's C source, shipped in the package beside this module (package data)
SOURCE_NAME = "host_adam.c"
#: how long one compiler call may run before the build counts as failed (seconds)
BUILD_TIMEOUT_S = 300

_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-std=c11")
#: file names of the OpenMP runtimes PyTorch builds link (GNU's, Intel's, LLVM's)
_OPENMP_NAME = re.compile(r"^lib(gomp|iomp5|omp)\b[^/]*\.so(\.[0-9]+)*$")
_OUT_KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
#: the compute dtypes the loop writes a copy in on any machine (fp16 where the compiler
#: can convert to it: ``OnePassAdam.copy_dtypes``)
COPY_DTYPES = frozenset((torch.float32, torch.bfloat16))


class KernelUnavailable(RuntimeError):
    """The one-pass loop cannot be built or loaded here (the reason is the message)."""


def _cpu_fingerprint() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")) and line not in lines:
                    lines.append(line)
                if len(lines) >= 2:
                    break
    except OSError:
        pass
    return platform.machine() + "".join(lines)


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise KernelUnavailable("no C compiler was found (install gcc, or set CC)")
    return cc


def openmp_runtime() -> Optional[Path]:
    """The OpenMP runtime this process has loaded (PyTorch's, for its CPU kernels), or None;
    one in PyTorch's own folder (the wheel's) before any other a library may have mapped.

    The loop's parts run on its threads: after each parallel kernel PyTorch's threads spin a
    while before they sleep, and threads of the loop's own would wait for those cores (at
    two threads here the loop took 1.2x to 1.45x its time so). Linked against the file
    itself, the library shares the runtime, not a second copy of it."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f if ".so" in line}
    except OSError:
        return None
    found = [Path(p) for p in paths if p.startswith("/") and _OPENMP_NAME.match(os.path.basename(p))]
    own = Path(torch.__file__).resolve().parent  # a runtime PyTorch's wheel ships comes first
    found.sort(key=lambda path: (own not in path.resolve().parents, str(path)))
    return found[0] if found else None


def _source() -> str:
    """The loop's C source (``host_adam.c``, shipped in the package)."""
    try:
        return resources.files(__package__).joinpath(SOURCE_NAME).read_text(encoding="utf-8")
    except OSError as exc:
        raise KernelUnavailable(f"the package's {SOURCE_NAME} cannot be read ({exc}); reinstall hf_elixir") from None


def _build(cc: str, source: Path, built: Path, runtime: Optional[Path]) -> Optional[str]:
    """Compile ``source`` into ``built``; with OpenMP, linked against ``runtime``, where that
    works, else without. Returns the compiler's complaint, or None once built. A compiler
    that runs past :data:`BUILD_TIMEOUT_S` is a complaint too, not a second try."""
    try:
        if runtime is not None:
            obj = built.with_suffix(".o")
            steps = [[cc, *_FLAGS, "-fopenmp", "-c", str(source), "-o", str(obj)],
                     [cc, "-shared", str(obj), "-o", str(built), str(runtime), f"-Wl,-rpath,{runtime.parent}",
                      "-lm"]]
            if all(subprocess.run(step, capture_output=True, timeout=BUILD_TIMEOUT_S).returncode == 0
                   for step in steps):
                return None
        proc = subprocess.run([cc, *_FLAGS, "-shared", str(source), "-o", str(built), "-lm"], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"it ran past {BUILD_TIMEOUT_S} s"
    return None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()[-500:]


@dataclass(frozen=True)
class _Recipe:
    """What the library is built from; the file's name carries a hash of all of it, so a new
    source, compiler, CPU or OpenMP runtime is a new file."""

    cc: str
    source: str
    runtime: Optional[Path]
    name: str  # host_adam-<key>.so


def _recipe() -> _Recipe:
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {cc!r} does not run: {exc}") from None
    source, runtime = _source(), openmp_runtime()
    key = hashlib.sha256("\0".join((source, " ".join(_FLAGS), cc, version, _cpu_fingerprint(),
                                    str(runtime))).encode())
    return _Recipe(cc, source, runtime, f"host_adam-{key.hexdigest()[:20]}.so")


def kernel_folder() -> Path:
    """``cache_root()/kernels``, made if missing (mode 0700); an
    :class:`~hf_elixir.runtime.private_dir.UntrustedFolderError` unless it is a real folder of
    this user's that no one else can write (a library planted there would run its
    constructors in this process when loaded)."""
    return private_directory(cache_root() / "kernels", "the host kernel cache")


def _file_problem(info: os.stat_result) -> Optional[str]:
    """Why a file of the kernel folder is not this user's alone (one left there while the
    folder was not private), or None."""
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"it belongs to uid {info.st_uid}, not to you (uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _digest(fd: int) -> str:
    """The sha256 of the open file ``fd``, read from its start."""
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _recorded(path: Path) -> Optional[str]:
    """The sha256 recorded beside ``path`` at its build (``<name>.sha256``, as ``sha256sum``
    writes it), or None where there is none this user wrote."""
    try:
        fd = os.open(_hash_path(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _file_problem(os.fstat(fd)) is not None:
            return None
        words = os.read(fd, 256).decode("ascii", "replace").split()
    finally:
        os.close(fd)
    return words[0] if words and re.fullmatch(r"[0-9a-f]{64}", words[0]) else None


def _hash_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _open_trusted(path: Path) -> tuple[Optional[int], Optional[str]]:
    """Open the cached library at ``path`` if it may be loaded: a regular file of this
    user's that no one else can write, whose sha256 is the one recorded at its build. Returns
    its descriptor (what is loaded is this very file, whatever happens to the name after), or
    None and why not (None too where there is no file: a first build says nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as exc:  # ELOOP: a symlink
        return None, f"it cannot be opened as a file of its own ({exc.strerror or exc})"
    problem = _file_problem(os.fstat(fd))
    if problem is None:
        recorded = _recorded(path)
        if recorded is None:
            problem = f"no sha256 of it was recorded at its build ({_hash_path(path).name})"
        elif _digest(fd) != recorded:
            problem = "its sha256 is not the one recorded at its build (changed or corrupt)"
    if problem is not None:
        os.close(fd)
        return None, problem
    return fd, None


def _build_into(folder: Path, recipe: _Recipe) -> int:
    """Build the library in a private scratch folder inside ``folder``, record its sha256
    beside it, and move both into place (atomically each: a rank building beside this one
    replaces them whole); returns a descriptor of the file built, so that this process loads
    what it built even if another rank's build replaces the name meanwhile."""
    path = folder / recipe.name
    with tempfile.TemporaryDirectory(dir=folder) as scratch:  # mode 0700
        source = Path(scratch) / SOURCE_NAME
        source.write_text(recipe.source, encoding="utf-8")
        built = Path(scratch) / recipe.name
        error = _build(recipe.cc, source, built, recipe.runtime)
        if error is not None:
            raise KernelUnavailable(f"{recipe.cc} could not build it: {error}")
        fd = os.open(built, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o700)  # not the group's under a umask of 002
            recorded = Path(scratch) / _hash_path(path).name
            line = f"{_digest(fd)}  {recipe.name}\n".encode("ascii")
            record = os.open(recorded, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(record, 0o600)  # whatever the umask: a record others can write is none
                os.write(record, line)
                os.fsync(record)
            finally:
                os.close(record)
            os.replace(built, path)
            os.replace(recorded, _hash_path(path))
        except BaseException:
            os.close(fd)
            raise
    return fd


def _dlopen(fd: int, path: Path) -> ctypes.CDLL:
    """Load the open file ``fd`` (cached at ``path``): through ``/proc/self/fd``, so that
    the file checked is the file loaded. The descriptor stays open as long as the process
    (a library is never unloaded): the dynamic loader knows a library by the name it was
    opened under, and a closed descriptor's number would come back for another file."""
    proc = f"/proc/self/fd/{fd}"
    try:
        lib = _load(proc if os.path.exists(proc) else str(path))
    except OSError:
        os.close(fd)  # not loaded: the loader keeps no name
        raise
    except AttributeError as exc:  # loaded, but not the loop: keep the name taken
        raise KernelUnavailable(f"the library {path} lacks a function of the loop ({exc})") from None
    return lib


def load_library() -> tuple[ctypes.CDLL, Optional[str]]:
    """This machine's library, loaded, and why the cached one was rebuilt (None when it
    was loaded, or built for the first time).

    A cached file is loaded only when :func:`_open_trusted` vouches for it (in a folder
    only this user can write: :func:`kernel_folder`, whose refusal is
    ``UntrustedFolderError``); one it refuses, or one that then does not load (a corrupt file,
    a missing function), is built again under its name, and that build is loaded. A build
    that fails or does not load raises :class:`KernelUnavailable`."""
    recipe = _recipe()
    folder = kernel_folder()
    path = folder / recipe.name
    fd, why = _open_trusted(path)
    if fd is not None:
        try:
            return _dlopen(fd, path), None
        except (OSError, KernelUnavailable) as exc:
            why = f"it did not load: {exc}"
    fd = _build_into(folder, recipe)
    try:
        lib = _dlopen(fd, path)
    except OSError as exc:
        raise KernelUnavailable(f"the library {recipe.cc} built does not load: {exc}") from None
    return lib, None if why is None else f"the cached {path} was not loaded ({why}); it was built again"


def library_path() -> Path:
    """Build the loop for this machine if no earlier process did (or if the cached file
    cannot be trusted); return the library's path."""
    recipe = _recipe()
    folder = kernel_folder()
    path = folder / recipe.name
    fd, _ = _open_trusted(path)
    os.close(_build_into(folder, recipe) if fd is None else fd)
    return path


def _load(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(name)  # a CDLL call releases the GIL for its duration
    fn = lib.hf_elixir_adam
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int] * 4
    parallel = lib.hf_elixir_adam_parallel
    parallel.restype = ctypes.c_int
    parallel.argtypes = fn.argtypes + [ctypes.c_int]
    lib.copy_dtypes = COPY_DTYPES | ({torch.float16} if lib.hf_elixir_fp16() else set())
    #: the process whose OpenMP runs the parts: a forked child inherits a runtime whose
    #: threads it does not have (GNU OpenMP would wait for them forever)
    lib.openmp_pid = os.getpid() if lib.hf_elixir_openmp() else None
    return lib


def _scalars(group: dict, step: float, decoupled: bool, factor: float = 1.0) -> torch.Tensor:
    """The scalars of one call at ``step`` (the count after this update), in the order the
    loop reads ``s``: AdamW's factor ``1 - lr * weight_decay`` (Adam's ``weight_decay``),
    ``1 - beta1``, ``beta2``, ``1 - beta2``, ``eps``, the step size, the square root of the
    second bias correction and the gradient's factor (clipping's; 1 for none). Each is
    computed in double precision and rounded once, as PyTorch's kernel takes them
    (``1 - beta2`` rounded from a rounded ``beta2`` is 5e-5 off); the factor is an fp32
    value already."""
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, decay = float(group["lr"]), float(group["weight_decay"])
    return torch.tensor([1 - lr * decay if decoupled else decay, 1 - beta1, beta2, 1 - beta2, float(group["eps"]),
                         lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step), factor], dtype=torch.float32)


class OnePassAdam:
    """The one-pass update of one runtime: the process's library, and ``threads`` host
    threads that split each long run into contiguous parts."""

    _lock = threading.Lock()
    #: per $HF_ELIXIR_HOST_KERNEL: the loaded library, or why there is none
    _loaded: dict[str, tuple[Optional[ctypes.CDLL], Optional[str]]] = {}

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._mode = os.environ.get(KERNEL_ENV, "").strip().lower()
        if self._mode not in ("", "c", "torch"):
            raise ValueError(f"{KERNEL_ENV} must be 'c' (the default) or 'torch', got {self._mode!r}")
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_pid = 0  # a forked child has the pool object but none of its threads

    @property
    def usable(self) -> bool:
        return self._library()[0] is not None

    @property
    def copy_dtypes(self) -> frozenset:
        """The compute dtypes the loop writes a copy in here (fp16 where the compiler converts)."""
        lib = self._library()[0]
        return frozenset() if lib is None else lib.copy_dtypes

    @property
    def why_not(self) -> Optional[str]:
        """Why the optimizer keeps PyTorch's kernel and a separate cast, or None."""
        return self._library()[1]

    def _library(self) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
        with self._lock:
            if self._mode not in self._loaded:
                self._loaded[self._mode] = self._open()
            return self._loaded[self._mode]

    def _open(self) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
        if self._mode == "torch":
            return None, f"{KERNEL_ENV}=torch"
        try:
            lib, rebuilt = load_library()
            if rebuilt is not None:
                warnings.warn(f"hf_elixir: {rebuilt}", RuntimeWarning, stacklevel=4)
            error = check(lib)
        except UntrustedFolderError as exc:  # nothing in the folder is loaded, nor built there
            error = f"{exc}; nothing in it is loaded"
        except (KernelUnavailable, OSError) as exc:
            error = str(exc)
        if error is not None:
            warnings.warn(f"hf_elixir: the one-pass host Adam is not used ({error}); the host update runs "
                          "PyTorch's fused kernel and a separate cast", RuntimeWarning, stacklevel=4)
            return None, error
        return lib, None

    def update(self, algorithm: "str | OptimizerSpec", group: dict, b: dict[str, list],
               outs: Sequence[Optional[torch.Tensor]], factor: float = 1.0) -> None:
        """Update the runs of ``b`` (lists of flat fp32 views, as ``apply_update`` takes them)
        and write each run's new values into ``outs`` (a view of the compute-dtype copy, or
        None), all in one pass; each gradient is taken times ``factor`` (an fp32 value: a
        clipping's, which the gradient in memory does not hold yet)."""
        lib = self._library()[0]
        assert lib is not None, "OnePassAdam.update called where it is not usable"
        for i in range(len(b["params"])):  # all of them before anything changes
            _check_views(b["params"][i], b["grads"][i], b["exp_avg"][i], b["exp_avg_sq"][i], outs[i])
        torch._foreach_add_(b["steps"], 1)
        row = spec(algorithm) if isinstance(algorithm, str) else algorithm  # a row of the optimizer table
        decoupled = row.decoupled_weight_decay
        maximize = bool(group.get("maximize", False))
        scalars: dict[float, torch.Tensor] = {}
        for i, step in enumerate(b["steps"]):
            value = float(step)
            s = scalars.get(value)
            if s is None:
                s = scalars[value] = _scalars(group, value, decoupled, factor)
            self._run(lib, b["params"][i], b["grads"][i], b["exp_avg"][i], b["exp_avg_sq"][i], outs[i], s,
                      decoupled, maximize)

    def _run(self, lib: ctypes.CDLL, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor, out: Optional[torch.Tensor], s: torch.Tensor, decoupled: bool,
             maximize: bool) -> None:
        n = param.numel()
        _check_views(param, grad, exp_avg, exp_avg_sq, out)
        flags = (int(grad.dtype == torch.bfloat16), _OUT_KIND[None if out is None else out.dtype], int(decoupled),
                 int(maximize))
        threads = min(self.threads, torch.get_num_threads())
        parts = 1 if n < SPLIT_AT else threads

        def check(rc: int) -> None:
            if rc != 0:
                raise RuntimeError(f"hf_elixir: the one-pass host Adam does not know the flags {flags}")

        def pointers(lo: int) -> tuple:
            return (param.data_ptr() + 4 * lo, grad.data_ptr() + grad.element_size() * lo,
                    exp_avg.data_ptr() + 4 * lo, exp_avg_sq.data_ptr() + 4 * lo,
                    None if out is None else out.data_ptr() + out.element_size() * lo)

        if parts > 1 and lib.openmp_pid == os.getpid():  # on PyTorch's OpenMP threads (openmp_runtime)
            check(lib.hf_elixir_adam_parallel(*pointers(0), n, s.data_ptr(), *flags, parts))
            return
        per = -(-n // parts)
        per = -(-per // 64) * 64  # contiguous parts, each a whole number of cache lines
        bounds = [(lo, min(n, lo + per)) for lo in range(0, n, per)]

        def part(lo: int, hi: int) -> None:
            check(lib.hf_elixir_adam(*pointers(lo), hi - lo, s.data_ptr(), *flags))

        if len(bounds) == 1:
            part(*bounds[0])
            return
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="hf_elixir_host_adam")
            self._pool_pid = os.getpid()
        futures = [self._pool.submit(part, lo, hi) for lo, hi in bounds[1:]]
        part(*bounds[0])
        for future in futures:
            future.result()


def _check_views(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 out: Optional[torch.Tensor]) -> None:
    """The loop reads raw pointers: a view it cannot read as flat memory would be corrupted."""
    n = param.numel()
    ok = all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" and t.numel() == n
             for t in (param, exp_avg, exp_avg_sq))
    ok = ok and grad.dtype in (torch.float32, torch.bfloat16) and grad.is_contiguous() and grad.numel() == n
    ok = ok and (out is None or (out.dtype in _OUT_KIND and out.is_contiguous() and out.numel() == n))
    if not ok:
        raise RuntimeError("hf_elixir: the one-pass host Adam takes contiguous CPU views of one length: fp32 "
                           "weights and moments, an fp32 or bf16 gradient, an fp32, bf16 or fp16 copy")


def check(lib: ctypes.CDLL) -> Optional[str]:
    """Compare the loop with PyTorch's fused kernels over a few steps on sample data (AdamW and
    Adam, maximising or not, with no copy, an fp32, a bf16 and (where the compiler converts
    to it) an fp16 copy, a gradient factor or none, a length no vector width divides); None
    when they agree within :data:`TOLERANCE` and every copy is PyTorch's cast of the
    weights, else what differed."""
    n = 4099
    gen = torch.Generator().manual_seed(0)
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    runner = OnePassAdam(1)
    # (algorithm, copy, maximize, the gradient's factor: the reference scales it first, as clipping did)
    # (decoupled weight decay: AdamW, or not: Adam, copy, maximize, the gradient's factor)
    cases = [(True, torch.bfloat16, False, 0.3), (True, None, True, 1.0), (False, torch.float32, False, 0.7)]
    if lib.hf_elixir_fp16():
        cases.append((True, torch.float16, False, 0.5))
    for decoupled, out_dtype, maximize, factor in cases:
        factor = torch.tensor(factor, dtype=torch.float32)
        ours = [torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
        theirs = [t.clone() for t in ours]
        out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
        step_ours, step_theirs = torch.zeros(()), torch.zeros(())
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        for _ in range(3):
            step_ours += 1
            runner._run(lib, *ours, out, _scalars(group, float(step_ours), decoupled, float(factor)),
                        decoupled, maximize)
            step_theirs += 1
            kernel([theirs[0]], [theirs[1] * factor], [theirs[2]], [theirs[3]], [], [step_theirs], lr=group["lr"],
                   beta1=0.9, beta2=0.999, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                   maximize=maximize)
        for name, a, b in zip(("weights", "gradient", "exp_avg", "exp_avg_sq"), ours, theirs):
            worst = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            if not worst <= TOLERANCE:
                return f"its {'decoupled' if decoupled else 'coupled'}-decay {name} differ from PyTorch's fused kernel's by {worst:.2g} (relative)"
        if out is not None and not torch.equal(out, ours[0].to(out_dtype)):
            return f"its {out_dtype} copy is not PyTorch's cast of its weights"
    return None
