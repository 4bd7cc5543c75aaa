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


def _row(table: str, label: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == label:
            return cells
    raise AssertionError(f"no row {label!r}")


def test_the_readme_zero_table_is_the_benchmarks_result() -> None:
    """Every figure of README's ZeRO table is the quoted run's (docs/results/zero_memory.json)."""
    import json

    result = json.loads((ROOT / "docs" / "results" / "zero_memory.json").read_text())["gpt"]
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Past the memory wall") : readme.index("## Sending less")]
    rows = {
        "phalanx DDP (stage 0)": "ddp",
        "torch DDP": "torch_ddp",
        "phalanx ZeRO-1": "zero1",
        "torch `ZeroRedundancyOptimizer`": "torch_zero1",
        "phalanx ZeRO-2": "zero2",
        "phalanx `fully_shard` (stage 3)": "zero3",
        "torch FSDP2 `fully_shard`": "torch_fsdp2",
    }
    medians = result["step_s_median"]
    for label, variant in rows.items():
        ranks = result["memory"][f"world2-{variant}"]
        cells = _row(table, label)
        expected = [
            f"{ranks[0]['params_mb']:.0f}",
            f"{ranks[0]['grads_mb']:.0f}",
            f"{ranks[0]['state_mb']:.0f}",
            f"{max(r['peak_rss_mb'] for r in ranks):.0f}",
            f"{medians[variant] / medians['torch_ddp']:.3f}",
        ]
        assert cells[1:6] == expected, (label, cells, expected)
    assert f"**{result['ratios']['zero3_over_torch_fsdp2']:.3f}**" in table
