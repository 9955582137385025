"""docs/vllm.md's examples run: every ```python block that starts with the comment
``# runs in the vLLM environment`` (the main suite's docs test runs only blocks that start with an
import), in a fresh process with the tier's environment."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

DOC = Path(__file__).resolve().parent.parent / "docs" / "vllm.md"
MARK = "# runs in the vLLM environment"
BLOCKS = [
    b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if b.startswith(MARK)
]


def test_the_page_has_an_example():
    assert BLOCKS


@pytest.mark.parametrize("code", BLOCKS)
def test_example_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(
        "if __name__ == '__main__':\n" + "".join(f"    {ln}\n" for ln in code.splitlines())
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    printed = [line for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(printed) == 2, out.stdout[-2000:]
