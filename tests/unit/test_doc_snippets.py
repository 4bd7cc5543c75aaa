"""The Trainer snippets of the README and docs/trainer.md write to different directories.

A user who runs one after the other would otherwise start the second into
the first one's checkpoints (now an error that asks to resume or overwrite).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_OUTPUT_DIR = re.compile(r"""output_dir=["']([^"']+)["']""")


def _python_blocks(path: Path) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL))


def test_the_readme_and_the_trainer_doc_use_different_output_dirs() -> None:
    readme = set(_OUTPUT_DIR.findall(_python_blocks(ROOT / "README.md")))
    trainer_doc = set(_OUTPUT_DIR.findall(_python_blocks(ROOT / "docs" / "trainer.md")))
    assert readme and trainer_doc
    assert not readme & trainer_doc, readme & trainer_doc
