"""The optimizer table: every optimizer hf_elixir shards, described once.

Each row says which torch classes and Trainer ``optim`` names mean it, which state tensors
it keeps per element (name, dtype, bytes, when they exist, how they start), whether its
update is element-wise, whether neighbouring parameters of a shard may be updated as one
run, whether the one-pass host loop (``runtime/host_kernel.py``) serves it, and how its
host rate is measured. The runtime (``runtime/update.py``, ``runtime/optim.py``), the disk
tier's planes, the planner's memory and disk models, the integrations' accepted names and
messages and ``plan --optimizer`` all read this table; no other module names an optimizer
(``tests/test_optimizer_table.py`` checks it).

The module sits just above ``vocab`` and below everything else; it imports no torch class,
only their qualified names, so reading it costs nothing.

Adding an element-wise optimizer: a row here, its kernel in ``runtime/update.py`` (keyed
by the row's ``kernel``), its tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from hf_elixir.vocab import HfElixirError


class OptimizerError(HfElixirError, ValueError):
    """An optimizer, or a hyperparameter of one, that hf_elixir does not shard."""


@dataclass(frozen=True)
class StateTensor:
    """One state tensor an optimizer keeps per trained element, flat like the shard."""

    name: str                        #: its key in torch's ``optimizer.state[p]``
    dtype: str = "float32"
    bytes_per_element: float = 4.0
    #: the hyperparameter that must be non-zero in some group for the tensor to exist
    #: (SGD keeps no momentum buffer without momentum); None: it always exists
    needs: Optional[str] = None
    #: torch starts it from the first gradient rather than from zeros (SGD's momentum):
    #: the runtime keeps, per parameter, whether it has started
    from_first_grad: bool = False


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer as hf_elixir runs it."""

    name: str                        #: the one name the planner, the runtime and the CLI use
    label: str                       #: how messages print it
    #: torch classes, by qualified name (``module.Class``); a subclass counts as its class
    classes: tuple[str, ...]
    #: the Trainer's ``optim`` values that build one of ``classes``
    trainer_names: tuple[str, ...]
    state: tuple[StateTensor, ...]
    #: the runtime's update for it (``runtime/update.py`` ``KERNELS``)
    kernel: str
    #: keeps a per-parameter ``step`` count in its state (and in its state_dict)
    counts_steps: bool = True
    #: each element's update reads only that element's gradient, weight and state
    elementwise: bool = True
    #: neighbouring parameters of a shard (one group, one step count) may be updated as one
    #: flat run, the alignment gaps included: a zero gradient with zero state leaves a zero
    #: weight at zero, and its state starts the same for every parameter
    merge_runs: bool = True
    #: the one-pass host loop (update and compute-dtype copy in one pass) serves it
    one_pass: bool = False
    #: weight decay applied to the weights, not added to the gradient (AdamW)
    decoupled_weight_decay: bool = False
    #: hyperparameters that must keep one value under hf_elixir, and why
    fixed: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    #: how the host's update rate for it is measured (``measure/host_rate.py``)
    rate: str = "priced at the measured AdamW rate, per byte of state it moves"

    @property
    def state_bytes(self) -> float:
        """Bytes of state per trained element besides the fp32 master, every tensor present
        (what the planner prices)."""
        return sum(s.bytes_per_element for s in self.state)

    def state_names(self, groups: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
        """The state tensors an optimizer with param groups ``groups`` keeps, in plane order."""
        return tuple(s.name for s in self.state
                     if s.needs is None or any(g.get(s.needs, 0) for g in groups))

    def tensor(self, name: str) -> StateTensor:
        return next(s for s in self.state if s.name == name)

    def check_groups(self, groups: Iterable[Mapping[str, Any]]) -> None:
        """Refuse a hyperparameter the runtime cannot honour, before anything is built."""
        for group in groups:
            for key, (value, why) in self.fixed.items():
                if key in group and group[key] != value:
                    raise OptimizerError(
                        f"{self.label} with {key}={group[key]!r} is not supported by hf_elixir ({why}); "
                        f"set {key}={value!r}")


_MOMENTS = (StateTensor("exp_avg"), StateTensor("exp_avg_sq"))

#: every optimizer hf_elixir shards, by its name
TABLE: dict[str, OptimizerSpec] = {spec.name: spec for spec in (
    OptimizerSpec("adamw", "torch.optim.AdamW", ("torch.optim.adamw.AdamW",),
                  ("adamw_torch", "adamw_torch_fused"), _MOMENTS, kernel="moments", one_pass=True,
                  decoupled_weight_decay=True, rate="measured: the one-pass loop's rate (measure/host_rate.py)"),
    OptimizerSpec("adam", "torch.optim.Adam", ("torch.optim.adam.Adam",), (), _MOMENTS, kernel="moments",
                  one_pass=True, rate="measured: the one-pass loop's rate (measure/host_rate.py)"),
    OptimizerSpec("sgd", "torch.optim.SGD", ("torch.optim.sgd.SGD",), ("sgd",),
                  (StateTensor("momentum_buffer", needs="momentum", from_first_grad=True),), kernel="momentum",
                  counts_steps=False,
                  # its momentum starts per parameter (from the first gradient): no runs
                  merge_runs=False),
    OptimizerSpec("adagrad", "torch.optim.Adagrad", ("torch.optim.adagrad.Adagrad",), ("adagrad",),
                  (StateTensor("sum"),), kernel="squares",
                  fixed={"initial_accumulator_value": (0, "hf_elixir starts every state tensor at zeros")}),
)}
#: the names, in the table's order
OPTIMIZERS: tuple[str, ...] = tuple(TABLE)
#: what the planner assumes before the optimizer is known (the largest common state)
DEFAULT = "adamw"
#: the optimizer whose host update ``measure/host_rate.py`` times
RATE_REFERENCE = "adamw"
#: the most state tensors any optimizer keeps: the disk tier lays its files out when the
#: model is wrapped, before the optimizer is known, so it reserves this many planes a chunk
MAX_STATE_PLANES: int = max(len(s.state) for s in TABLE.values())
#: Adam with ``decoupled_weight_decay=True`` is AdamW (torch's own equivalence)
_DECOUPLED_FLAG = "decoupled_weight_decay"


def spec(name: str) -> OptimizerSpec:
    """The row named ``name``; an error naming the choices otherwise."""
    try:
        return TABLE[name]
    except KeyError:
        raise OptimizerError(f"unsupported optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}") from None


def spec_of_class(mro: Sequence[type], defaults: Mapping[str, Any]) -> Optional[OptimizerSpec]:
    """The row for an optimizer whose class has method resolution order ``mro`` and whose
    defaults are ``defaults``; None when no class in it is in the table."""
    by_class = {q: s for s in TABLE.values() for q in s.classes}
    for cls in mro:
        found = by_class.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            if not found.decoupled_weight_decay and defaults.get(_DECOUPLED_FLAG):
                return next((s for s in TABLE.values() if s.kernel == found.kernel and s.decoupled_weight_decay),
                            found)
            return found
    return None


def spec_of_trainer_name(optim: str) -> Optional[OptimizerSpec]:
    """The row a Trainer ``optim`` value builds, or None."""
    return next((s for s in TABLE.values() if optim in s.trainer_names), None)


def trainer_names() -> tuple[str, ...]:
    """Every Trainer ``optim`` value hf_elixir runs."""
    return tuple(n for s in TABLE.values() for n in s.trainer_names)


def supported_message(got: str) -> str:
    """What to use instead of the optimizer ``got``: every class and Trainer name of the table."""
    labels = [s.label for s in TABLE.values()]
    return (f"hf_elixir shards optimizer state for {', '.join(labels[:-1])} and {labels[-1]}; got {got}. "
            f"Use one of those (with the Trainer: --optim {', '.join(trainer_names())})")
