"""Which models get their LM head and loss in pieces, and how their forward is made to.

``runtime/logit_pieces.py`` computes a causal-LM loss from the head's input, a piece of
tokens at a time; this module knows Transformers' models well enough to put it in their
forward. A model qualifies when its language-model class (a ``PreTrainedModel`` with an
output embedding; under PEFT, the base model) has:

- a head that is a plain ``nn.Linear`` with a floating weight and one output per
  vocabulary entry (``get_output_embeddings()``; not LoRA on the head, not a quantised
  head);
- the standard causal-LM loss (``loss_function`` is Transformers' ``ForCausalLMLoss``) and
  a forward that takes ``labels`` and ``logits_to_keep`` (the shape every current
  ``*ForCausalLM`` has: slice the hidden states, apply the head, hand the logits to the
  loss);
- nothing done to the logits between the head and the loss that the config announces:
  soft-capping (``final_logit_softcapping``) or scaling (``logit_scale``,
  ``output_multiplier``, ``lm_head_multiplier``, ``logits_scaling``). Those models run
  whole, as today.

Anything else runs whole, and the note the user sees says why.

How the forward is made to use the pieces, without copying it: for a training forward
(grad enabled, module in training mode) given ``labels``, a hook on the head takes its input
(the final hidden states) and hands the head an empty slice of it instead, so the head
makes logits for no token; the model then calls its loss with that empty output, and the
loss function, swapped in for that call only, computes the loss in pieces from the hidden
states it took. A model that changed the logits in between, unannounced, would hand its
loss another tensor than the head's output: that is refused with an error rather than
computed wrongly. The output's ``logits`` is then None (there are no whole logits); a
forward without labels, in evaluation or without a graph (generation, metrics on logits)
runs whole and returns them (docs/design.md, "Long context").

TRL's SFTTrainer computes its default loss through its own fused head
(``fused_lm_head=True``), which never calls the model's head or loss: its logits are
already made in tiles of ``TOKEN_CHUNK_SIZE`` tokens by at most 32,768 vocabulary entries.
Where the plan's piece is smaller than that token tile, the tile is set to the piece, so
no logits beyond one piece exist there either.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from hf_elixir.profile.params import is_packed
from hf_elixir.runtime.logit_pieces import PieceWiring, loss_in_pieces, set_wiring
from hf_elixir.vocab import HfElixirError

log = logging.getLogger("hf_elixir")

#: config attributes that announce a change of the logits between the head and the loss
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")
#: TRL's fused head's module and its token tile (read by its kernel at each call)
TRL_KERNEL, TRL_TILE = "trl.kernels.chunked_logprob", "TOKEN_CHUNK_SIZE"
#: the module of TRL's fused head and its vocabulary chunk (the tile buffer's width)
TRL_HEAD, TRL_WIDTH = "trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE"


class LogitPieceError(HfElixirError, RuntimeError):
    """The model changed its logits between its head and its loss where that was not known."""


@dataclass
class HeadShape:
    """The parts of a model the pieces replace: the module whose forward applies the head
    and calls the loss, its head, and the vocabulary size."""

    lm: nn.Module
    head: nn.Linear
    vocab_size: int
    loss: Callable[..., torch.Tensor]  #: the model's own loss (ForCausalLMLoss), for forwards run whole


def find_head(model: nn.Module) -> tuple[Optional[HeadShape], str]:
    """The head and loss of ``model`` when they are of the shape the pieces replace (module
    docstring), else None and why not, in words for the user."""
    lm = next((m for m in model.modules() if isinstance(getattr(type(m), "loss_function", None), property)
               and callable(getattr(m, "get_output_embeddings", None))), None)
    if lm is None:
        return None, f"{type(model).__name__} is not a Transformers language model with a loss_function"
    name = type(lm).__name__
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear:
        return None, (f"{name}'s head is {type(head).__name__}, not a plain Linear (a quantised head, or an "
                      "adapter on it)")
    if not head.weight.is_floating_point() or is_packed(head.weight):
        return None, f"{name}'s head weight is not a floating-point tensor"
    config = getattr(lm, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if vocab != head.out_features:
        return None, f"{name}'s head has {head.out_features} outputs but its vocabulary has {vocab} entries"
    for attr in LOGIT_TRANSFORMS:
        value = getattr(text, attr, None)
        if value is not None and not (attr == "logit_scale" and value == 1.0):
            return None, f"{name} changes its logits after the head ({attr}={value})"
    from transformers.loss.loss_utils import ForCausalLMLoss

    if lm.loss_function is not ForCausalLMLoss:
        return None, f"{name}'s loss is {getattr(lm.loss_function, '__name__', lm.loss_function)!r}, not ForCausalLMLoss"
    params = inspect.signature(type(lm).forward).parameters
    missing = [p for p in ("labels", "logits_to_keep") if p not in params]
    if missing:
        return None, f"{name}'s forward takes no {' or '.join(missing)}"
    return HeadShape(lm, head, int(vocab), ForCausalLMLoss), ""


@dataclass
class _Call:
    """One training forward whose loss runs in pieces."""

    hidden: Optional[torch.Tensor] = None   # the head's input, taken from it
    head_out: Optional[torch.Tensor] = None  # the empty logits the head made instead
    pieced: bool = False                     # the loss was computed in pieces


@dataclass
class PiecedForward:
    """The hooks that make one model's training forward compute its loss in pieces."""

    shape: HeadShape
    tokens: Callable[[], int]
    watch: Callable[[list], int]
    call: Optional[_Call] = None
    _saved_loss: Any = None
    handles: list = field(default_factory=list)

    def install(self, root: nn.Module) -> list:
        self.handles = [
            root.register_forward_pre_hook(self._root_pre, with_kwargs=True),
            root.register_forward_hook(self._root_post, always_call=True),
            self.shape.head.register_forward_pre_hook(self._head_pre),
            # first among the head's hooks: it sees the head's own output, so a hook that
            # changes it is caught by the loss (``_loss``) instead of being left out
            self.shape.head.register_forward_hook(self._head_post, prepend=True),
        ]
        return self.handles

    # ------------------------------------------------------------------ the hooks
    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = self.tokens()
        if tokens <= 0 or self.call is not None:  # nested calls of the root run as they are
            return
        if kwargs.get("fused_lm_head"):
            bound_trl_tile(tokens, self.shape.vocab_size)
            return
        wants_loss = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        keep = kwargs.get("logits_to_keep")
        every_position = keep is None or (isinstance(keep, int) and keep == 0)
        if not (wants_loss and every_position and module.training and torch.is_grad_enabled()):
            return
        self.call = _Call()
        lm = self.shape.lm
        self._saved_loss = lm.__dict__.get("_loss_function")
        lm._loss_function = self._loss

    def _head_pre(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        call = self.call
        if call is None or call.hidden is not None or not args or not torch.is_tensor(args[0]):
            return None
        hidden = args[0]
        if not hidden.requires_grad or hidden.dim() < 2:
            return None  # nothing before the head trains: whole, as the model makes them
        call.hidden = hidden
        return (hidden.narrow(-2, 0, 0),) + tuple(args[1:])

    def _head_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        call = self.call
        if call is not None and call.hidden is not None and call.head_out is None:
            call.head_out = output

    def _loss(self, logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int,
              num_items_in_batch: Any = None, ignore_index: int = -100,
              shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        call = self.call
        if call is None or call.hidden is None:  # the head's input was not taken: whole
            return self.shape.loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                   ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if logits is not call.head_out:
            raise LogitPieceError(
                f"{type(self.shape.lm).__name__} changed its logits between its head and its loss, so its loss "
                "cannot be computed in logit pieces; set the elixir option logit_piece_tokens to 0 (whole "
                "logits) for this model")
        head = self.shape.head
        loss = loss_in_pieces(call.hidden, head.weight, head.bias, labels, self.tokens(),
                              num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                              shift_labels=shift_labels)
        # the logits no longer carry the runtime's end-of-backward mark: the hidden states do
        self.watch([call.hidden])
        call.pieced = True
        return loss

    def _root_post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        call, self.call = self.call, None
        if call is None:
            return None
        lm = self.shape.lm
        if self._saved_loss is None:
            lm.__dict__.pop("_loss_function", None)
        else:
            lm._loss_function = self._saved_loss
        self._saved_loss = None
        if call.pieced:
            return without_logits(output, call.head_out)
        if call.hidden is not None and output is not None:  # (None: the forward raised)
            # the head made logits for no token and no loss took its input: the output's
            # logits are empty, which must not pass for the model's
            raise LogitPieceError(
                f"{type(self.shape.lm).__name__} did not hand its head's logits to its loss_function, so its loss "
                "cannot be computed in logit pieces; set the elixir option logit_piece_tokens to 0 (whole "
                "logits) for this model")
        return None


def without_logits(output: Any, empty: Optional[torch.Tensor]) -> Any:
    """``output`` with ``logits`` None (a ModelOutput is rebuilt: it keeps a field set to
    None in its dict), or with the empty logits replaced by None in a tuple."""
    if isinstance(output, Mapping) and "logits" in output:
        return type(output)(**{k: v for k, v in output.items() if k != "logits"})
    if isinstance(output, tuple):
        return tuple(None if item is empty else item for item in output)
    return None


def bound_trl_tile(tokens: int, vocab: int) -> None:
    """TRL's fused head makes logits in a buffer of ``TOKEN_CHUNK_SIZE`` tokens by its
    vocabulary chunk (32,768 entries, whatever the vocabulary): no larger than one piece of
    ``tokens`` x ``vocab`` (module docstring)."""
    kernel = sys.modules.get(TRL_KERNEL)
    tile = getattr(kernel, TRL_TILE, None)
    width = getattr(sys.modules.get(TRL_HEAD), TRL_WIDTH, None)
    if not (isinstance(tile, int) and isinstance(width, int)):
        return
    bound = min(tokens, max(1, tokens * vocab // width))
    if tile > bound:
        setattr(kernel, TRL_TILE, bound)


def wire_model(model: nn.Module, tokens: Callable[[], int], watch: Callable[[list], int]) -> PieceWiring:
    """``runtime.logit_pieces.wire`` for Transformers models (registered at import)."""
    shape, why = find_head(model)
    if shape is None:
        note = f"logits: whole, as the model makes them, not in the plan's pieces of {tokens():,} tokens: {why}"
        log.warning("hf_elixir: %s", note)
        return PieceWiring(False, note)
    pieced = PiecedForward(shape, tokens, watch)
    return PieceWiring(True, f"logits: in pieces of {tokens():,} tokens ({type(shape.lm).__name__}'s head and "
                             "ForCausalLMLoss; outputs.logits is None in training forwards given labels)",
                       pieced.install(model))


set_wiring(wire_model)
