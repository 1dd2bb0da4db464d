"""``summary(plan)``: a table that explains the plan the search chose and what it beat."""

from __future__ import annotations

from typing import Any

from hf_elixir.hardware import format_bytes

_MEM_ORDER = ("parameters", "master_weights", "optimizer_state", "gradients", "rcache",
              "activations", "frozen_and_buffers", "margin")


def _row(label: str, d: dict[str, Any]) -> list[str]:
    t = d.get("time", {})
    n = d.get("n_chunks") or 1
    return [
        label,
        f"{d['chunk_size'] / 1e6:.2f}M x{n}",
        str(d["rcache_blocks"]),
        "on" if d["activation_checkpointing"] else "off",
        str(d["prefetch_depth"]),
        f"{d['optim_offload_chunks']}/{n}",
        f"{d['param_offload_chunks']}/{n}",
        format_bytes(d["peak_bytes"]),
        f"{d['step_time_s'] * 1e3:.1f} ms",
        f"{t.get('compute', 0) * 1e3:.1f}/{t.get('exposed_communication', 0) * 1e3:.1f}/"
        f"{t.get('device_optimizer', 0) * 1e3:.1f}/{t.get('exposed_cpu', 0) * 1e3:.1f}",
        d.get("reason", ""),
    ]


# The search's rule (search.py's docstring), stated where the choice is shown.
CHOICE_RULE = "chosen: fastest that fits; offloading must be >2% faster, and never more to be faster"


def chosen_as_dict(plan) -> dict[str, Any]:
    p = plan.predictions
    return {
        "chunk_size": plan.chunk_size, "n_chunks": plan.n_chunks,
        "rcache_blocks": plan.rcache_blocks, "activation_checkpointing": plan.activation_checkpointing,
        "prefetch_depth": plan.prefetch_depth,
        "optim_offload_chunks": sum(c.optim_placement == "cpu" for c in plan.chunks),
        "param_offload_chunks": sum(c.param_placement == "cpu" for c in plan.chunks),
        "peak_bytes": p.get("peak_bytes", 0), "step_time_s": p.get("step_time_s", 0.0),
        "memory": p.get("memory", {}), "time": p.get("time", {}), "reason": CHOICE_RULE,
    }


def summary(plan) -> str:
    """Render the chosen plan, its memory and time breakdown and the runners-up as text."""
    p = plan.predictions
    lines: list[str] = []
    head = f"Elixir plan for {p.get('model', 'model')}" if p else "Elixir plan"
    lines.append(head)
    if p:
        lines.append(
            f"  {p.get('n_params', 0) / 1e6:.1f}M trainable parameters, {plan.compute_dtype}, "
            f"{p.get('optimizer', '?')}, batch {p.get('batch_size')} x {p.get('seq_len')} per device, "
            f"world size {plan.world_size} on {p.get('hardware')}"
        )
        lines.append(
            f"  predicted peak {format_bytes(p['peak_bytes'])} of {format_bytes(p['budget_bytes'])} "
            f"budget; step {p['step_time_s'] * 1e3:.1f} ms"
            + (f", {p['tokens_per_s']:.0f} tokens/s" if p.get("tokens_per_s") else "")
        )
        eff = p.get("compute_efficiency")
        if eff:
            lines.append(f"  compute priced at {_efficiency_source(eff)}")
        lines.append("")
        lines.append("  memory per device:")
        mem = p.get("memory", {})
        for k in _MEM_ORDER:
            if k in mem:
                lines.append(f"    {k:<20} {format_bytes(mem[k]):>12}")
        lines.append("  step time:")
        for k, v in p.get("time", {}).items():
            lines.append(f"    {k:<22} {v * 1e3:>10.2f} ms")
        lines.append("")
    header = ["", "chunks", "rCache", "ckpt", "prefetch", "optim off", "param off", "peak",
              "step", "comp/comm/opt/cpu ms", "why"]
    rows = [header]
    if p:
        rows.append(_row("chosen", chosen_as_dict(plan)))
    for i, a in enumerate(plan.alternatives):
        rows.append(_row(f"alt {i + 1}", a))
    if len(rows) > 1:
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    else:
        lines.append(f"  {plan.n_chunks} chunks of {plan.chunk_size} elements, rCache "
                     f"{plan.rcache_blocks}, checkpointing {plan.activation_checkpointing}, "
                     f"optimizer offload {plan.offload_fraction():.0%} (no predictions recorded)")
    lines.extend(_notes(plan))
    return "\n".join(lines)


def _efficiency_source(eff: dict[str, Any]) -> str:
    """Where the efficiency the compute was priced at came from, in words."""
    used = f"{eff.get('used', eff.get('value')):.2f}x the per-operator figures"
    if eff.get("source") == "measured":
        timed = eff["blocks_timed"]
        what = "the whole model" if timed == [eff["blocks"]] else f"copies with {' and '.join(map(str, timed))} of its {eff['blocks']} blocks"
        return (f"{used}: measured on this machine ({what}, {eff['ranks']} rank(s) busy: "
                f"{eff['measured_s'] * 1e3:.1f} ms against {eff['priced_s'] * 1e3:.1f} ms priced, in {eff['seconds']:.1f} s)")
    if eff.get("source") == "given":
        return f"{used} (given)"
    return f"{used} (calibrated for the model's width)"


def _notes(plan) -> list[str]:
    """What departs from the uniform picture above: oversized chunks, borrowed reads."""
    out: list[str] = []
    if plan.min_rcache_blocks:
        out.append(f"  rCache minimum for this model and packing: {plan.min_rcache_blocks} blocks")
    for i, c in enumerate(plan.chunks):
        if c.numel > plan.chunk_size:
            out.append(f"  chunk {i} holds {c.params[0]} alone: {c.numel} elements, more than "
                       f"chunk_size {plan.chunk_size} (its rCache block is that large)")
    for module, params in plan.borrowed.items():
        out.append(f"  {module or '(root)'} reads {', '.join(params)} without owning them: "
                   "fetched for it as well")
    return out
