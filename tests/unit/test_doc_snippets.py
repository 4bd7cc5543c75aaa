"""The Trainer snippets of the README and docs/trainer.md write to different directories.

A user who runs one after the other would otherwise start the second into
the first one's checkpoints (now an error that asks to resume or overwrite).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


ZERO_ROWS = {
    "phalanx DDP": ("ddp", "torch_ddp"),
    "torch DDP": ("torch_ddp", None),
    "phalanx ZeRO-1": ("zero1", "torch_zero1"),
    "torch ZeroRedundancyOptimizer": ("torch_zero1", None),
    "phalanx ZeRO-2": ("zero2", "zero1"),
    "phalanx `fully_shard`": ("zero3", "torch_fsdp2"),
    "torch FSDP2 `fully_shard`": ("torch_fsdp2", None),
}


@pytest.mark.parametrize(
    ("model", "title"), [("gpt", "A 49.4M-parameter GPT"), ("mlp", "An 8.4M-parameter MLP")]
)
def test_the_zero_tables_are_the_benchmarks_result(model: str, title: str) -> None:
    """Every figure of docs/zero.md's ZeRO tables is the quoted run's
    (docs/results/zero_memory.json). README's copy of the GPT's moved there (issue 35)."""
    import json

    result = json.loads((ROOT / "docs" / "results" / "zero_memory.json").read_text())[model]
    doc = (ROOT / "docs" / "zero.md").read_text()
    table = doc[doc.index(title) :]
    table = table[: table.index("\n\n", table.index("| variant |"))]
    medians = result["step_s_median"]
    for label, (variant, counterpart) in ZERO_ROWS.items():
        ranks = result["memory"][f"world2-{variant}"]
        cells = _row(table, label)
        expected = [
            f"{ranks[0]['params_mb']:.0f}",
            f"{ranks[0]['grads_mb']:.0f}",
            f"{ranks[0]['state_mb']:.0f}",
            f"{max(r['peak_rss_mb'] for r in ranks):.0f}",
            f"{medians[variant] * 1000:.0f}",
            f"{medians[variant] / medians['torch_ddp']:.3f}",
            f"{medians[variant] / medians[counterpart]:.3f}" if counterpart else "",
        ]
        assert cells[1:8] == expected, (model, label, cells, expected)
    brief = " ".join(doc[doc.index("## In brief") : doc.index("## Memory and time")].split())
    if model == "gpt":
        ratio = result["ratios"]["zero3_over_torch_fsdp2"]
        rss = {
            v: max(r["peak_rss_mb"] for r in result["memory"][f"world2-{v}"])
            for v in ("zero3", "torch_fsdp2")
        }
        assert f"**{ratio:.3f}x** torch FSDP2's time at {rss['zero3']:.0f} MB" in brief
        assert f"against FSDP2's {rss['torch_fsdp2']:.0f}" in brief
