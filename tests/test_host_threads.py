"""How many threads a rank's host update takes (runtime/threads.py): its share of the
machine's cores, whether or not a launcher said how many ranks share the machine."""

from __future__ import annotations

import pytest
import torch

from hf_elixir.runtime import threads


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    for name in ("LOCAL_WORLD_SIZE", threads.THREADS_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("eight_cores")
@pytest.mark.parametrize(("env", "world_size", "expected"), [
    ({}, 1, 8),                              # one process: every core
    ({}, 2, 4),                              # ranks a script spawned, no launcher: all here
    ({}, 16, 1),                             # more ranks than cores: never fewer than one
    ({"LOCAL_WORLD_SIZE": "2"}, 8, 4),       # a launcher's count: 2 of 8 ranks are here
    ({"LOCAL_WORLD_SIZE": "1"}, 4, 8),       # one rank a machine
    ({threads.THREADS_ENV: "3"}, 2, 3),      # the user's choice wins
])
def test_a_rank_takes_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch, env: dict, world_size: int,
                                              expected: int) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert threads.host_threads(world_size) == expected


@pytest.mark.usefixtures("eight_cores")
def test_never_fewer_threads_than_torch_already_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    assert threads.host_threads(4) == 6


@pytest.mark.usefixtures("eight_cores")
@pytest.mark.parametrize("value", ["0", "two"])
def test_a_bad_thread_count_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(threads.THREADS_ENV, value)
    with pytest.raises(ValueError, match=threads.THREADS_ENV):
        threads.host_threads(1)
