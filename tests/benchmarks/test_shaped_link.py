"""benchmarks/shaped_link.py: the benchmark's traffic really crosses the shaped link.

Real namespaces and a real `tc` token bucket: bytes sent over the namespace's
loopback must be counted by the bucket, and the namespace must be gone after,
also when the body fails. Speed is never asserted, only where the bytes went.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces and tc need root and iproute2",
)

SEND = """
import socket, threading
server = socket.create_server(("127.0.0.1", 0))
got = []
def serve():
    conn, _ = server.accept()
    n = 0
    while chunk := conn.recv(1 << 16):
        n += len(chunk)
    got.append(n)
t = threading.Thread(target=serve); t.start()
client = socket.create_connection(server.getsockname())
client.sendall(b"x" * (4 << 20)); client.close(); t.join()
print(got[0])
"""


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shaped_link", BENCH / "shaped_link.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_bucket_never_smaller_than_a_loopback_frame() -> None:
    link = load()
    args = link.tbf_args(0.1)
    assert args[:3] == ["tbf", "rate", "0.1gbit"]
    assert int(args[args.index("burst") + 1]) >= 2 * link.LOOPBACK_MTU
    fast = link.tbf_args(100)
    assert int(fast[fast.index("burst") + 1]) == int(100e9 / 8 / 1000)  # 1 ms of traffic
    with pytest.raises(ValueError, match="positive rate"):
        link.tbf_args(0)


@needs_netns
@pytest.mark.timeout(60)
def test_loopback_traffic_goes_through_the_bucket_and_the_namespace_goes() -> None:
    link = load()
    with link.shaped_namespace(2.0) as name:
        assert name in namespaces()
        sent = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, "-c", SEND],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert sent.stdout.strip() == str(4 << 20), sent.stderr
        stats = subprocess.run(
            ["ip", "netns", "exec", name, "tc", "-s", "-j", "qdisc", "show", "dev", "lo"],
            capture_output=True,
            text=True,
        )
        (qdisc,) = json.loads(stats.stdout)
        assert qdisc["kind"] == "tbf"
        assert qdisc["bytes"] >= 4 << 20  # every payload byte crossed the bucket
    assert name not in namespaces()
    with pytest.raises(RuntimeError), link.shaped_namespace(2.0) as name:
        raise RuntimeError("the benchmark failed")
    assert name not in namespaces()


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_comm_methods_behind_a_shaped_link(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "plot.png"
    before = namespaces()
    cmd = [sys.executable, str(BENCH / "comm_methods.py"), "--tiny", "--tasks", "mlp"]
    cmd += ["--steps", "16", "--longer", "", "--link-gbit", "5", "--out", str(out)]
    cmd += ["--plot", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "behind a 5 Gbit/s shaped loopback" in proc.stdout
    result = json.loads(out.read_text())
    assert result["config"]["link_gbit"] == 5.0
    assert result["tasks"]["mlp"]["methods"]["fp32"]["wall_to_fp32_final_vs_fp32"] == 1.0
    assert namespaces() == before
