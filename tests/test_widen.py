"""The widened add (``runtime/widen.py``) is PyTorch's mixed-dtype add, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hf_elixir.runtime import widen
from hf_elixir.runtime.widen import add_widened


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("alpha", [1.0, 0.5, 1 / 3, 1 / 7])
@pytest.mark.parametrize("n", [widen.SMALL - 1, widen.SMALL, widen.BLOCK, 2 * widen.BLOCK + 12345])
def test_the_widened_add_is_the_mixed_add_bit_for_bit(dtype: torch.dtype, alpha: float, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    target = torch.randn(n, generator=gen) * 1e-3
    source = torch.randn(n, generator=gen).to(dtype)
    source[:7] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 65000.0, float("inf"), float("nan")]).to(dtype)
    expected = target.clone().add_(source, alpha=alpha)
    add_widened(target, source, alpha=alpha)
    assert torch.equal(_bits(target), _bits(expected))


def test_a_slice_of_a_shard_is_added_where_it_lies() -> None:
    """The runtime adds into a parameter's stretch of a flat shard: nothing outside it moves."""
    shard = torch.randn(3 * widen.BLOCK)
    before = shard.clone()
    lo, hi = widen.BLOCK // 2 + 3, 2 * widen.BLOCK + 5
    source = torch.randn(hi - lo).to(torch.bfloat16)
    add_widened(shard[lo:hi], source, alpha=0.25)
    expected = before.clone()
    expected[lo:hi].add_(source, alpha=0.25)
    assert torch.equal(_bits(shard), _bits(expected))


def test_other_cases_take_the_plain_add(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source as wide as the target or wider, small or multi-dimensional tensors, and
    devices other than the CPU are added in one call; only a widening allocates a scratch."""
    big = widen.BLOCK + 1
    cases = [  # made first: a meta tensor's factory calls torch.empty itself
        (torch.zeros(big), torch.ones(big)),                                   # same dtype
        (torch.zeros(big, dtype=torch.bfloat16), torch.ones(big)),             # a narrower target
        (torch.zeros(big, dtype=torch.bfloat16), torch.ones(big, dtype=torch.float16)),
        (torch.zeros(widen.SMALL - 1), torch.ones(widen.SMALL - 1, dtype=torch.bfloat16)),
        (torch.zeros(2, big), torch.ones(2, big, dtype=torch.bfloat16)),       # not flat
        (torch.zeros(big, device="meta"), torch.ones(big, dtype=torch.bfloat16, device="meta")),
    ]
    scratches = []
    empty = torch.empty

    def counted(*args, **kwargs):
        scratches.append(args)
        return empty(*args, **kwargs)

    monkeypatch.setattr(widen.torch, "empty", counted)
    for target, source in cases:
        add_widened(target, source, alpha=0.5)
    assert scratches == []
    assert torch.equal(cases[0][0], torch.full((big,), 0.5))
    add_widened(torch.zeros(big), torch.ones(big, dtype=torch.bfloat16))
    assert len(scratches) == 1
