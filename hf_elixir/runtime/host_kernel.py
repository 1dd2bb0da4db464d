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

The loop is a few lines of C (``_SOURCE``), compiled for this machine's CPU the first time a
process needs it (``cc -O3 -march=native``, about a second) and kept in the calibration cache
(``hardware.cache_root()/kernels``), one file per source, compiler and CPU; later processes
load it in milliseconds. It is called through ``ctypes``, which releases the GIL for the
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

Where no C compiler is found, the build fails, or ``HF_ELIXIR_HOST_KERNEL=torch`` is set,
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
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import torch

from hf_elixir.hardware import cache_root

#: ``torch`` keeps PyTorch's fused kernel and a separate cast for the host update
KERNEL_ENV = "HF_ELIXIR_HOST_KERNEL"
#: how far the loop's results may be from PyTorch's fused kernel's (relative to each
#: tensor's largest value, after a few steps on sample data) before the runtime refuses it
TOLERANCE = 1e-6
#: runs shorter than this are not split between threads (a part's hand-over costs more)
SPLIT_AT = 1 << 16

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__F16C__) || defined(__FLT16_MAX__)
#define HAS_FP16 1
#else
#define HAS_FP16 0
#endif

/* fp32 -> bf16 as PyTorch casts: to nearest, ties to even; NaN to 0x7FC0 */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)(x != x ? 0x7FC0u : rounded);
}

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* one Adam(W) update of n elements, in PyTorch's fused kernel's order of operations; the
   constant flags make each call below a loop of its own, vectorised without branches */
static inline void adam(float *restrict param, const void *restrict grad, float *restrict exp_avg,
                        float *restrict exp_avg_sq, void *restrict out, int64_t n, const float *s,
                        const int grad_bf16, const int out_kind, const int decoupled, const int maximize) {
    const float decay = s[0], one_minus_beta1 = s[1], beta2 = s[2], one_minus_beta2 = s[3], eps = s[4],
                step_size = s[5], bc2_sqrt = s[6], factor = s[7];
    const float *g32 = (const float *)grad;
    const uint16_t *g16 = (const uint16_t *)grad;
    float *o32 = (float *)out;
    uint16_t *o16 = (uint16_t *)out;
    for (int64_t i = 0; i < n; i++) {
        /* the clipping factor, rounded as a separate fp32 multiply rounds it (1 is exact) */
        float g = (grad_bf16 ? from_bf16(g16[i]) : g32[i]) * factor;
        if (maximize) g = -g;
        float p = param[i];
        if (decoupled) p = p * decay; else g = g + decay * p;
        float m = exp_avg[i] + (g - exp_avg[i]) * one_minus_beta1;
        float v = exp_avg_sq[i] * beta2 + (g * g) * one_minus_beta2;
        float denom = sqrtf(v) / bc2_sqrt + eps;
        p = p - step_size * m / denom;
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (out_kind == 1) o32[i] = p;
        if (out_kind == 2) o16[i] = to_bf16(p);
    }
}

/* fp32 -> fp16 as PyTorch's CPU cast: the hardware conversion, to nearest, ties to even
   (NaN: quiet, the payload's top bits kept) */
static void to_fp16(const float *restrict src, uint16_t *restrict dst, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
#elif defined(__FLT16_MAX__)
    for (; i < n; i++) {
        _Float16 h = (_Float16)src[i];
        memcpy(dst + i, &h, sizeof h);
    }
#else
    (void)src; (void)dst; (void)n; (void)i;
#endif
}

/* 1 where the loop writes an fp16 copy */
int hf_elixir_fp16(void) {
#if HAS_FP16
    return 1;
#else
    return 0;
#endif
}

int hf_elixir_adam(float *param, const void *grad, float *exp_avg, float *exp_avg_sq, void *out, int64_t n,
                   const float *s, int grad_bf16, int out_kind, int decoupled, int maximize);

/* the fp16 copy: the vectorised loop writes an fp32 block that stays in the cache, which
   the conversion then reads (compilers do not vectorise the conversion inside the loop) */
static int adam_fp16(float *param, const void *grad, float *exp_avg, float *exp_avg_sq, uint16_t *out, int64_t n,
                     const float *s, int grad_bf16, int decoupled, int maximize) {
    float block[1024];
    const int64_t grad_size = grad_bf16 ? 2 : 4;
    for (int64_t lo = 0; lo < n; lo += 1024) {
        const int64_t m = n - lo < 1024 ? n - lo : 1024;
        if (hf_elixir_adam(param + lo, (const char *)grad + grad_size * lo, exp_avg + lo, exp_avg_sq + lo, block, m,
                           s, grad_bf16, 1, decoupled, maximize))
            return 1;
        to_fp16(block, out + lo, m);
    }
    return 0;
}

#define CASE(GB, OK, DE, MA) \
    if (grad_bf16 == GB && out_kind == OK && decoupled == DE && maximize == MA) { \
        adam(param, grad, exp_avg, exp_avg_sq, out, n, s, GB, OK, DE, MA); return 0; }
#define CASES(GB, OK) CASE(GB, OK, 0, 0) CASE(GB, OK, 0, 1) CASE(GB, OK, 1, 0) CASE(GB, OK, 1, 1)

/* grad_bf16: the gradient is bf16 (else fp32); out_kind: 0 no copy, 1 an fp32 copy, 2 bf16,
   3 fp16 (where hf_elixir_fp16) */
int hf_elixir_adam(float *param, const void *grad, float *exp_avg, float *exp_avg_sq, void *out, int64_t n,
                   const float *s, int grad_bf16, int out_kind, int decoupled, int maximize) {
    CASES(0, 0) CASES(0, 1) CASES(0, 2) CASES(1, 0) CASES(1, 1) CASES(1, 2)
    if (out_kind == 3 && HAS_FP16)
        return adam_fp16(param, grad, exp_avg, exp_avg_sq, (uint16_t *)out, n, s, grad_bf16, decoupled, maximize);
    return 1;
}

/* 1 where built with OpenMP: hf_elixir_adam_parallel runs its parts on OpenMP's threads */
int hf_elixir_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* hf_elixir_adam over `parts` contiguous parts of the run, each a whole number of cache
   lines, one per thread of the OpenMP runtime PyTorch loaded (in order without OpenMP) */
int hf_elixir_adam_parallel(float *param, const void *grad, float *exp_avg, float *exp_avg_sq, void *out,
                            int64_t n, const float *s, int grad_bf16, int out_kind, int decoupled, int maximize,
                            int parts) {
    const int64_t grad_size = grad_bf16 ? 2 : 4, out_size = out_kind >= 2 ? 2 : 4;
    const int64_t per = ((n + parts - 1) / parts + 63) / 64 * 64;
    int rc = 0;
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(|:rc)
    for (int part = 0; part < parts; part++) {
        const int64_t lo = per * part, hi = lo + per < n ? lo + per : n;
        if (lo < hi)
            rc |= hf_elixir_adam(param + lo, (const char *)grad + grad_size * lo, exp_avg + lo, exp_avg_sq + lo,
                                 out ? (char *)out + out_size * lo : out, hi - lo, s, grad_bf16, out_kind,
                                 decoupled, maximize);
    }
    return rc;
}
"""

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


def _build(cc: str, source: Path, built: Path, runtime: Optional[Path]) -> Optional[str]:
    """Compile ``source`` into ``built``; with OpenMP, linked against ``runtime``, where that
    works, else without. Returns the compiler's complaint, or None once built."""
    if runtime is not None:
        obj = built.with_suffix(".o")
        steps = [[cc, *_FLAGS, "-fopenmp", "-c", str(source), "-o", str(obj)],
                 [cc, "-shared", str(obj), "-o", str(built), str(runtime), f"-Wl,-rpath,{runtime.parent}", "-lm"]]
        if all(subprocess.run(step, capture_output=True, timeout=300).returncode == 0 for step in steps):
            return None
    proc = subprocess.run([cc, *_FLAGS, "-shared", str(source), "-o", str(built), "-lm"], capture_output=True,
                          text=True, timeout=300)
    return None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()[-500:]


def library_path() -> Path:
    """Build the loop for this machine if no earlier process did; return the library."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {cc!r} does not run: {exc}") from None
    runtime = openmp_runtime()
    key = hashlib.sha256("\0".join((_SOURCE, " ".join(_FLAGS), cc, version, _cpu_fingerprint(),
                                    str(runtime))).encode())
    directory = cache_root() / "kernels"
    path = directory / f"host_adam-{key.hexdigest()[:20]}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        source = Path(scratch) / "host_adam.c"
        source.write_text(_SOURCE)
        built = Path(scratch) / path.name
        error = _build(cc, source, built, runtime)
        if error is not None:
            raise KernelUnavailable(f"{cc} could not build it: {error}")
        os.replace(built, path)  # atomic: a rank building beside this one replaces it whole
    return path


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))  # a CDLL call releases the GIL for its duration
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
            lib = _load(library_path())
            error = check(lib)
        except (KernelUnavailable, OSError) as exc:
            error = str(exc)
        if error is not None:
            warnings.warn(f"hf_elixir: the one-pass host Adam is not used ({error}); the host update runs "
                          "PyTorch's fused kernel and a separate cast", RuntimeWarning, stacklevel=4)
            return None, error
        return lib, None

    def update(self, algorithm: str, group: dict, b: dict[str, list], outs: Sequence[Optional[torch.Tensor]],
               factor: float = 1.0) -> None:
        """Update the runs of ``b`` (lists of flat fp32 views, as ``apply_update`` takes them)
        and write each run's new values into ``outs`` (a view of the compute-dtype copy, or
        None), all in one pass; each gradient is taken times ``factor`` (an fp32 value: a
        clipping's, which the gradient in memory does not hold yet)."""
        lib = self._library()[0]
        assert lib is not None, "OnePassAdam.update called where it is not usable"
        for i in range(len(b["params"])):  # all of them before anything changes
            _check_views(b["params"][i], b["grads"][i], b["exp_avg"][i], b["exp_avg_sq"][i], outs[i])
        torch._foreach_add_(b["steps"], 1)
        decoupled = algorithm == "adamw"
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
    cases = [("adamw", torch.bfloat16, False, 0.3), ("adamw", None, True, 1.0), ("adam", torch.float32, False, 0.7)]
    if lib.hf_elixir_fp16():
        cases.append(("adamw", torch.float16, False, 0.5))
    for algorithm, out_dtype, maximize, factor in cases:
        factor = torch.tensor(factor, dtype=torch.float32)
        ours = [torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
        theirs = [t.clone() for t in ours]
        out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
        step_ours, step_theirs = torch.zeros(()), torch.zeros(())
        kernel = torch._fused_adamw_ if algorithm == "adamw" else torch._fused_adam_
        for _ in range(3):
            step_ours += 1
            runner._run(lib, *ours, out, _scalars(group, float(step_ours), algorithm == "adamw", float(factor)),
                        algorithm == "adamw", maximize)
            step_theirs += 1
            kernel([theirs[0]], [theirs[1] * factor], [theirs[2]], [theirs[3]], [], [step_theirs], lr=group["lr"],
                   beta1=0.9, beta2=0.999, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                   maximize=maximize)
        for name, a, b in zip(("weights", "gradient", "exp_avg", "exp_avg_sq"), ours, theirs):
            worst = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            if not worst <= TOLERANCE:
                return f"its {algorithm} {name} differ from PyTorch's fused kernel's by {worst:.2g} (relative)"
        if out is not None and not torch.equal(out, ours[0].to(out_dtype)):
            return f"its {out_dtype} copy is not PyTorch's cast of its weights"
    return None
