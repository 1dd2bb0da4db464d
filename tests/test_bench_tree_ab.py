"""benchmarks/bench_tree_ab.py's copy of an earlier revision: the package as committed, under
another name, importable beside this tree's in one process and referring only to itself.

The revision comes from a repository made here from this tree's package (the test must not
depend on the checkout it runs in having its history)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_tree_ab import BASE_PACKAGE, materialize_base  # noqa: E402


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository whose one commit holds this tree's package."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "hf_elixir", repo / "hf_elixir", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _git(repo, "init", "-q")
    _git(repo, "add", "hf_elixir")
    _git(repo, "commit", "-q", "-m", "base")
    return repo


def test_the_base_revision_imports_beside_this_tree(tmp_path: Path, repo: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert materialize_base("HEAD", out, repo=repo) == _git(repo, "rev-parse", "HEAD")
    package = out / BASE_PACKAGE
    committed = _git(repo, "ls-files", "hf_elixir").split()
    assert sorted(str(p.relative_to(out)).replace(BASE_PACKAGE, "hf_elixir", 1) for p in package.rglob("*")
                  if p.is_file()) == sorted(committed)
    for path in package.rglob("*.py"):  # no import, string or name leads back to this tree's package
        assert not re.search(r"\bhf_elixir\b", path.read_text()), path
    probe = (f"import sys; sys.path.insert(0, {str(out)!r}); import hf_elixir, {BASE_PACKAGE} as base; "
             "from hf_elixir_base.runtime import module; "
             "assert base.ElixirModule is not hf_elixir.ElixirModule; "
             f"assert module.__file__.startswith({str(package)!r}), module.__file__; print('ok')")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_revision_that_is_not_a_commit_is_refused(tmp_path: Path, repo: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SystemExit, match="is not a commit of this repository"):
        materialize_base("no-such-revision-anywhere", out, repo=repo)
    assert not any(out.iterdir())
