"""``profile.forked``: planning work spread over forked processes gives what one process gives."""

from __future__ import annotations

import os

import pytest
from transformers import LlamaConfig

import hf_elixir as hfe
from hf_elixir.planner import search
from hf_elixir.profile.forked import forked_map
from hf_elixir.profile.profiler import profile_model
from hf_elixir.profile.fold import same_profile


def _square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def test_results_in_order_from_several_processes() -> None:
    out = forked_map(_square_and_pid, list(range(7)), workers=3)
    assert [v for v, _ in out] == [x * x for x in range(7)]
    assert len({pid for _, pid in out}) == 3  # this process and two children
    assert forked_map(_square_and_pid, [4], workers=3) == [(16, os.getpid())]


def _fails_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three is refused")
    return x


def test_a_child_error_is_raised_here() -> None:
    with pytest.raises(ValueError, match="three is refused"):
        forked_map(_fails_on_three, [0, 1, 2, 3], workers=2)  # 3 goes to the child


def test_plans_with_workers_equal_plans_without() -> None:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=10, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    one = profile_model(config, (2, 32), dtype="bf16")
    two = profile_model(config, (2, 32), dtype="bf16", workers=2)
    assert one.extra.get("traced_layers") and same_profile(one, two)
    priced = search.CANDIDATES.priced
    # each from a profile of its own, so the second search is not recalled from the first's
    plans = [hfe.plan(config, (2, 32), hardware="rtx4090", world_size=2, profile=prof,
                      workers=w) for prof, w in ((one, 1), (two, 2))]
    assert search.CANDIDATES.priced == priced + 2
    same = [p.to_dict() for p in plans]
    for d in same:
        for took in ("profile_seconds", "search_seconds"):  # how long planning took
            d["predictions"].pop(took)
    assert same[0] == same[1]
    assert plans[0].predictions["step_time_s"] == plans[1].predictions["step_time_s"]
