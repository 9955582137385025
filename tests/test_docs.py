"""The docs' examples run: every ```python block of docs/*.md that starts with an import is
executed as it stands (the other blocks are fragments of a call, shown in context)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
EXAMPLES = [
    pytest.param(code, id=f"{page.stem}-{i}")
    for page in sorted(DOCS.glob("*.md"))
    for i, code in enumerate(BLOCK.findall(page.read_text()))
    if code.startswith(("import", "from"))
]


def test_docs_have_examples():
    assert EXAMPLES


@pytest.mark.parametrize("code", EXAMPLES)
def test_example_runs(code: str) -> None:
    import torch

    torch._dynamo.reset()
    exec(compile(code, "<docs example>", "exec"), {"__name__": "docs_example"})
