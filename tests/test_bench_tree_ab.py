"""benchmarks/bench_tree_ab.py's copy of an earlier revision: the package as committed, under
another name, importable beside this tree's in one process and referring only to itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_tree_ab import BASE_PACKAGE, materialize_base  # noqa: E402


def test_the_base_revision_imports_beside_this_tree(tmp_path: Path) -> None:
    commit = materialize_base("HEAD", tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert commit == head.stdout.strip()
    package = tmp_path / BASE_PACKAGE
    committed = subprocess.run(["git", "ls-files", "hf_elixir"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()
    assert sorted(str(p.relative_to(tmp_path)).replace(BASE_PACKAGE, "hf_elixir", 1) for p in package.rglob("*")
                  if p.is_file()) == sorted(committed)
    for path in package.rglob("*.py"):  # no import, string or name leads back to this tree's package
        assert not re.search(r"\bhf_elixir\b", path.read_text()), path
    probe = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import hf_elixir, {BASE_PACKAGE} as base; "
             "from hf_elixir_base.runtime import module; "
             "assert base.ElixirModule is not hf_elixir.ElixirModule; "
             f"assert module.__file__.startswith({str(package)!r}), module.__file__; print('ok')")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_revision_that_is_not_a_commit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is not a commit of this repository"):
        materialize_base("no-such-revision-anywhere", tmp_path)
    assert not any(tmp_path.iterdir())
