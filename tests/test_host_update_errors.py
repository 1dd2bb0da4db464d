"""An error on the host update thread reaches the main thread at its next wait: hf_elixir's
own errors as they are (they already say what to do), anything else wrapped to say where it
ran, the original kept as its cause."""
import pytest

from hf_elixir.runtime.disk_tier import DiskTierError
from hf_elixir.runtime.host_update import HostUpdates


def _fail_with(error: BaseException):
    def update() -> None:
        raise error
    return update


def test_a_package_error_on_the_thread_comes_as_it_is() -> None:
    updates = HostUpdates(None)
    error = DiskTierError("the disk is full; free space and resume from the last checkpoint")
    updates.start([(0, _fail_with(error), lambda: None)], zero=lambda cid: None)
    with pytest.raises(DiskTierError) as caught:
        updates.wait_all()
    assert caught.value is error


def test_a_foreign_error_on_the_thread_is_wrapped_with_its_cause() -> None:
    updates = HostUpdates(None)
    error = ValueError("bad value")
    updates.start([(3, _fail_with(error), lambda: None)], zero=lambda cid: None)
    with pytest.raises(RuntimeError, match="failed on its thread") as caught:
        updates.wait(3)
    assert caught.value.__cause__ is error
