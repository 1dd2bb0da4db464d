"""ElixirModule: wraps a model so its parameters live in sharded chunks.

The wrapped model keeps its own parameter objects, names and shapes; only where their data
lives changes. Forward, backward, evaluation and ``generate()`` run the model's own code;
hooks gather each chunk just before a module needs it (see hooks.py).
"""

from __future__ import annotations

import array
import atexit
import contextlib
import dataclasses
import weakref
import zlib
from typing import Any, Collection, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from hf_elixir.planner.record import ElixirPlan, PlanError, chunk_layout
from hf_elixir.profile.params import chunk_numel, is_packed
from hf_elixir.profile.profiler import enable_checkpointing, model_checkpoints
from hf_elixir.runtime.activation_offload import ActivationOffloader
from hf_elixir.runtime.block_policies import BlockPolicies, check_block_policies, uses_checkpointing
from hf_elixir.runtime.cache import RCache
from hf_elixir.runtime.chunk import Chunk, ChunkState, Slot
from hf_elixir.runtime.comm import Collectives
from hf_elixir.runtime.compiled import CompileOptions, RegionalCompile
from hf_elixir.runtime.devices import move_to_device, pinned_pool, resolve_device
from hf_elixir.runtime.disk_tier import DiskTier, clear_grad, prepare as prepare_disk
from hf_elixir.runtime.fetch import Fetcher
from hf_elixir.runtime.hooks import HookManager, in_backward
from hf_elixir.runtime.host_update import HostUpdates
from hf_elixir.runtime.host_memory import HeapGuard, keep_freed_host_memory, warn_if_heap_fragments
from hf_elixir.runtime.ledger import MemoryLedger
from hf_elixir.runtime.logit_pieces import PieceWiring, wire as wire_logit_pieces
from hf_elixir.runtime.mlp_tiles import MlpTiles, check_mlp_tiles
from hf_elixir.runtime.recovery import Recovery, Replanner, adopt_plan
from hf_elixir.runtime.packed import prepare_packed_layers
from hf_elixir.runtime.reduce import GradReducer
from hf_elixir.runtime.released import mark_released
from hf_elixir.runtime.threads import host_threads
from hf_elixir.runtime.timing import StepClock, summarize
from hf_elixir.runtime.weights import check_state_dict, gather_state, load_into_chunks

_WRAPPED_ATTR = "_hf_elixir_wrapped"


class ElixirModule(nn.Module):
    """Shards ``model``'s parameters into the chunks ``plan`` describes: trainable ones into
    trainable chunks (fp32 master, gradient and optimizer shards), frozen ones into frozen
    chunks (compute-dtype shards only). While a chunk is released its parameters are
    unreadable stand-ins (``runtime/released.py``): read inside the model's forward or
    backward they are gathered on the spot; read elsewhere they raise, naming the parameter
    (``gathered_parameters()`` reads them there).

    Args:
        model: the model, with real parameters on the CPU (or the compute device).
        plan: an ElixirPlan for this model and this world size.
        process_group: the group to shard over (default: the default group, if any).
        device: the compute device (default: ``cuda:LOCAL_RANK`` when CUDA is available,
            else CPU; ``"cpu"`` forces the CPU). Inputs to forward() and generate() are moved
            there, as FSDP2 does.
        sync_module_states: start every rank from rank 0's parameters and buffers.
        recover_oom: when a training step runs out of memory, re-plan and redo it instead of
            failing (runtime/recovery.py).
        replanner: ``(plan, attempt) -> plan`` for a recovery (default: ``planner.replan.tighten``).
        nvme_path: the directory for chunks the plan keeps on disk (default ``ELIXIR_NVME_PATH``;
            runtime/disk_tier.py).
        logit_piece_tokens: run the LM head and its loss in pieces of this many tokens (0:
            whole logits), instead of the plan's ``logit_piece_tokens``; where the model's head
            or loss is not of the shape the pieces replace, it runs whole and
            ``logit_pieces.note`` says why (runtime/logit_pieces.py).
        compile: torch.compile each repeated block (decoder layer), hooks outside: True
            (inductor), a backend name, a dict of torch.compile options or CompileOptions
            (runtime/compiled.py); where it cannot apply, a warning says why and it runs eager.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: ElixirPlan,
        process_group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        sync_module_states: bool = True,
        recover_oom: bool = True,
        replanner: Optional[Replanner] = None,
        nvme_path: Optional[str] = None,
        logit_piece_tokens: Optional[int] = None,
        compile: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ElixirModule wraps an nn.Module, got {type(model).__name__}")
        if isinstance(model, ElixirModule) or getattr(model, _WRAPPED_ATTR, False):
            raise ValueError(
                "this model is already wrapped by ElixirModule; wrap the original model once"
            )
        if not isinstance(plan, ElixirPlan):
            raise TypeError(f"plan must be an ElixirPlan, got {type(plan).__name__}")
        world_size = dist.get_world_size(process_group) if (
            process_group is not None or (dist.is_available() and dist.is_initialized())
        ) else 1
        if logit_piece_tokens is not None:  # the caller's choice over the plan's
            plan = dataclasses.replace(plan, logit_piece_tokens=int(logit_piece_tokens))
        plan.validate(model, world_size=world_size)
        if uses_checkpointing(plan) and not (
            hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")
        ):
            raise PlanError(
                f"the plan checkpoints activations but {type(model).__name__} has no "
                "gradient_checkpointing_enable(); make a plan without activation checkpointing"
            )
        check_block_policies(model, plan)
        check_mlp_tiles(model, plan)
        disk_plan = prepare_disk(plan, model, world_size, resolve_device(device), nvme_path)
        #: the blocks compiled one at a time, each fetched whole (runtime/compiled.py)
        self.compiled = RegionalCompile.prepare(model, CompileOptions.parse(compile), plan)
        # ---- validated: from here on the model is changed
        super().__init__()
        self.module = model
        self.plan = plan
        self.device = resolve_device(device)
        self.comm = Collectives.create(process_group, self.device)
        # on a CPU device the heap is the device memory: keep it mapped, and bounded
        # (runtime/host_memory.py)
        self.heap_guard: Optional[HeapGuard] = None
        if self.device.type == "cpu":
            keep_freed_host_memory()
            warn_if_heap_fragments(self.comm.world_size)
            self.heap_guard = HeapGuard()
        # uploads of offloaded shards overlap compute on their own stream, and the downloads
        # of reduced gradients on another (uploads go on during backward when parameters are
        # offloaded: one stream would queue each behind the other)
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.download_stream = torch.cuda.Stream(self.device) if cuda else None
        self.ledger = MemoryLedger()
        self.dtype = plan.dtype
        #: chunks whose master and optimizer state live in files (runtime/disk_tier.py)
        self.disk: Optional[DiskTier] = disk_plan.open(self.comm.rank) if disk_plan is not None else None
        # one element of storage, viewed at each released parameter's own shape with zero
        # strides (released.py): no memory, yet autograd records the real shape when a
        # released weight enters a custom Function (whose apply() bypasses __torch_function__)
        self._placeholder = torch.zeros(1, dtype=self.dtype, device=self.device)
        self._own_checkpointing = False  # whether this runtime turned the model's checkpointing on
        if uses_checkpointing(plan) and not model_checkpoints(model):
            # the model's own setting, when on, is the user's (layers, offload): kept as it is
            enable_checkpointing(model)
            self._own_checkpointing = True
        #: the saved activations of blocks the plan offloads (runtime/activation_offload.py),
        #: and each block's policy (runtime/block_policies.py)
        self.activations = ActivationOffloader(self.device, self.ledger)
        self.block_policies = BlockPolicies(model, self.activations)
        self.block_policies.apply(plan)
        #: each block's MLP over sequence tiles, at the current plan's count (runtime/mlp_tiles.py)
        self.mlp_tiles = MlpTiles.wire(model, plan, weakref.ref(self))
        prepare_packed_layers(model, self.device)
        self._move_untracked(sync_module_states)
        self.chunks, self.slots = self._build_chunks(sync_module_states)
        self._params = list(self.module.parameters())  # zero_grad's, without a walk of the modules
        self.slot_by_name = {s.name: s for s in self.slots}
        self._slot_of_param = {id(s.param): s for s in self.slots}
        self.cache = RCache(plan.rcache_blocks, agree=self._same_on_every_rank if self.comm.distributed else None)
        #: where each training step's time goes (runtime/timing.py; ``time_report()``)
        self.clock = StepClock(self.device)
        #: threads the optimizer's element-wise host work runs on (runtime/threads.py)
        self.host_threads = host_threads(self.comm.world_size)
        #: what runs the host-state updates (``ElixirOptimizer`` says; None before it is built)
        self.host_kernel: Optional[str] = None
        #: host-state updates running behind the next forward (runtime/host_update.py)
        self.host_updates = HostUpdates(self.host_threads if self.device.type == "cuda" else None)
        self.fetcher = Fetcher(self.chunks, self.cache, self.ledger, plan.prefetch_depth, self._placeholder,
                               clock=self.clock, host_updates=self.host_updates)
        self.reducer = GradReducer(self.chunks, self.comm, self.ledger, len(self.slots), clock=self.clock,
                                   host_updates=self.host_updates, disk=self.disk)
        self.hooks = HookManager(
            root=model,
            units=self._fetch_units(),
            slots=self.slots,
            slot_chunk=[self.chunks[self._slot_chunk[s.index]] for s in self.slots],
            fetcher=self.fetcher,
            reducer=self.reducer,
            cache=self.cache,
        )
        self.hooks.install()
        self.compiled.apply()
        self.recovery = Recovery(self, replanner=replanner, enabled=recover_oom)
        # injected failures fire with or without recovery (an opt-out run must fail as one)
        self.hooks.fault_check = self.recovery.check if self.recovery.injector is not None else None
        self.hooks.sync_units()  # an injected fault fires from the module hooks
        # without recovery, no collective is recorded for it and no backward ends in it
        self.comm.recording = recover_oom
        if recover_oom:
            self.hooks.on_backward_end = self.recovery.after_backward
        #: the LM head and its loss in pieces, or why not (runtime/logit_pieces.py); the
        #: pieces' size is read from the plan at each forward
        self.logit_pieces: PieceWiring = wire_logit_pieces(model, _piece_tokens(weakref.ref(self)), self.hooks.watch)
        setattr(model, _WRAPPED_ATTR, True)
        atexit.register(_drain_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ construction
    def _placement(self, where: str) -> torch.device:
        return self.device if where == "device" else torch.device("cpu")

    def _move_untracked(self, sync: bool) -> None:
        """Non-float parameters (8-bit storage, in no chunk) and buffers stay whole on every rank."""
        for p in self.module.parameters():
            if not p.is_floating_point() and not is_packed(p):
                data = p.data.to(self.device)
                if data.is_floating_point():
                    data = data.to(self.dtype)
                if sync:
                    self.comm.broadcast_from_first(data)
                p.data = data
        for mod in self.module.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is None:
                    continue
                buf = buf.to(self.device)
                if sync:
                    self.comm.broadcast_from_first(buf)
                mod._buffers[name] = buf

    def _layout(self) -> list[tuple[int, list[int]]]:
        """Per chunk: its size and its parameters' offsets (``chunk_layout``: ALIGN_BYTES-aligned
        offsets and shard boundaries; a chunk is as large as its contents, not
        plan.chunk_size, so partly filled chunks waste no memory)."""
        named = dict(self.module.named_parameters())
        return [chunk_layout([chunk_numel(named[name], self.dtype.itemsize) for name in cplan.params],
                             self.dtype.itemsize,
                             self.comm.world_size)
                for cplan in self.plan.chunks]

    def _host_buffers(self, layout: list[tuple[int, list[int]]]) -> tuple[dict, dict]:
        """Pinned host memory, only for what crosses PCIe and only with a CUDA device: one
        pool for offloaded parameter shards (gathered from the host), one for the staging
        buffers of shards whose optimizer runs on the host (the reduced gradient comes down
        through it and, for a shard kept on the device, the updated shard goes up). Master weights, gradient shards and
        optimizer moments that stay on the host are not pinned."""
        if self.device.type != "cuda":
            return {}, {}
        W = self.comm.world_size
        offloaded = [i for i, c in enumerate(self.plan.chunks) if c.param_placement == "cpu"]
        staged = [i for i, c in enumerate(self.plan.chunks) if c.optim_placement != "device" and not c.frozen]
        pools = []
        for ids in (offloaded, staged):
            views = pinned_pool(self.dtype, [layout[i][0] // W for i in ids]) if ids else []
            pools.append(dict(zip(ids, views)))
        return pools[0], pools[1]

    def _build_chunks(self, sync: bool) -> tuple[list[Chunk], list[Slot]]:
        named = dict(self.module.named_parameters())
        W, rank = self.comm.world_size, self.comm.rank
        layout = self._layout()
        host_shards, staging = self._host_buffers(layout)
        chunks: list[Chunk] = []
        slots: list[Slot] = []
        self._slot_chunk: list[int] = []
        for cid, (cplan, (size, offsets)) in enumerate(zip(self.plan.chunks, layout)):
            shard_size = size // W
            packed = [name for name in cplan.params if is_packed(named[name])]
            if packed and not cplan.frozen:
                raise PlanError(f"{packed[0]!r} is a packed 4-bit weight, which cannot be trained, but "
                                f"it requires grad (chunk {cid}); freeze it (requires_grad_(False)) "
                                "and train adapters over it")
            # a chunk holding packed bytes is built in the compute dtype (no float32 pass
            # would keep their bit patterns); its other values go through float32 as in the
            # other chunks, so their rounding is the same
            flat = torch.zeros(size, dtype=self.dtype if packed else torch.float32)
            chunk_slots: list[Slot] = []
            for name, offset in zip(cplan.params, offsets):
                p = named[name]
                slot = Slot(name, p, len(slots), offset, chunk_numel(p, self.dtype.itemsize), p.shape, p.dtype,
                            packed=is_packed(p),
                            stand_in=torch.zeros(1, dtype=p.dtype, device=self.device) if is_packed(p) else None)
                slot.view(flat).copy_(p.data if slot.packed else p.data.to(torch.float32))
                chunk_slots.append(slot)
                slots.append(slot)
                self._slot_chunk.append(cid)
            if sync and self.comm.distributed:
                flat = flat.to(self.device)
                self.comm.broadcast_from_first(flat)
            local = flat[rank * shard_size : (rank + 1) * shard_size]
            param_dev = self._placement(cplan.param_placement)
            optim_dev = self._placement(cplan.optim_placement)
            on_disk = self.disk is not None and self.disk.holds(cid)
            if cid in host_shards:
                shard = host_shards[cid]
                shard.copy_(local)
            else:
                shard = local.to(param_dev, dtype=self.dtype, copy=True)
            if cplan.frozen or (self.dtype == torch.float32 and param_dev == optim_dev):
                master = shard  # a frozen chunk has no master: it never changes
            elif on_disk:
                master = self.disk.put_master(cid, local.to("cpu", torch.float32))
            else:
                master = local.to(optim_dev, dtype=torch.float32, copy=True)
            grad_size = 0 if cplan.frozen else shard_size
            in_place = W == 1 and param_dev == self.device
            chunk = Chunk(
                index=cid, size=size, dtype=self.dtype, device=self.device,
                param_device=param_dev, optim_device=optim_dev, comm=self.comm, slots=chunk_slots,
                shard=shard, master=master,
                grad_shard=torch.zeros(grad_size, dtype=torch.float32, device="meta" if on_disk else optim_dev),
                full=shard if in_place else torch.empty(size, dtype=self.dtype, device=self.device),
                copy_stream=self.copy_stream, download_stream=self.download_stream,
                staging=None if cplan.frozen else staging.get(cid),
                frozen=cplan.frozen, disk=on_disk,
            )
            if not in_place:
                chunk.full.untyped_storage().resize_(0)
            for slot in chunk_slots:
                mark_released(slot.param, self._placeholder if slot.stand_in is None else slot.stand_in)
            shard_bytes = shard_size * self.dtype.itemsize
            if cplan.param_placement == "device":
                self.ledger.add("frozen_shards" if cplan.frozen else "param_shards", shard_bytes)
            if cplan.optim_placement == "device" and not cplan.frozen:
                self.ledger.add("grad_shards", shard_size * 4)
                if not chunk.master_aliased:
                    self.ledger.add("master_weights", shard_size * 4)
            chunks.append(chunk)
            del flat
        return chunks, slots

    def _fetch_units(self) -> dict[nn.Module, list[int]]:
        """Each module fetches the chunks of its own parameters; a fetch unit (a dynamic
        block such as a mixture-of-experts layer) fetches its whole subtree at once; a
        module whose forward reads parameters it does not own (``plan.borrowed``) fetches
        their chunks too, or it would read empty tensors."""
        chunk_of = {id(s.param): self._slot_chunk[s.index] for s in self.slots}
        chunk_by_name = {s.name: self._slot_chunk[s.index] for s in self.slots}
        unit_names = list(self.plan.fetch_units) + self.compiled.unit_names
        units: dict[nn.Module, list[int]] = {}
        for name, mod in self.module.named_modules():
            if any(name.startswith(u + ".") for u in unit_names if u):
                continue
            recurse = name in unit_names
            cids = {chunk_of[id(p)] for p in mod.parameters(recurse=recurse) if id(p) in chunk_of}
            cids.update(chunk_by_name[p] for reader, read in self.plan.borrowed.items()
                        if reader == name or (recurse and reader.startswith(name + ".")) for p in read)
            if cids:
                units[mod] = sorted(cids)
        return units

    def _same_on_every_rank(self, order: list[int]) -> bool:
        """Whether every rank holds this sequence (length and CRC compared in one all-reduce:
        the maximum of x and of -x give the largest and the smallest value over ranks)."""
        key = torch.tensor([len(order), zlib.crc32(array.array("q", order).tobytes())], dtype=torch.int64)
        both = self.comm.all_reduce(torch.cat([key, -key]), op="max")
        return bool((both[:2] == -both[2:]).all())

    # ------------------------------------------------------------------ running
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, with tensor inputs moved to the compute device."""
        args, kwargs = move_to_device((args, kwargs), self.device)
        self.comm.counter.forward_passes += 1
        training = self.module.training and torch.is_grad_enabled() and not in_backward()
        if training:
            self.clock.begin_pass()
        if training and self.recovery.enabled:
            return self.recovery.run_forward(lambda: self.module(*args, **kwargs), args, kwargs)
        return self.module(*args, **kwargs)

    def adopt_plan(self, plan: ElixirPlan) -> None:
        """Run from now on under ``plan``, which packs the parameters as the current plan does
        (a re-plan after running out of memory; ``recovery.adopt_plan``). Collective in effect:
        every rank calls it at the same point of the run, with the same plan."""
        adopt_plan(self, self.compiled.fit(plan))

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``generate()`` on inputs moved to the compute device; chunks are
        fetched as its modules run."""
        args, kwargs = move_to_device((args, kwargs), self.device)
        return self.module.generate(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted for API compatibility. Gradients are still reduce-scattered every micro-batch:
        the same result, with 1/W of the full gradients in memory, not all until the last."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradient shards too: a loop calling only ``model.zero_grad()`` (the
        Trainer) must not carry gradients into the next step."""
        start = self.clock.now()
        self.reducer.clear_grads(self._params, set_to_none)
        for chunk in self.chunks:
            # a chunk still updating on the host thread clears its own, right after
            if not self.host_updates.zero_after(chunk.index):
                clear_grad(self.disk, chunk)
        self.reducer.clear_seen()
        self.clock.host_phase("zero_grad", start)

    def drain(self) -> None:
        """Wait for gathers still in flight (the prefetch started after each optimizer step). A
        process exiting while a collective runs in the communication thread aborts
        ("terminate called without an active exception"), so this runs at exit too."""
        self.host_updates.wait_all()
        for chunk in self.chunks:
            if chunk.state is ChunkState.GATHERING:
                chunk.finish_gather()

    def close(self) -> None:
        """Finish the gathers in flight and destroy the process groups this runtime made.
        Collective: every rank calls it once training with this module is over.

        Needed only by processes that build more than one runtime (a sweep over plans, a
        notebook): each runtime's groups keep threads and sockets until closed, or until
        ``torch.distributed.destroy_process_group()`` ends the whole group. A closed runtime
        raises a clear error on its next collective (a forward, a step, a save), so save
        before closing."""
        self.drain()
        if self.disk is not None:  # its files are removed: the state they held is gone
            self.disk.close()
        self.comm.close()

    def release_all(self, keep: Collection[int] = ()) -> None:
        """Drop every gathered chunk (called before an optimizer step or a load changes the
        shards), and every hold of a read outside the modules. Chunks in ``keep`` stay
        gathered (``Fetcher.release_all``)."""
        self.host_updates.wait_all()  # an update still running may be writing the shards
        self.hooks.drop_holds()
        self.fetcher.release_all(keep=keep)

    @contextlib.contextmanager
    def gathered_parameters(self, *params: nn.Parameter | str) -> Iterator[None]:
        """Gather the chunks of ``params`` (parameters or their names; none: every chunk) so
        code outside the model's forward can read them. Collective: every rank must enter it
        with the same parameters.

        Inside, the parameters hold their full values; gradients of what is computed from
        them reach their chunks like any other gradient. When the block is left with
        gradients enabled, the chunks stay gathered until the next backward is over (it may
        read views autograd saved), else they are released at once. The chunks must fit in
        the rCache beside what is already in use.
        """
        if params:
            cids: set[int] = set()
            for p in params:
                slot = self.slot_by_name.get(p) if isinstance(p, str) else self._slot_of_param.get(id(p))
                if slot is None:
                    raise ValueError(
                        f"{p if isinstance(p, str) else 'this parameter'} is not a parameter held "
                        "in this ElixirModule's chunks; pass parameters of the wrapped model (or "
                        "their names from named_parameters())")
                cids.add(self._slot_chunk[slot.index])
        else:
            cids = set(range(len(self.chunks)))
        needed = sorted(cids)
        free = self.cache.capacity - sum(1 for c in self.chunks if c.pins > 0 and c.index not in cids)
        if len(needed) > free:
            raise ValueError(
                f"gathered_parameters needs {len(needed)} chunks at once but the rCache has room "
                f"for {free} ({self.cache.capacity} blocks); gather fewer parameters at a time "
                "or make a plan with more rcache_blocks")
        self.fetcher.fetch(needed)
        self.hooks._gathering_context += 1
        try:
            yield
        finally:
            self.hooks._gathering_context -= 1
            if torch.is_grad_enabled():
                self.hooks.hold(needed)
            else:
                self.fetcher.unpin(needed)

    def prefetch_next_pass(self) -> None:
        """Start gathering the chunks the next forward needs first (after an optimizer step
        they were all released), so the gathers overlap whatever runs before it."""
        self.cache.finish_recording()
        if self.cache.trace is None:
            return
        self.cache.cursor, self.cache.on_trace = -1, True
        self.fetcher.prefetch()

    def memory_report(self) -> dict:
        """Bytes the runtime holds on the compute device, now and at peak, by category."""
        report = self.ledger.report()
        # a block is as large as the largest chunk that needs one (alignment may add a few
        # elements to the plan's chunk_size)
        report["rcache_block_bytes"] = max(
            [c.full_bytes for c in self.chunks if not c.in_place] or [self.plan.chunk_size * self.dtype.itemsize])
        report["rcache_blocks"] = self.plan.rcache_blocks
        report["cache_stats"] = dict(vars(self.cache.stats))
        report["activation_offload"] = self.activations.report()
        report["comm"] = self.comm_report()
        return report

    def time_report(self, reset: bool = False) -> dict:
        """Where this rank's training steps spent their time, by phase, in the planner's
        names (``runtime/timing.py`` defines each): ``measured`` is the mean over the steps
        since the last reset (the first left out: it records the pass's trace), ``last`` the
        latest step's, ``predicted`` the plan's figures for one step of its batch
        (``plan.predictions["time"]``), ``host_threads`` the threads the host update used,
        ``host_kernel`` what ran it (set by the optimizer: host_kernel.py), ``disk_io``
        the disk tier's bytes and I/O seconds since it opened (``DiskTier.io_counters``; None without one).
        ``reset=True`` starts a new window after reading this one; ``timing.format_report`` prints it."""
        report = summarize(self.clock.steps(), self.plan.predictions.get("time"))
        report.update(host_threads=self.host_threads, host_kernel=self.host_kernel,
                      disk_io=self.disk.io_counters() if self.disk else None)
        if reset:
            self.clock.reset()
        return report

    def comm_report(self, reset: bool = False) -> dict:
        """Bytes this rank received since the last reset, by kind (``bytes``: all_gather,
        reduce_scatter, all_reduce, broadcast, host_to_device, device_to_host; the convention
        is in ``hf_elixir.planner.traffic``), the calls by kind, and what they are per: optimizer
        ``steps``, ``forward_passes`` (calls of this module) and ``backward_passes``.
        ``reset=True`` starts a new count after reading this one. A gather the optimizer
        step prefetches for the next pass counts in the window it is issued in, so a window
        from just after one ``step()`` to just after a later one holds whole steps.

        The planner's ``plan.predictions["comm_bytes_by_kind"]`` is one step of this."""
        report = self.comm.counter.report()
        if reset:
            self.comm.counter.reset()
        return report

    # ------------------------------------------------------------------ names and state
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The model's own state_dict keys with full tensors (collective: call on every rank).

        Chunked parameters come from the fp32 master weights (a frozen chunk's from its
        shards), cast to the dtype the model had before wrapping; tensors are on the CPU."""
        out = {} if destination is None else destination
        out.update(gather_state(self, self.chunks, prefix, buffers=True))
        return out

    def trainable_state_dict(self, prefix: str = "") -> dict:
        """Only the trainable parameters, under every key the model's state_dict gives them
        (collective). Saving an adapter needs no copy of a frozen base: gathering it would
        put the whole base model in every rank's host memory for a few megabytes of
        adapter."""
        return gather_state(self, [c for c in self.chunks if not c.frozen], prefix, buffers=False)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load full tensors (the model's own keys) into the shards. Everything is checked
        before anything is written (``runtime/weights.py``)."""
        keys = check_state_dict(self, state_dict, strict)
        self.release_all()
        load_into_chunks(self, state_dict, keys.key_of_param)
        return nn.modules.module._IncompatibleKeys(keys.missing, keys.unexpected)


def _piece_tokens(ref: "weakref.ReferenceType[ElixirModule]"):
    """The current plan's tokens per logit piece (the model's hooks must not keep the
    runtime alive)."""
    def tokens() -> int:
        live = ref()
        return live.plan.logit_piece_tokens if live is not None else 0

    return tokens


def _drain_at_exit(ref: "weakref.ReferenceType[ElixirModule]") -> None:
    module = ref()
    if module is not None:
        module.drain()
