"""What the host does per offloaded element in a GPU step, timed as the runtime runs it.

The planner prices a GPU machine's offloaded updates at ``cpu_adam_throughput``. Priced as
the AdamW kernel alone, it left out about half the bytes the host moves for each offloaded
parameter: the downloaded gradient's way into the fp32 shard, the clipping norm and
scaling, the compute-dtype copy. A calibration on a GPU machine times all of it here.
"""

from __future__ import annotations

import torch

from hf_elixir.measure.calibrate import median_time
from hf_elixir.optimizers import RATE_REFERENCE, spec
from hf_elixir.runtime.host_kernel import OnePassAdam
from hf_elixir.runtime.threads import using_threads
from hf_elixir.runtime.update import apply_update


#: the ways ``host_update_rate`` can take the step, slowest first (``benchmarks/bench_host_step.py``
#: times them in this order)
ARMS = ("plain", "clip_pass", "torch_kernel", "hf_elixir")


def host_update_rate(elems: int, threads: int, compute_dtype: torch.dtype = torch.bfloat16,
                     arm: str = "hf_elixir") -> float:
    """Elements/s of everything the host does, per element of an offloaded chunk, in a step
    on a GPU, with the runtime's own kernels and the threads its host update uses
    (``runtime/threads.py``): the downloaded compute-dtype gradient copied into the fp32
    gradient shard (the step's one download: ``zero_grad`` left the clearing to it, in
    ``disk_tier.clear_grad``), the clipping norm (``grad_shards.py``), and the update with
    its compute-dtype copy and the clipping's scaling (``host_kernel.py``'s one-pass loop, or
    a scaling pass, PyTorch's fused kernel and a cast where the loop is not usable).

    ``arm`` (one of :data:`ARMS`) takes it another way, for comparison:

    - ``clip_pass``: the clipping's scaling as a pass of its own before the update, as the
      runtime took it before the loop took the factor;
    - ``torch_kernel``: PyTorch's fused kernel after a scaling pass, then the cast, as where
      the loop is not usable;
    - ``plain``: the same step as PyTorch's own operations take it, the gradient added into a
      zeroed shard and the shard zeroed again."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    plain = arm == "plain"
    group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    master, grad, m, v = (torch.zeros(elems) for _ in range(4))
    master.normal_()
    staging = torch.randn(elems).to(compute_dtype)  # what a download leaves (pinned on a GPU machine)
    batch = {"params": [master], "grads": [grad], "exp_avg": [m], "exp_avg_sq": [v], "steps": [torch.zeros(())]}
    one_pass = OnePassAdam(threads)
    loop = one_pass if one_pass.usable and arm != "torch_kernel" else None

    def host_step() -> None:
        if plain:
            grad.add_(staging)
        else:
            grad.copy_(staging)
        coef = torch.clamp(1.0 / (torch.linalg.vector_norm(grad) + 1e-6), max=1.0)
        separate = arm in ("plain", "clip_pass") or loop is None
        if separate:  # PyTorch's clipping scales the gradient in a pass of its own
            grad.mul_(coef)
        if loop is not None:  # the loop multiplies by the factor as it reads (Chunk.grad_factor)
            loop.update(spec(RATE_REFERENCE), group, batch, [staging], 1.0 if separate else float(coef))
        else:
            apply_update(spec(RATE_REFERENCE), group, master.device, batch, set())
            staging.copy_(master)
        if plain:
            grad.zero_()

    with using_threads(threads):
        return elems / median_time(host_step, repeat=5)
