"""What the one-pass host Adam (runtime/host_kernel.py) loads from its cache, and what it does
when the cache or the compiler misbehaves (issue 60, finding 4).

Loading a shared library runs its constructors before any check of its numbers, so a library
planted in the kernel cache would run its code in the training process. The planted library
here has such a constructor, which writes a marker file: the marker must never appear, and
the run either builds its own library again or falls back to PyTorch's kernel, and says so
in a warning. A corrupt cached file, one without the loop's functions and a compiler that
runs past its time are rebuilt or fall back the same way, never an exception out of the
optimizer's first step.
"""

from __future__ import annotations

import configparser
import fnmatch
import hashlib
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Optional

import pytest

from hf_elixir.runtime import host_kernel
from hf_elixir.runtime.host_kernel import KERNEL_ENV, OnePassAdam

REPO = Path(__file__).resolve().parent.parent
MARKER_ENV = "HF_ELIXIR_TEST_PLANTED_MARKER"

#: a library another user could plant: its constructor runs at dlopen and leaves a marker;
#: it has the loop's functions (which do nothing), so that only a check before the load
#: keeps it out (the numeric check after it would refuse it, too late)
PLANTED_SOURCE = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("HF_ELIXIR_TEST_PLANTED_MARKER");
    FILE *f = marker ? fopen(marker, "w") : NULL;
    if (f) { fputs("a planted library ran in this process\n", f); fclose(f); }
}
int hf_elixir_fp16(void) { return 0; }
int hf_elixir_openmp(void) { return 0; }
int hf_elixir_adam(float *p, const void *g, float *m, float *v, void *o, int64_t n, const float *s, int gb, int ok,
                   int de, int ma) { return 0; }
int hf_elixir_adam_parallel(float *p, const void *g, float *m, float *v, void *o, int64_t n, const float *s, int gb,
                            int ok, int de, int ma, int parts) { return 0; }
"""


def _cc() -> str:
    return host_kernel._compiler()


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The planted library's bytes; checked, in a process of its own, to leave its marker
    when loaded (so that a marker never seen below means it never ran)."""
    folder = tmp_path_factory.mktemp("planted")
    source, built, marker = folder / "planted.c", folder / "planted.so", folder / "marker"
    source.write_text(PLANTED_SOURCE)
    subprocess.run([_cc(), "-shared", "-fPIC", str(source), "-o", str(built)], check=True, capture_output=True,
                   timeout=120)
    subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(built)], check=True,
                   env={**os.environ, MARKER_ENV: str(marker)}, timeout=120)
    assert marker.exists()
    return built.read_bytes()


@pytest.fixture(scope="module")
def name(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The file name this machine's library has in the kernel cache: the name a planted
    library must have to be picked up (learnt from a build in a cache of its own)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ELIXIR_CACHE", str(tmp_path_factory.mktemp("name") / "cache"))
        return host_kernel.library_path().name


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty calibration cache, a process that has loaded no library yet, and the marker
    a planted library would write (returned: the cache)."""
    monkeypatch.setenv("HF_ELIXIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(MARKER_ENV, str(tmp_path / "marker"))
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(OnePassAdam, "_loaded", {})
    return tmp_path / "cache"


def _marker(cache: Path) -> Path:
    return cache.parent / "marker"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _plant(folder: Path, name: str, data: bytes, recorded: Optional[str]) -> Path:
    """``data`` as the library ``name``, with ``recorded`` as its recorded sha256 (none
    where None)."""
    path = folder / name
    path.write_bytes(data)
    os.chmod(path, 0o700)
    if recorded is not None:
        path.with_name(path.name + ".sha256").write_text(f"{recorded}  {path.name}\n")
    return path


def _first_use() -> tuple[OnePassAdam, list[str]]:
    """A runtime's first look at the loop, as the optimizer's: the runner and its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = OnePassAdam(1)
        runner.usable
    return runner, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _is_own_build(path: Path) -> bool:
    """``path`` holds the bytes whose sha256 was recorded beside it (as a build writes it)."""
    recorded = path.with_name(path.name + ".sha256").read_text().split()
    return recorded == [_sha256(path.read_bytes()), path.name]


def _kernel_folder(cache: Path) -> Path:
    folder = cache / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(folder, 0o700)
    return folder


@pytest.mark.parametrize("recorded", ["none", "another"])
def test_a_planted_library_without_its_recorded_hash_is_rebuilt_not_loaded(
        cache: Path, name: str, planted: bytes, recorded: str) -> None:
    """In the user's own private folder, a library whose sha256 is not the one recorded at
    the build (no record, or another file's) is built again under its name, with a warning."""
    path = _plant(_kernel_folder(cache), name, planted, None if recorded == "none" else _sha256(b"another build"))
    runner, said = _first_use()
    assert not _marker(cache).exists(), "the planted library was loaded"
    assert runner.usable, runner.why_not
    assert path.read_bytes() != planted and _is_own_build(path)
    reason = "no sha256 of it was recorded" if recorded == "none" else "not the one recorded at its build"
    assert any(reason in text and "was built again" in text for text in said), said


@pytest.mark.parametrize("problem", ["another owner", "others can write it"])
def test_a_planted_library_that_is_not_the_users_alone_is_rebuilt_not_loaded(
        cache: Path, name: str, planted: bytes, problem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with a matching record beside it, a file of another user's (as ``fstat`` reports
    it) or one others can write is not loaded: it may have been put there while the folder
    was not private."""
    path = _plant(_kernel_folder(cache), name, planted, _sha256(planted))
    if problem == "others can write it":
        os.chmod(path, 0o722)
        reason = "writable by others"
    else:
        planted_id = (path.stat().st_dev, path.stat().st_ino)
        real_fstat = os.fstat

        def fstat(fd: int) -> os.stat_result:
            info = real_fstat(fd)
            if (info.st_dev, info.st_ino) != planted_id:
                return info
            fields = list(info[:10])
            fields[4] = info.st_uid + 1  # st_uid
            return os.stat_result(fields)

        monkeypatch.setattr(os, "fstat", fstat)
        reason = f"belongs to uid {os.getuid() + 1}"
    runner, said = _first_use()
    assert not _marker(cache).exists(), "the planted library was loaded"
    assert runner.usable, runner.why_not
    assert path.read_bytes() != planted and _is_own_build(path)
    assert any(reason in text and "was built again" in text for text in said), said


@pytest.mark.parametrize("folder_problem", ["group-writable", "another owner", "a symlink"])
def test_nothing_is_loaded_or_built_in_a_kernel_folder_others_could_write(
        cache: Path, name: str, planted: bytes, folder_problem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel folder the group can write, another user's (``os.getuid`` says so here), or a
    symlink: the planted library in it, with its hash recorded, is not loaded, nothing is
    built there, and the update falls back to PyTorch's kernel with a warning that says how
    to fix the folder."""
    if folder_problem == "a symlink":
        elsewhere = _kernel_folder(cache.parent / "elsewhere")
        cache.mkdir(mode=0o700)
        (cache / "kernels").symlink_to(elsewhere)
        folder, reason = elsewhere, "is a symlink"
    else:
        folder = _kernel_folder(cache)
    path = _plant(folder, name, planted, _sha256(planted))
    before = sorted(os.listdir(folder))
    if folder_problem == "group-writable":
        os.chmod(folder, 0o770)
        reason = "chmod go-w"
    elif folder_problem == "another owner":
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
        reason = "not to you"
    runner, said = _first_use()
    assert not _marker(cache).exists(), "the planted library was loaded"
    assert not runner.usable
    assert reason in runner.why_not and "nothing in it is loaded" in runner.why_not
    assert any("one-pass host Adam is not used" in text and reason in text for text in said), said
    assert sorted(os.listdir(folder)) == before and path.read_bytes() == planted


def test_a_build_under_a_group_umask_is_trusted_by_the_next_process(cache: Path) -> None:
    """Under a umask of 002 (common where each user has a group of their own), the library
    and its record are still this user's alone, so the next process loads them, without a
    rebuild."""
    old_umask = os.umask(0o002)
    try:
        runner, said = _first_use()
        assert runner.usable and not said, (runner.why_not, said)
        built = list((cache / "kernels").glob("host_adam-*"))
        assert sorted(p.suffix for p in built) == [".sha256", ".so"]
        assert all(not p.stat().st_mode & 0o022 for p in built), [oct(p.stat().st_mode) for p in built]
        stamps = {p: p.stat().st_mtime_ns for p in built}
        OnePassAdam._loaded.clear()  # a new process
        runner, said = _first_use()
        assert runner.usable and not said, (runner.why_not, said)
        assert {p: p.stat().st_mtime_ns for p in built} == stamps
    finally:
        os.umask(old_umask)


def test_a_corrupt_cached_library_is_rebuilt(cache: Path) -> None:
    """A cached library whose bytes changed after its build (here: cut short, as a full disk
    leaves it) does not match its record and is built again; before, it was loaded, failed,
    and the loop was off for good on this machine."""
    path = host_kernel.library_path()
    built = path.read_bytes()
    cut = path.with_name("cut")
    cut.write_bytes(built[: len(built) // 2])
    os.chmod(cut, 0o700)
    os.replace(cut, path)  # a new file: never write into one a process may have mapped
    runner, said = _first_use()
    assert runner.usable, runner.why_not
    assert _is_own_build(path) and len(path.read_bytes()) == len(built)
    assert any("not the one recorded" in text and "was built again" in text for text in said), said


def test_a_library_without_the_loop_is_rebuilt_or_falls_back(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that lacks the loop's functions (a compiler that dropped them, a foreign file
    with a matching record) is an ``AttributeError`` at load: the update falls back with a
    warning; a later process finds it cached, does not load it as the loop, and builds it
    again."""
    def build_without_the_loop(cc: str, source: Path, built: Path, runtime: Optional[Path]) -> Optional[str]:
        source.write_text("int hf_elixir_fp16(void) { return 0; }\n")
        proc = subprocess.run([cc, "-shared", "-fPIC", str(source), "-o", str(built)], capture_output=True, text=True,
                              timeout=120)
        return None if proc.returncode == 0 else proc.stderr

    monkeypatch.setattr(host_kernel, "_build", build_without_the_loop)
    runner, said = _first_use()
    assert not runner.usable and "hf_elixir_adam" in runner.why_not
    assert any("one-pass host Adam is not used" in text for text in said), said

    monkeypatch.undo()
    monkeypatch.setenv("HF_ELIXIR_CACHE", str(cache))
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(OnePassAdam, "_loaded", {})  # a new process
    runner, said = _first_use()
    assert runner.usable, runner.why_not
    assert any("did not load" in text and "hf_elixir_adam" in text and "was built again" in text
               for text in said), said


def test_a_compiler_past_its_timeout_means_the_fallback(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that hangs: the build's ``TimeoutExpired`` is a reason to fall back, with
    the warning, not an exception out of the optimizer."""
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if "-shared" in cmd or "-c" in cmd:
            raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(host_kernel.subprocess, "run", run)
    runner, said = _first_use()
    assert not runner.usable and f"ran past {host_kernel.BUILD_TIMEOUT_S} s" in runner.why_not
    assert any("one-pass host Adam is not used" in text and "ran past" in text for text in said), said
    assert not list((cache / "kernels").glob("host_adam-*"))


def test_the_loop_is_a_c_file_the_compiler_reads_without_a_warning() -> None:
    """The loop's source is a C file of the package, which the compiler checks with its
    warnings on (as a Python string it was never seen as C by any tool)."""
    source = Path(host_kernel.__file__).with_name(host_kernel.SOURCE_NAME)
    proc = subprocess.run([_cc(), *host_kernel._FLAGS, "-fopenmp", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                           str(source)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_c_source_is_package_data() -> None:
    """A wheel (and ``pip install -e .``) ships ``host_adam.c``: setup.cfg's package data
    names it for the package it sits in."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    patterns = config["options.package_data"].get("hf_elixir.runtime", "").split()
    assert any(fnmatch.fnmatch(host_kernel.SOURCE_NAME, pattern) for pattern in patterns), patterns
