"""``summary(plan)``: a table that explains the plan the search chose and what it beat."""

from __future__ import annotations

from typing import Any

from hf_elixir.vocab import format_bytes

_MEM_ORDER = ("parameters", "frozen_shards", "master_weights", "optimizer_state", "gradients", "rcache",
              "activations", "buffers", "frozen_and_buffers", "margin")


#: the block policies as the table abbreviates them
_POLICY_SHORT = {"keep": "keep", "recompute": "rec", "recompute_offload": "rec+off", "offload": "off"}


def policy_cell(policies: list[str]) -> str:
    """Runs of blocks with one policy, compactly: ``0-29 rec+off, 30-31 rec``."""
    out: list[str] = []
    start = 0
    for i in range(1, len(policies) + 1):
        if i == len(policies) or policies[i] != policies[start]:
            span = f"{start}-{i - 1}" if i - 1 > start else f"{start}"
            out.append(f"{span} {_POLICY_SHORT.get(policies[start], policies[start])}")
            start = i
    return ", ".join(out)


def _long_context_cells(d: dict[str, Any]) -> list[str]:
    """The blocks' policies and the logits' pieces (and the MLP's tiles) of one row."""
    policies = d.get("block_policies") or []
    blocks = policy_cell(policies) if policies else ("all rec" if d["activation_checkpointing"] else "all keep")
    piece = d.get("logit_piece_tokens", 0)
    logits = f"pieces of {piece}" if piece else "whole"
    tiles = d.get("mlp_tiles", 1)
    return [blocks, logits + (f", MLP x{tiles}" if tiles > 1 else "")]


def _row(label: str, d: dict[str, Any], frozen: bool, long_context: bool = False) -> list[str]:
    """One table row; ``frozen``: the plan has frozen chunks, so the frozen columns are shown
    (trainable offload counts are then out of the trainable chunks); ``long_context``: some
    row has per-block policies, logit pieces or MLP tiles, so their columns are shown."""
    t = d.get("time", {})
    n = d.get("n_chunks") or 1
    nf = d.get("frozen_chunks", 0)
    nt = max(1, n - nf)
    row = [
        label,
        f"{d['chunk_size'] / 1e6:.2f}M x{n}",
        str(d["rcache_blocks"]),
        "on" if d["activation_checkpointing"] else "off",
        *(_long_context_cells(d) if long_context else []),
        str(d["prefetch_depth"]),
        f"{d['optim_offload_chunks']}/{nt}" + (f" ({d['optim_disk_chunks']} disk)" if d.get("optim_disk_chunks") else ""),
        f"{d['param_offload_chunks']}/{nt}",
    ]
    if frozen:
        row += [f"{d.get('frozen_offload_chunks', 0)}/{nf}",
                format_bytes(d.get("memory", {}).get("frozen_shards", 0))]
    return row + [
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
        # disk chunks are host chunks whose state also lies on disk: counted here, and apart below
        "optim_offload_chunks": sum(c.optim_placement != "device" and not c.frozen for c in plan.chunks),
        "optim_disk_chunks": sum(c.optim_placement == "disk" and not c.frozen for c in plan.chunks),
        "param_offload_chunks": sum(c.param_placement == "cpu" and not c.frozen for c in plan.chunks),
        "frozen_chunks": sum(c.frozen for c in plan.chunks),
        "frozen_offload_chunks": sum(c.param_placement == "cpu" and c.frozen for c in plan.chunks),
        "peak_bytes": p.get("peak_bytes", 0), "step_time_s": p.get("step_time_s", 0.0),
        "memory": p.get("memory", {}), "time": p.get("time", {}), "reason": CHOICE_RULE,
        # in block order (the plan names each block; the search wrote them in order)
        "block_policies": list(plan.block_policies.values()),
        "logit_piece_tokens": plan.logit_piece_tokens,
        "mlp_tiles": plan.mlp_tiles,
    }


def _tiers(plan) -> list[str]:
    """The three tiers of a plan with a disk tier: what each holds per rank, and the disk's
    traffic and its price per step."""
    p, d = plan.predictions, plan.predictions["disk"]
    on_disk = sum(c.optim_placement == "disk" for c in plan.chunks)
    free = f", {format_bytes(d['free_bytes'])} free" if d.get("free_bytes") is not None else ""
    return [
        f"  tiers per rank: device {format_bytes(p['peak_bytes'])} (peak), host "
        f"{format_bytes(p.get('host_bytes_per_rank', 0))}, disk {format_bytes(d['bytes_per_rank'])} "
        f"({on_disk} chunk(s); {format_bytes(d['bytes_per_node'])} per machine{free})",
        f"  disk traffic per step: {format_bytes(d['read_bytes_per_step'])} read + "
        f"{format_bytes(d['write_bytes_per_step'])} written per rank at {d['read_bandwidth'] / 1e9:.2f} / "
        f"{d['write_bandwidth'] / 1e9:.2f} GB/s, {d['seconds_per_step'] * 1e3:.0f} ms "
        f"({d['exposed_seconds'] * 1e3:.0f} ms not hidden behind the host update)",
    ]


def summary(plan) -> str:
    """Render the chosen plan, its memory and time breakdown and the runners-up as text."""
    p = plan.predictions
    lines: list[str] = []
    head = f"Elixir plan for {p.get('model', 'model')}" if p else "Elixir plan"
    lines.append(head)
    frozen = bool(plan.frozen_chunks)
    per = _per(plan)
    if p:
        n_frozen = p.get("frozen", {}).get("params", 0)
        lines.append(
            f"  {p.get('n_params', 0) / 1e6:.1f}M trainable"
            + (f" + {n_frozen / 1e6:.1f}M frozen" if n_frozen else "")
            + f" parameters, {plan.compute_dtype}, "
            f"{p.get('optimizer', '?')}, batch {p.get('batch_size')} x {p.get('seq_len')} per device, "
            f"world size {plan.world_size}{_machines(p)} on {p.get('hardware')}"
        )
        lines.append(
            f"  predicted peak {format_bytes(p['peak_bytes'])} of {format_bytes(p['budget_bytes'])} "
            f"budget; step {p['step_time_s'] * 1e3:.1f} ms"
            + (f", {p['tokens_per_s']:.0f} tokens/s" if p.get("tokens_per_s") else "")
        )
        host = p.get("host_bytes_per_rank")
        if host and p.get("device_type", "cuda") == "cuda":
            node = host * p.get("ranks_per_node", plan.world_size)
            lines.append(f"  host memory for offloaded state: {format_bytes(host)} per GPU, "
                         f"{format_bytes(node)} per machine")
        if p.get("disk"):
            lines += _tiers(plan)
        lines += _long_context_lines(plan)
        if plan.micro_batch_split > 1:
            b = p.get("batch_size")
            lines.append(f"  micro-batch: each batch of {b * plan.micro_batch_split if b else '?'} per device runs as "
                         f"{plan.micro_batch_split} micro-batches of {b} (the batch does not fit; the global "
                         "batch and the optimizer steps are unchanged)")
        if p.get("model_checkpointing"):
            lines.append("  activation checkpointing: the model's own, on before planning "
                         "(every plan below is priced with it)")
        eff = p.get("compute_efficiency")
        if eff:
            lines.append(f"  compute priced at {_efficiency_source(eff)}")
        lines.append("")
        lines.append(f"  memory per device (one {per}):")
        mem = p.get("memory", {})
        for k in _MEM_ORDER:
            if k in mem:
                lines.append(f"    {k:<20} {format_bytes(mem[k]):>12}")
        lines.append("  step time:")
        for k, v in p.get("time", {}).items():
            lines.append(f"    {k:<22} {v * 1e3:>10.2f} ms")
        lines.append("")
    entries = ([("chosen", chosen_as_dict(plan))] if p else []) + [
        (f"alt {i + 1}", a) for i, a in enumerate(plan.alternatives)]
    long_context = any(d.get("block_policies") or d.get("logit_piece_tokens") or d.get("mlp_tiles", 1) > 1
                       for _, d in entries)
    header = ["", "chunks", "rCache", "ckpt", *(["blocks", "logits"] if long_context else []),
              "prefetch", "optim off", "param off",
              *(["frozen off", f"frozen/{per}"] if frozen else []), f"peak/{per}",
              "step", "comp/comm/opt/cpu ms", "why"]
    rows = [header] + [_row(label, d, frozen, long_context) for label, d in entries]
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


def _long_context_lines(plan) -> list[str]:
    """The long-context levers the plan uses, in words: each run of blocks' policy, the
    logit pieces, the MLP's tiles and the pinned host memory offloaded activations take."""
    lc = plan.predictions.get("long_context")
    if not lc:  # a plan made by hand: only the field says
        return [f"  MLP over {plan.mlp_tiles} sequence tiles (one tile's intermediate at a time, each tile "
                "recomputed in backward)"] if plan.mlp_tiles > 1 else []
    names = {"keep": "kept", "recompute": "recomputed", "recompute_offload": "recomputed from an input in host "
             "memory", "offload": "kept in host memory"}
    runs = "; ".join(f"block{'s' if a != b else ''} {a}{'-' + str(b) if a != b else ''} {names.get(pol, pol)}"
                     for a, b, pol in lc.get("block_policy_runs", []))
    out = []
    if runs:
        out.append(f"  activations: {runs}")
    if lc.get("pinned_activation_bytes"):
        out.append(f"  pinned host memory for offloaded activations: "
                   f"{format_bytes(lc['pinned_activation_bytes'])} per GPU (in the host memory above)")
    piece = lc.get("logit_piece_tokens", 0)
    out.append(f"  logits: {'in pieces of ' + str(piece) + ' tokens (one piece and its gradient at a time)' if piece else 'whole'}")
    if plan.mlp_tiles > 1:
        out.append(f"  MLP over {plan.mlp_tiles} sequence tiles (one tile's intermediate at a time, "
                   "each tile recomputed in backward)")
    return out


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


def _machines(p: dict[str, Any]) -> str:
    """The cluster shape priced, when the ranks span machines: their collectives run at the
    link between machines, so a reader must know the plan assumed it."""
    nodes = p.get("nodes", 1)
    if nodes <= 1:
        return ""
    link = p.get("inter_node_bandwidth")
    return (f" ({nodes} machines x {p.get('ranks_per_node')} ranks, collectives across machines priced at "
            f"{format_bytes(link)}/s)" if link else f" ({nodes} machines x {p.get('ranks_per_node')} ranks)")


def _per(plan) -> str:
    """What one rank runs on, for labels: a GPU, or a rank of a CPU machine."""
    return "GPU" if plan.predictions.get("device_type", "cuda") == "cuda" else "rank"


def frozen_notes(plan) -> list[str]:
    """The frozen weights: how large they are, what each rank holds of them, and whether
    holding them whole on every rank (as DDP does, or FSDP1/ZeRO without frozen sharding)
    would have fitted the budget."""
    p = plan.predictions
    info = p.get("frozen") or {}
    if not plan.frozen_chunks or not info.get("bytes"):
        return []
    per = _per(plan)
    whole, shards = info["bytes"], info["shard_bytes_per_rank"]
    on_device = p.get("memory", {}).get("frozen_shards", 0)
    packed = info.get("packed_params", 0)
    held = (f"{packed / 1e6:.1f}M of them packed in 4 bits, the rest in {plan.compute_dtype}" if packed
            else f"in {plan.compute_dtype}")
    out = [f"  frozen weights: {info['params'] / 1e6:.1f}M parameters, {format_bytes(whole)} "
           f"({whole / 1e9:.1f} GB) {held}, in {info['chunks']} frozen chunks; "
           f"sharded over {plan.world_size} ranks: {format_bytes(shards)} per {per}"
           + (f", {info['offloaded_chunks']} chunks of them in CPU memory ({format_bytes(on_device)} on the {per})"
              if info.get("offloaded_chunks") else "")]
    budget = p.get("budget_bytes")
    if budget:
        margin = p.get("margin", {}).get("allocator_fraction", 0.0)
        replicated = p["peak_bytes"] + (whole - on_device) * (1 + margin)
        if whole > budget:
            verdict = (f"would not have fitted on one {per}: the base alone exceeds the "
                       f"{format_bytes(budget)} per {per}")
        elif replicated > budget:
            verdict = (f"would not have fitted: about {format_bytes(replicated)} per {per}, over the "
                       f"{format_bytes(budget)} budget")
        else:
            verdict = f"would fit too (about {format_bytes(replicated)} per {per})"
        out.append(f"  replicated on every {per} instead ({whole / 1e9:.1f} GB each), the frozen base {verdict}")
    return out


def _notes(plan) -> list[str]:
    """What departs from the uniform picture above: frozen weights, oversized chunks,
    borrowed reads."""
    out: list[str] = frozen_notes(plan)
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
