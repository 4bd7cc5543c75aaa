"""benchmarks/hsdp_link.py: across two real hosts (namespaces and a shaped veth link), HSDP
sends a third of what flat fully_shard sends over the link, and trains the same model.

Only bytes are asserted (the link's own counters), never speed. The flat job's
gathers and reduce-scatters cross the link; HSDP's stay inside each host, and
only the reduced shards (the model's size in gradients) cross.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces and tc need root and iproute2",
)
@pytest.mark.slow  # HSDP trains as torch's in make test (tests/distributed/test_fsdp2_tools.py)
@pytest.mark.timeout(240)
def test_hsdp_crosses_the_link_a_third_as_much_as_flat(tmp_path: Path) -> None:
    out = tmp_path / "hsdp.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hsdp_link.py"), "--tiny", "--rounds", "2",
         "--link-gbit", "10", "--out", str(out)],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    flat, hsdp = result["bytes_per_step"]["flat"], result["bytes_per_step"]["hsdp"]
    for direction in (0, 1):
        assert 0 < hsdp[direction] <= flat[direction] / 3, result
    assert result["param_gap"] <= 1e-3, result  # the same training, up to summation order
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "phx-h" not in leftover
