"""The one-pass host Adam (runtime/host_kernel.py): built for this machine, checked against
PyTorch's fused kernels, and used by the optimizer for offloaded state, where it writes the
compute-dtype copy in the same pass; without a compiler, or when told, the optimizer keeps
PyTorch's kernel and a separate cast."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

import hf_elixir as hfe
from harness import run_distributed
from hf_elixir.runtime import host_kernel
from hf_elixir.runtime.host_kernel import KERNEL_ENV, SPLIT_AT, OnePassAdam
from tiny_models import offloaded_gpt2

GROUP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.05}


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kernel cache, and a process that has loaded no library yet."""
    monkeypatch.setenv("HF_ELIXIR_CACHE", str(tmp_path))
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(OnePassAdam, "_loaded", {})
    return tmp_path


def test_the_loop_is_built_once_per_machine_and_loaded_after(fresh_cache: Path) -> None:
    runner = OnePassAdam(2)
    assert runner.usable, runner.why_not
    built = list((fresh_cache / "kernels").glob("host_adam-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    OnePassAdam._loaded.clear()  # as a new process would: found, not built again
    assert host_kernel.library_path() == built[0] and OnePassAdam(1).usable
    assert built[0].stat().st_mtime_ns == stamp


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16, torch.float32, None])
@pytest.mark.parametrize("algorithm", ["adamw", "adam"])
def test_runs_of_any_length_and_step_agree_with_pytorch(fresh_cache: Path, algorithm: str,
                                                          copy_dtype: torch.dtype | None) -> None:
    """Runs shorter than a vector, of odd lengths, and long enough to be split between the
    threads; two of them at another step count. The weights and moments agree with PyTorch's
    fused kernel within the tolerance the library is loaded with, and each copy is PyTorch's
    cast of the new weights, exactly."""
    torch.set_num_threads(2)
    runner = OnePassAdam(2)
    assert runner.usable, runner.why_not
    assert copy_dtype is None or copy_dtype in runner.copy_dtypes  # gcc converts to fp16 on x86-64
    gen = torch.Generator().manual_seed(1)
    sizes = [3, 17, 1000, 4099, 2 * SPLIT_AT + 5]
    flat = {name: torch.randn(sum(sizes), generator=gen) for name in ("params", "grads")}
    flat["exp_avg"] = torch.randn(sum(sizes), generator=gen) * 1e-3
    flat["exp_avg_sq"] = torch.rand(sum(sizes), generator=gen) * 1e-4
    reference = {name: t.clone() for name, t in flat.items()}
    bounds, at = [], 0
    for n in sizes:
        bounds.append((at, at + n))
        at += n
    counts = [4.0, 4.0, 9.0, 4.0, 9.0]

    def views(store: dict) -> dict:
        return {name: [store[name][lo:hi] for lo, hi in bounds] for name in store}

    ours = views(flat)
    ours["steps"] = [torch.tensor(c) for c in counts]
    copies = [torch.empty(hi - lo, dtype=copy_dtype) if copy_dtype else None for lo, hi in bounds]
    runner.update(algorithm, GROUP, ours, copies)
    kernel = torch._fused_adamw_ if algorithm == "adamw" else torch._fused_adam_
    theirs = views(reference)
    for i, count in enumerate(counts):
        kernel([theirs["params"][i]], [theirs["grads"][i]], [theirs["exp_avg"][i]], [theirs["exp_avg_sq"][i]], [],
               [torch.tensor(count + 1)], lr=GROUP["lr"], beta1=0.9, beta2=0.95, weight_decay=GROUP["weight_decay"],
               eps=GROUP["eps"], amsgrad=False, maximize=False)
    assert [float(s) for s in ours["steps"]] == [c + 1 for c in counts]
    for name in ("params", "exp_avg", "exp_avg_sq"):
        worst = ((flat[name] - reference[name]).abs().max() / reference[name].abs().max()).item()
        assert worst <= host_kernel.TOLERANCE, (name, worst)
    assert torch.equal(flat["grads"], reference["grads"])  # the gradient is only read
    for copy, param in zip(copies, ours["params"]):
        assert copy is None or torch.equal(copy, param.to(copy_dtype))


SPECIAL = {  # ties, the largest finite values and past them, subnormals, values that round to 0
    torch.bfloat16: [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 3.3895e38, -3.4e38, 1e-40],
    torch.float16: [1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, -(1.0 + 2 ** -11), 65504.0, 65519.99, 65520.0, -7e4,
                    6e-8, 2.98e-8, 3e-8, -1e-5, 1e-40],
}


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_the_copy_rounds_as_pytorch_casts(fresh_cache: Path, copy_dtype: torch.dtype) -> None:
    """Ties, the largest finite values, infinities, zeros of both signs, subnormals and NaN:
    the copy of a no-op update (learning rate 0) is PyTorch's own cast, bit for bit, NaN
    aside: a NaN stays a NaN, but its bits are not compared, because PyTorch's own cast to
    bf16 gives 0xFFFF from its vectorised loop and 0x7FC0 from its scalar one. Long enough
    for the vectorised conversion and its tail both."""
    runner = OnePassAdam(1)
    values = SPECIAL[copy_dtype] + [float("inf"), float("-inf"), float("nan"), 0.0, -0.0]
    special = torch.tensor(values * 3)
    b = {"params": [special.clone()], "grads": [torch.zeros_like(special)], "exp_avg": [torch.zeros_like(special)],
         "exp_avg_sq": [torch.zeros_like(special)], "steps": [torch.tensor(0.0)]}
    copy = torch.empty_like(special, dtype=copy_dtype)
    runner.update("adamw", {**GROUP, "lr": 0.0, "weight_decay": 0.0}, b, [copy])
    expected = special.to(copy_dtype)
    nan = special.isnan()
    assert torch.equal(copy.isnan(), nan)
    assert torch.equal(copy[~nan].view(torch.int16), expected[~nan].view(torch.int16)), (copy, expected)


def test_the_loop_lets_other_threads_run(fresh_cache: Path) -> None:
    """The host thread's update must not stop the main thread, which drives the next
    forward. With the interpreter's thread switching all but off, the main thread, blocked
    until the update thread enters the loop, can run again before the loop returns only if
    the call released the GIL: it then sees the update thread still inside the call."""
    import ctypes
    import sys
    import threading

    runner = OnePassAdam(1)
    assert runner.usable, runner.why_not
    lib = runner._library()[0]
    n = 1 << 24  # a tenth of a second or more: ample for the main thread to be scheduled
    param, grad, exp_avg, exp_avg_sq = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    copy = torch.empty(n, dtype=torch.bfloat16)
    s = host_kernel._scalars(GROUP, 1.0, True)
    inside, started = [False], threading.Event()

    def update() -> None:
        inside[0] = True
        started.set()
        lib.hf_elixir_adam(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                           copy.data_ptr(), ctypes.c_int64(n), s.data_ptr(), 0, 2, 1, 0)
        inside[0] = False

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        worker = threading.Thread(target=update)
        worker.start()
        started.wait()  # blocked, without the GIL, until the update thread is at the call
        ran_during_the_call = inside[0]
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert ran_during_the_call


def _long_run(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = 4 * SPLIT_AT + 9
    t = {name: torch.randn(n, generator=gen) for name in ("params", "grads")}
    return t | {"exp_avg": torch.randn(n, generator=gen) * 1e-3, "exp_avg_sq": torch.rand(n, generator=gen) * 1e-4}


def _updated(runner: OnePassAdam, seed: int, t: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """A long run (``_long_run(seed)`` unless given) updated twice by ``runner`` (split
    between its threads): the new weights, moments and bf16 copy."""
    t = _long_run(seed) if t is None else t
    out = torch.empty(t["params"].numel(), dtype=torch.bfloat16)
    batch = {name: [v] for name, v in t.items()} | {"steps": [torch.zeros(())]}
    for _ in range(2):
        runner.update("adamw", GROUP, batch, [out], 0.5)
    return [t["params"], t["exp_avg"], t["exp_avg_sq"], out]


def _forked_child(queue) -> None:
    torch.set_num_threads(1)  # PyTorch's own parallel kernels would wait forever here too
    t = _long_run(5)
    torch.set_num_threads(2)  # the loop may split, and does, on Python threads
    updated = _updated(OnePassAdam(2), 5, t)
    torch.set_num_threads(1)
    queue.put(_bits(updated))


def _bits(tensors: list[torch.Tensor]) -> list[bytes]:
    return [t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes() for t in tensors]


def test_the_parts_run_on_pytorchs_openmp_threads(fresh_cache: Path) -> None:
    """Where PyTorch's CPU kernels run on OpenMP, the library links the very runtime this
    process loaded (no second one appears) and splits a long run on its threads; the split
    changes no bit (each element's arithmetic is its own). A forked child, which inherits the
    runtime but not its threads, splits on Python threads instead, and finishes with the
    same bits: GNU OpenMP there would wait for the parent's threads forever."""
    import multiprocessing

    assert "OpenMP" in torch.__config__.parallel_info()  # the CPU wheel this suite installs
    torch.set_num_threads(2)
    torch.ones(1 << 20).mul_(2)  # a parallel kernel: PyTorch's OpenMP threads exist now
    runtime = host_kernel.openmp_runtime()
    assert runtime is not None
    two = OnePassAdam(2)
    assert two.usable, two.why_not
    assert two._library()[0].openmp_pid == os.getpid()
    assert host_kernel.openmp_runtime() == runtime
    with open("/proc/self/maps") as f:  # the library brought no runtime of its own
        mapped = {line.split()[-1] for line in f}
    runtimes = {path for path in mapped if host_kernel._OPENMP_NAME.match(os.path.basename(path))}
    assert runtimes == {str(runtime)}
    split, whole = _updated(two, 5), _updated(OnePassAdam(1), 5)
    assert all(torch.equal(a, b) for a, b in zip(split, whole))

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_forked_child, args=(queue,))
    child.start()
    try:
        forked = queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        child.kill()  # a hung child must not hang the suite's exit
    assert child.exitcode == 0
    assert forked == _bits(whole)


def test_without_a_compiler_the_optimizer_keeps_pytorchs_kernel(fresh_cache: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(fresh_cache / "no-such-compiler"))
    runner = OnePassAdam(1)
    with pytest.warns(RuntimeWarning, match="the one-pass host Adam is not used"):
        usable = runner.usable
    assert not usable
    assert "no-such-compiler" in runner.why_not and "does not run" in runner.why_not


def test_the_environment_chooses_pytorchs_kernel(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNEL_ENV, "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        runner = OnePassAdam(1)
        assert not runner.usable and runner.why_not == f"{KERNEL_ENV}=torch"
    monkeypatch.setenv(KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=KERNEL_ENV):
        OnePassAdam(1)


def _train(rank: int, world_size: int, kernel: str, dtype: str = "bfloat16") -> dict:
    """Three steps of a GPT-2 whose optimizer state is all on the host, updated inside
    step() (the host thread runs the same loop): the weights after the first step, the
    losses, whether every compute-dtype shard is its master's cast, and how many updates went
    through the one-pass loop."""
    import os

    os.environ[KERNEL_ENV] = kernel
    torch.set_num_threads(1)
    model, emodel = offloaded_gpt2(world_size, dtype)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = hfe.ElixirOptimizer(emodel, torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                                         {"params": rest, "weight_decay": 0.0}], lr=1e-3),
                              overlap_host=False)
    calls = [0]
    update = OnePassAdam.update

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return update(self, *args, **kwargs)

    OnePassAdam.update = counted
    g = torch.Generator().manual_seed(rank)
    losses, first = [], None
    for step in range(3):
        ids = torch.randint(0, 256, (2, 32), generator=g)
        loss = emodel(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if step == 0:
            first = {i: c.master.clone() for i, c in enumerate(emodel.chunks) if not c.frozen}
    casts = all(torch.equal(c.shard, c.master.to(c.shard.dtype)) for c in emodel.chunks if not c.master_aliased)
    return {"first": first, "losses": losses, "casts": casts, "one_pass_calls": calls[0],
            "copies": sum(not c.master_aliased for c in emodel.chunks), "said": emodel.time_report()["host_kernel"]}


@pytest.mark.parametrize("world_size,dtype", [(1, "bfloat16"), (2, "bfloat16"), (1, "float16")])
def test_offloaded_training_writes_the_copy_in_the_update(fresh_cache: Path, world_size: int, dtype: str) -> None:
    """The same run with the one-pass loop and with PyTorch's kernel and a cast: after the
    first step (same gradients on both) every master agrees within the loop's tolerance;
    every compute-dtype shard is always its master's cast; the losses of later steps, whose
    forward reads copies of masters that may differ in the last fp32 bit, stay within the
    compute dtype's resolution."""
    one_pass = run_distributed(_train, world_size, "c", dtype)
    torch_path = run_distributed(_train, world_size, "torch", dtype)
    resolution = {"bfloat16": 2 ** -7, "float16": 2 ** -10}[dtype]
    for ours, theirs in zip(one_pass, torch_path):
        assert ours["copies"] > 0 and ours["one_pass_calls"] > 0 and theirs["one_pass_calls"] == 0
        assert ours["said"].startswith("one-pass loop") and f"{KERNEL_ENV}=torch" in theirs["said"]
        assert ours["casts"] and theirs["casts"]
        for index, master in theirs["first"].items():
            worst = ((ours["first"][index] - master).abs().max() / master.abs().max().clamp_min(1e-30)).item()
            assert worst <= host_kernel.TOLERANCE, (index, worst)
        assert ours["losses"][0] == theirs["losses"][0]
        for a, b in zip(ours["losses"], theirs["losses"]):
            assert abs(a - b) <= resolution * abs(b), (ours["losses"], theirs["losses"])


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_the_calibration_times_the_hosts_step_with_the_runtimes_update(fresh_cache: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        kernel: str) -> None:
    """``host_rate.host_update_rate`` (a GPU machine's ``cpu_adam_throughput``) runs what the
    runtime's host runs per offloaded element: the one-pass loop where it is usable, else
    PyTorch's kernel, each timed call with the gradient's add, clipping and zeroing around it."""
    from hf_elixir.measure import host_rate

    monkeypatch.setenv(KERNEL_ENV, kernel)
    calls = {"one_pass": 0, "torch": 0}
    one_pass, torch_update = OnePassAdam.update, host_rate.apply_update

    def counted_one_pass(self, *args, **kwargs):
        calls["one_pass"] += 1
        return one_pass(self, *args, **kwargs)

    def counted_torch(*args, **kwargs):
        calls["torch"] += 1
        return torch_update(*args, **kwargs)

    monkeypatch.setattr(OnePassAdam, "update", counted_one_pass)
    monkeypatch.setattr(host_rate, "apply_update", counted_torch)
    rate = host_rate.host_update_rate(1 << 16, threads=1)
    assert rate > 0
    used, unused = ("one_pass", "torch") if kernel == "c" else ("torch", "one_pass")
    assert calls[used] >= 4 and calls[unused] == 0, calls


def test_a_view_the_loop_cannot_read_flat_is_refused(fresh_cache: Path) -> None:
    """The loop reads raw pointers: a strided view would have it write past the run. It is
    refused before anything changes, the step count included."""
    runner = OnePassAdam(1)
    flat = torch.zeros(64)
    b = {"params": [flat[::2]], "grads": [torch.zeros(32)], "exp_avg": [torch.zeros(32)],
         "exp_avg_sq": [torch.zeros(32)], "steps": [torch.zeros(())]}
    with pytest.raises(RuntimeError, match="contiguous CPU views"):
        runner.update("adamw", GROUP, b, [None])
    assert torch.equal(flat, torch.zeros(64)) and float(b["steps"][0]) == 0.0  # refused before any change


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, None])
def test_the_clipping_factor_is_the_separate_multiply_bit_for_bit(fresh_cache: Path,
                                                                  copy_dtype: torch.dtype | None) -> None:
    """The loop's gradient factor (clipping's, left pending on a host chunk) gives, bit for
    bit, what ``grad.mul_(factor)`` and then the loop gave, and leaves the gradient as it was;
    a factor of 1 changes nothing. Runs long enough to be split between the threads."""
    torch.set_num_threads(2)
    runner = OnePassAdam(2)
    gen = torch.Generator().manual_seed(3)
    n = 2 * SPLIT_AT + 7
    for factor in (0.3, 1.0, 0.0123):
        f = torch.tensor(factor, dtype=torch.float32)
        base = {name: torch.randn(n, generator=gen) for name in ("params", "grads")}
        base["exp_avg"] = torch.randn(n, generator=gen) * 1e-3
        base["exp_avg_sq"] = torch.rand(n, generator=gen) * 1e-4
        runs = {}
        for folded in (True, False):
            t = {name: v.clone() for name, v in base.items()}
            if not folded:
                t["grads"].mul_(f)
            out = torch.empty(n, dtype=copy_dtype) if copy_dtype is not None else None
            batch = {name: [v] for name, v in t.items()} | {"steps": [torch.zeros(())]}
            for _ in range(2):
                runner.update("adamw", GROUP, batch, [out], float(f) if folded else 1.0)
            runs[folded] = (t, out)
        (ours, out_ours), (theirs, out_theirs) = runs[True], runs[False]
        for name in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[name], theirs[name]), (factor, name)
        assert out_ours is None or torch.equal(out_ours, out_theirs)
        assert torch.equal(ours["grads"], base["grads"])  # the factor stays pending
