"""The LM head and its causal-LM loss over the tokens in pieces: the whole logits never exist.

At long context the logits are what fills the device: batch x sequence x vocabulary, upcast
to fp32 for the loss, and their gradient as much again (32k tokens of a 128k vocabulary are
16.8 GB each). The loss of a causal LM is a sum over tokens, so it can be computed a piece
of tokens at a time: each piece's logits are made, reduced to their share of the loss and
freed. ``loss_in_pieces`` is an autograd Function that does that in forward, and in backward
makes each piece's logits again and turns them into that piece's gradients at once, so at
most one piece's logits (and their gradient) are alive at any moment, in either pass.

The result is the one ``transformers``' ``ForCausalLMLoss`` gives from whole logits, to
float rounding: labels shifted left by one (or ``shift_labels`` as given), tokens labelled
``ignore_index`` left out, the logits upcast to fp32 before the cross-entropy, and the sum
divided by ``num_items_in_batch`` when given (gradient accumulation over micro-batches,
the Trainer's) or else by the number of tokens not ignored (a mean; NaN when there are
none, as ``cross_entropy`` gives). Each piece's head runs in the compute dtype (the
autocast dtype where autocast is on), and its logits' gradient is rounded to that dtype
before the head's backward, as the whole computation rounds it. The weight's gradient
is summed over the pieces in fp32 and rounded once: rounding every piece's product
before summing them would add one rounding a piece (TRL found that this biases training
in bf16).

Only the pieces' tokens that are not ignored are projected at all: a piece is ``tokens``
scored tokens, so a prompt-masked batch costs the head nothing for its prompts.

This module takes tensors only; which models have a head and loss of this shape, and how
their forward is made to use it, is the integrations' business
(``integrations/logit_pieces.py``), which registers itself here (``set_wiring``) so that
an ``ElixirModule`` whose plan asks for pieces gets them however it was built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def shifted_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                    shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each position's next-token label, flattened: ``labels`` shifted left by one with the
    last position ignored, or ``shift_labels`` as given (already shifted, as under context
    parallelism), as ``ForCausalLMLoss`` builds them."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def loss_in_pieces(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: Optional[torch.Tensor],
    tokens: int,
    num_items_in_batch: Union[torch.Tensor, int, float, None] = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The causal-LM loss of ``F.linear(hidden, weight, bias)`` against ``labels``, computed
    ``tokens`` scored tokens at a time (module docstring).

    Args:
        hidden: the head's input, ``(..., hidden)``: one row per position.
        weight, bias: the head's (a Linear: ``(vocab, hidden)`` and ``(vocab,)`` or None).
        labels: the token ids, one per position (shifted here), or None with ``shift_labels``.
        tokens: scored tokens per piece, at least 1.
        num_items_in_batch: the divisor of the summed loss (None: the count of scored tokens).
        ignore_index: the label of positions that are not scored.
        shift_labels: next-token labels already shifted, used instead of ``labels``.
    """
    if tokens < 1:
        raise ValueError(f"logit pieces need at least 1 token each, got {tokens}")
    if labels is None and shift_labels is None:
        raise ValueError("the loss in pieces needs labels (or shift_labels)")
    targets = shifted_targets(labels, ignore_index, shift_labels).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if targets.numel() != flat.shape[0]:
        raise ValueError(
            f"the head's input has {flat.shape[0]} positions but the labels have {targets.numel()}; pass labels "
            "of the input's shape (batch, sequence), and logits_to_keep=0 when training on labels")
    scored = (targets != ignore_index).nonzero().squeeze(1)
    if num_items_in_batch is None:
        divisor: Union[torch.Tensor, float] = float(scored.numel())
    elif torch.is_tensor(num_items_in_batch):
        divisor = num_items_in_batch.to(hidden.device)
    else:
        divisor = float(num_items_in_batch)
    rows = None if scored.numel() == flat.shape[0] else scored  # None: every position is scored
    return _LossInPieces.apply(flat, weight, bias, targets[scored], rows, int(tokens), divisor)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


class _LossInPieces(torch.autograd.Function):
    """Summed cross-entropy of ``rows`` of ``flat`` through the head, over ``divisor``;
    backward recomputes each piece (module docstring)."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, rows: Optional[torch.Tensor], tokens: int,
                divisor: Union[torch.Tensor, float]) -> torch.Tensor:
        dtype = _compute_dtype(flat)
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for start in range(0, targets.numel(), tokens):
            end = min(start + tokens, targets.numel())
            logits = _logits(flat, weight, bias, rows, start, end, dtype)
            total += F.cross_entropy(logits.float(), targets[start:end], reduction="sum")
            del logits
        ctx.save_for_backward(flat, targets, rows, divisor if torch.is_tensor(divisor) else None)
        # the weight and the bias are read again in backward through the parameters
        # themselves, not saved views: under the runtime a parameter's values live in a chunk
        # that may be released between the passes, and reading the parameter gathers it
        ctx.head = (weight, bias)
        ctx.dtype, ctx.tokens = dtype, tokens
        ctx.divisor = None if torch.is_tensor(divisor) else divisor
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        flat, targets, rows, divisor_t = ctx.saved_tensors
        weight, bias = ctx.head
        divisor = divisor_t if divisor_t is not None else ctx.divisor
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype, tokens = ctx.dtype, ctx.tokens
        scale = (grad_loss.float() / divisor)
        grad_flat = torch.zeros_like(flat) if need_h else None
        # fp32 sums, rounded once at the end (module docstring)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=flat.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=flat.device) if need_b and bias is not None else None
        w = weight.to(dtype)
        for start in range(0, targets.numel(), tokens):
            end = min(start + tokens, targets.numel())
            h = _rows(flat, rows, start, end).to(dtype)
            logits = F.linear(h, w, None if bias is None else bias.to(dtype))
            # d(sum of cross-entropies)/d(logits) = softmax - one-hot, times the loss's gradient
            grad = torch.softmax(logits.float(), dim=-1)
            del logits
            grad[torch.arange(end - start, device=grad.device), targets[start:end]] -= 1
            grad.mul_(scale)
            grad = grad.to(dtype)  # the whole computation rounds the logits' gradient here too
            if grad_flat is not None:
                piece = grad @ w
                if rows is None:
                    grad_flat[start:end] = piece
                else:
                    grad_flat.index_copy_(0, rows[start:end], piece.to(grad_flat.dtype))
            if grad_w is not None:
                _add_product(grad_w, grad.t(), h)
            if grad_b is not None:
                grad_b += grad.sum(dim=0, dtype=torch.float32)
            del grad
        return (grad_flat,
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None)


def _rows(flat: torch.Tensor, rows: Optional[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """The head inputs of scored tokens ``start:end``."""
    return flat[start:end] if rows is None else flat.index_select(0, rows[start:end])


def _logits(flat: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], rows: Optional[torch.Tensor],
            start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    h = _rows(flat, rows, start, end).to(dtype)
    return F.linear(h, weight.to(dtype), None if bias is None else bias.to(dtype))


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in fp32, without rounding ``a @ b`` to the inputs' dtype first."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


# ---------------------------------------------------------------------- wiring into a model
@dataclass
class PieceWiring:
    """What an ``ElixirModule`` runs its LM head and loss with.

    ``active``: the model's forward computes its loss in pieces (when it is given labels and
    builds a graph); ``note``: the line the user sees, saying so or why not; ``handles``: the
    hooks to remove."""

    active: bool
    note: str
    handles: list = field(default_factory=list)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.active = False


#: (model, tokens per piece now, end-of-backward watcher) -> PieceWiring; registered by the
#: integrations (integrations/logit_pieces.py), which know the models' heads and losses
Wiring = Callable[[nn.Module, Callable[[], int], Callable[[list], int]], PieceWiring]
_wiring: Optional[Wiring] = None


def set_wiring(wiring: Wiring) -> None:
    """Register what finds a model's head and loss and makes its forward use the pieces."""
    global _wiring
    _wiring = wiring


def wire(model: nn.Module, tokens: Callable[[], int], watch: Callable[[list], int]) -> PieceWiring:
    """Make ``model`` compute its loss in pieces of ``tokens()`` tokens (read at each call,
    so a plan adopted later may change it) when it can (``set_wiring``); ``watch(tensors)``
    makes a tensor's gradient mark the backward that must end with the runtime's
    end-of-backward work (the logits no longer carry it)."""
    if tokens() <= 0:
        return PieceWiring(False, "logits: whole, as the model makes them")
    if _wiring is None:
        return PieceWiring(False, "logits: whole; nothing that knows this model's head is loaded "
                                  "(import hf_elixir, which registers it)")
    return _wiring(model, tokens, watch)
