"""The README and docs/ hold together: a README a newcomer reads in minutes, the two set-up
commands exactly as CI and users type them, and no link that leads nowhere.

Links are checked the way a reader follows them on a repository host: relative to the file
that contains them, inside the repository only. Web addresses, mail addresses and anchors
within the same page are not files and are left alone; an anchor on a file link is stripped
and the file itself must exist.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 160

SETUP_COMMANDS = (
    "pip install torch==2.13.0 && pip install -e . && hf-elixir demo",
    'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile --durations=20 tests',
)

# inline links and images: [text](target) / ![alt](target), target optionally followed by a title
_INLINE = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
# reference definitions: [label]: target
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
_FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2[`~]*[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_EXTERNAL = re.compile(r"^(https?:|mailto:)", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def without_code(text: str) -> str:
    """The text with fenced blocks and inline code removed: brackets in code are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def link_targets(text: str) -> list[str]:
    prose = without_code(text)
    found = [m.group(1) for m in _INLINE.finditer(prose)] + [m.group(1) for m in _REFERENCE.finditer(prose)]
    return [t[1:-1].strip() if t.startswith("<") and t.endswith(">") else t for t in found]


def broken_link(source: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``source``) does not resolve inside the repository, or None."""
    if _EXTERNAL.match(target) or target.startswith("#"):
        return None
    if _SCHEME.match(target) or target.startswith("//"):
        return f"{target!r} is neither a web address nor a path in the repository"
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    if not path:
        return f"{target!r} is empty"
    if path.startswith("/"):
        return f"{target!r} is absolute; write it relative to {source.relative_to(ROOT)}"
    resolved = (source.parent / path).resolve()
    try:
        resolved.relative_to(ROOT)
    except ValueError:
        return f"{target!r} leaves the repository"
    if not resolved.exists():
        return f"{target!r} does not exist ({resolved.relative_to(ROOT)})"
    return None


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, more than {MAX_README_LINES}: move the detail to docs/ and link it"
    )


@pytest.mark.parametrize("command", SETUP_COMMANDS)
def test_readme_has_the_setup_commands(command: str) -> None:
    text = README.read_text(encoding="utf-8")
    assert f"```bash\n{command}\n```" in text, (
        f"README.md must show this set-up command, unchanged, alone in a ```bash block:\n{command}"
    )


def test_docs_folder_exists() -> None:
    assert DOCS.is_dir() and any(DOCS.glob("*.md")), "docs/ must hold the design and the guides"


@pytest.mark.parametrize("source", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(source: Path) -> None:
    problems = [why for target in link_targets(source.read_text(encoding="utf-8"))
                if (why := broken_link(source, target)) is not None]
    assert not problems, f"{source.relative_to(ROOT)}: " + "; ".join(problems)


def test_the_link_checker_sees_links() -> None:
    """The checker itself: links in prose are found, links in code are not, and targets that
    leave the repository or lead nowhere are caught."""
    text = ("See [a](docs/x.md#part), ![b](<img one.png> \"title\") and [c][ref].\n"
            "[ref]: ../outside.md\n"
            "`[not](a-link.md)`\n```\n[nor](this.md)\n```\n[web](https://example.org) [here](#top)\n")
    assert link_targets(text) == ["docs/x.md#part", "img one.png", "https://example.org", "#top", "../outside.md"]
    assert broken_link(README, "https://example.org") is None
    assert broken_link(README, "#top") is None
    assert broken_link(README, "README.md#hf_elixir") is None
    assert broken_link(README, "../outside.md") is not None
    assert broken_link(README, "docs/no-such-file.md") is not None
    assert broken_link(README, "/etc/passwd") is not None
    assert broken_link(README, "ftp://example.org/x") is not None


def test_the_options_table_is_the_plugins() -> None:
    """Option help lives once, on ElixirPlugin's fields; the README carries their table."""
    from hf_elixir.integrations.plugin import options_table

    assert options_table() in README.read_text(), "README's options table differs from ElixirPlugin's fields"
