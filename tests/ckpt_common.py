"""Training helpers shared by the checkpoint tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

import hf_elixir as hfe
from equivalence import ACCUM, GLOBAL_BATCH, SEQ, make_optimizer, rank_micro_batches
from loops import elixir_steps
from tiny_models import make_batch, make_model


class Run:
    """One rank's model, optimizer and scheduler, trained with the equivalence recipe."""

    def __init__(self, rank: int, world_size: int, arch: str = "gpt2", plan_kwargs: dict | None = None,
                 seed: int = 0, opt_kind: str = "adamw") -> None:
        self.rank, self.world_size = rank, world_size
        self.model = make_model(arch, seed=seed)
        opt, self.sched = make_optimizer(self.model, opt_kind)
        plan = hfe.ElixirPlan.simple(self.model, world_size, **(plan_kwargs or dict(chunk_size=4096)))
        self.emodel = hfe.ElixirModule(self.model, plan)
        self.eopt = hfe.ElixirOptimizer(self.emodel, opt)
        self.ids = make_batch(GLOBAL_BATCH, SEQ)

    def steps(self, n: int) -> dict:
        """``n`` optimizer steps on the global batch: their losses and the lr each one used."""
        rows = rank_micro_batches(self.ids, self.rank, self.world_size)
        lrs: list[float] = []
        losses = elixir_steps(self.emodel, self.eopt, rows * n, clip=1.0, scheduler=self.sched, accumulate=ACCUM,
                              each_step=lambda _: lrs.append(self.eopt.param_groups[0]["lr"]))
        return {"losses": losses, "lrs": lrs}

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        self.emodel.eval()
        out = self.emodel(input_ids=self.ids[:4])["logits"].clone()
        self.emodel.train()
        return out

    def local_state(self) -> dict:
        """This rank's shards, optimizer state and step counts (to check nothing changed)."""
        return {
            "master": [c.master.clone() for c in self.emodel.chunks],
            "shard": [c.shard.clone() for c in self.emodel.chunks],
            "opt": [{k: v.clone() for k, v in s.items()} for s in self.eopt.flat_state],
            "steps": {k: float(v) for k, v in self.eopt.steps.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.eopt.param_groups],
            # buffers only: parameters of a wrapped model are unreadable while released
            "untracked": {k: v.clone() for k, v in self.model.named_buffers()},
        }


def assert_same_local_state(a: dict, b: dict) -> None:
    for x, y in zip(a["master"] + a["shard"], b["master"] + b["shard"]):
        assert torch.equal(x, y), "model shards changed"
    for sa, sb in zip(a["opt"], b["opt"]):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"optimizer state {k} changed"
    assert a["steps"] == b["steps"] and a["groups"] == b["groups"]
    for k in a["untracked"]:
        assert torch.equal(a["untracked"][k], b["untracked"][k])
