"""README's code runs as written: a newcomer copies each python block into a file and runs
it, on one process and under `phalanx launch` (issue 35's newcomer's walk). A snippet that
needs names it never defines (`net`, `ds`, `fn`) is not an example but homework."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=150, cwd=cwd
    )


def test_readme_has_its_two_snippets() -> None:
    assert len(BLOCKS) == 2, "README's snippets: DDP and the Trainer (this test runs each)"


@pytest.mark.timeout(320)
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=["ddp", "trainer"][: len(BLOCKS)])
def test_each_readme_snippet_runs_as_written(tmp_path: Path, index: int) -> None:
    script = tmp_path / "train.py"
    script.write_text(BLOCKS[index])
    alone = _run([str(script)], tmp_path)
    assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-2000:]
    assert "Traceback" not in alone.stderr
    if index == 0:  # the DDP loop, under the launcher README runs it with
        argv = ["-m", "phalanx", "launch", "--nproc-per-node", "2", str(script)]
        launched = _run(argv, tmp_path)
        assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
        assert launched.stdout.count(" of 2: loss ") == 2, launched.stdout
