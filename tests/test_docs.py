"""The docs' examples run, and the docs stay a set of pages the README links.

Every ```python block of README.md and docs/*.md that starts with an import is executed as it
stands, in a fresh directory (the other blocks are fragments of a call, shown in context)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
EXAMPLES = [
    pytest.param(code, id=f"{page.stem}-{i}")
    for page in PAGES
    for i, code in enumerate(BLOCK.findall(page.read_text()))
    if code.startswith(("import", "from"))
]


def test_docs_have_examples():
    assert len([e for e in EXAMPLES if e.id.startswith("README-")]) >= 3


@pytest.mark.parametrize("code", EXAMPLES)
def test_example_runs(code: str, tmp_path, monkeypatch) -> None:
    import torch

    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    exec(compile(code, "<docs example>", "exec"), {"__name__": "docs_example"})


def test_readme_is_a_front_door():
    """At most 12,000 bytes, and every page under docs/ is reachable from it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12_000
    for page in DOCS.glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_relative_links_resolve():
    link = re.compile(r"\]\(([^)#:]+\.md)(#[^)]*)?\)")
    for page in PAGES:
        for target, _ in link.findall(page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name} links {target}, which is missing"
