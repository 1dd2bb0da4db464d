"""What a plan's compute is priced at: a given efficiency, the calibration's figure for the
model's width, or the model itself timed on this machine.

Timing the model runs the real model on the real device, which belongs to the measuring room
above the runtime (``hf_elixir.measure.model_efficiency``). The planner sits below both, so it
does not import that room: the room registers its measuring function here
(``set_measurer``) when ``hf_elixir`` is imported, and the planner calls whatever is
registered.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from hf_elixir.hardware import ComputeFigures, HardwareProfile
from hf_elixir.planner.pricing import price
from hf_elixir.planner.record import PlanError
from hf_elixir.profile.profiler import ModelProfile

#: the function that times a model here (``hf_elixir.measure.model_efficiency.measure``)
_MEASURER: Optional[Callable[..., Any]] = None


def set_measurer(measure: Callable[..., Any]) -> None:
    """Register the function that times a model on this machine for ``efficiency="auto"`` /
    ``"measure"``: called as ``measure(model, (batch, seq), figures, device, dtype,
    ranks_per_node=, priced_whole=, device_memory=)`` and returning an object with
    ``efficiency`` and ``as_dict()``, or None when it could not time the model."""
    global _MEASURER
    _MEASURER = measure


def compute_figures(profile: ModelProfile, hw: HardwareProfile, world_size: int,
                    efficiency: float | None = None) -> ComputeFigures:
    """The figures one rank's compute is priced with: the calibrated ones, at ``efficiency``
    when this model's own was measured, else at the calibrated one for its width."""
    figs = hw.compute_figures(min(world_size, hw.gpus_per_node))
    if efficiency is not None:
        return replace(figs, efficiency=efficiency)
    return figs.for_width(profile.hidden_size)


#: Compute time of a run whose decoder blocks are compiled (``compile=``, docs/design.md
#: "torch.compile") over the same run eager: an ASSUMPTION, not a measurement. Compile fuses
#: the element-wise work around the matmuls (norms, activations, residual adds, dropout) and
#: drops per-operator dispatch; the matmuls, which are most of a large model's FLOPs, run the
#: same kernels. Applied to the whole step's compute although embeddings, head and loss stay
#: eager. ``hf-elixir plan --compile`` prices with it and says it is an estimate; calibration
#: does not time a compiled block yet, which is what would replace this figure.
COMPILED_COMPUTE_FACTOR = 0.85


def compiled_efficiency(mode: float | str, profile_hidden_size: int | None, hw: HardwareProfile,
                        world_size: int) -> dict[str, Any]:
    """The efficiency a compiled run's compute is priced at: the eager one (``mode`` when a
    number, else the calibration's figure for the model's width) times
    ``COMPILED_COMPUTE_FACTOR``. ``"measure"`` is refused: it would time the eager model and
    call the result compiled. Returns ``{"value", "eager", "factor", "source": "estimate"}``."""
    check_efficiency(mode)
    if mode == "measure":
        raise PlanError("a compiled plan cannot use efficiency='measure': the measurement times the eager "
                        "model, and calibration does not time a compiled block yet; use 'calibrated' or a number")
    if isinstance(mode, (int, float)) and not isinstance(mode, bool):
        eager = float(mode)
    else:
        eager = hw.compute_figures(min(world_size, hw.gpus_per_node)).efficiency_at(profile_hidden_size)
    return {"value": eager * COMPILED_COMPUTE_FACTOR, "eager": eager, "factor": COMPILED_COMPUTE_FACTOR,
            "source": "estimate"}


def local_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_efficiency(mode: float | str) -> None:
    """Refuse an efficiency the search cannot price with, before anything is profiled: a
    number must be finite and positive (NaN or infinity would price every step at nothing,
    and the search would crash or pick at random), a word one of the three."""
    if isinstance(mode, (int, float)) and not isinstance(mode, bool):
        if not math.isfinite(mode) or mode <= 0:
            raise PlanError(f"efficiency must be a finite, positive number, got {mode}")
    elif mode not in ("auto", "measure", "calibrated"):
        raise PlanError(f"efficiency must be a number, 'auto', 'measure' or 'calibrated'; got {mode!r}")


def model_efficiency(mode: float | str, model: Any, profile: ModelProfile, hw: HardwareProfile,
                     world_size: int, compute_dtype: str) -> dict[str, Any]:
    """What the plan's compute is priced at, and where that figure comes from.

    ``mode``: a number (taken as it is), ``"calibrated"`` (the calibration's width curve),
    ``"measure"`` (time this model here), or ``"auto"``: measure when ``hw`` holds figures
    calibrated on a machine of this kind, since only then are the model's timings and the
    prices comparable. Returns ``{"value": float | None, "source": str, ...details}``.
    """
    check_efficiency(mode)
    if isinstance(mode, (int, float)) and not isinstance(mode, bool):
        return {"value": float(mode), "source": "given"}
    local = bool(hw.compute) and hw.device_type == local_device_type()
    # a model on the meta device (``hf_elixir.profile.lora``'s LoRA fine-tunes) has no values
    # to run: only its config could be timed, and it is not at hand
    on_meta = isinstance(model, nn.Module) and any(p.is_meta for p in model.parameters())
    if mode == "measure" and on_meta:
        raise PlanError("efficiency='measure' times the model, but this one is on the meta device (no "
                        "values to run): pass the real model or its config, or efficiency='calibrated'")
    if mode == "calibrated" or (mode == "auto" and (not local or on_meta)):
        return {"value": None, "source": "calibrated"}
    if not local:
        raise PlanError(
            f"efficiency='measure' times the model on this machine, but the hardware profile "
            f"{hw.name!r} is not a calibration of it (a {local_device_type()} machine): run "
            "`hf-elixir calibrate` and plan with HardwareProfile.detect(), or pass efficiency='calibrated'"
        )
    figs = hw.compute_figures(min(world_size, hw.gpus_per_node))
    priced = sum(price(w, figs, compute_dtype, efficiency=1.0) for w in profile.plain.trace.work)
    device = torch.device("cuda", torch.cuda.current_device()) if hw.device_type == "cuda" else torch.device("cpu")
    if _MEASURER is None:
        raise PlanError("efficiency='measure' needs the measuring room (hf_elixir.measure), which is not "
                        "installed in this process; import hf_elixir first, or pass efficiency='calibrated'")
    found = _MEASURER(model, (profile.batch_size, profile.seq_len), figs, device, compute_dtype,
                              ranks_per_node=min(world_size, hw.gpus_per_node), priced_whole=priced,
                              device_memory=hw.device_memory)
    if found is None:
        return {"value": None, "source": "calibrated"}
    return {"value": found.efficiency, "source": "measured", **found.as_dict()}
