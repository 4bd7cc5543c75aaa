"""Two "hosts" (network namespaces joined by a veth link) train over gloo.

This host's name resolves to 127.0.0.1, as on many machines. Left alone,
gloo advertises that loopback address to its peer, which then dials its own
loopback and the job fails; `phalanx.init()` points gloo at the interface
that routes to the master, so the same job works. Both halves run here: the
failure with plain torch proves the setup reproduces the problem, the
success proves phalanx fixes it.
"""

from __future__ import annotations

import json
import socket

import pytest

from phalanx.ground import netif
from tests.unit.test_netif import run_two_hosts

# The namespaces are fresh and private, so a fixed port cannot collide with anything.
PORT = 29517

WITH_PHALANX = """
import json, os, torch, torch.distributed as dist
import phalanx.runtime as runtime
world = runtime.init(backend="gloo", timeout=20)
t = torch.tensor([float(world.rank + 1)])
dist.all_reduce(t, group=world.process_group)
print(json.dumps({"rank": world.rank, "node": world.node_rank, "sum": t.item(),
                  "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}))
runtime.shutdown()
"""

PLAIN_TORCH = """
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=8))
t = torch.ones(1)
dist.all_reduce(t)
print("reduced", t.item())
"""


def _run_two_hosts(code: str) -> list[tuple[int, str, str]]:
    """Rank 0 in the master's namespace, rank 1 in the peer's; (rc, stdout, stderr) each."""
    return run_two_hosts(["-c", code], PORT, timeout_s=60)


def _require_loopback_hostname() -> None:
    if not netif.is_loopback(socket.gethostname()):
        pytest.skip("this host's name does not resolve to loopback: the problem cannot show")


@pytest.mark.slow  # gloo retries its doomed connects for about 45 s before giving up
@pytest.mark.timeout(150)
def test_plain_gloo_fails_across_namespaces_here() -> None:
    _require_loopback_hostname()
    results = _run_two_hosts(PLAIN_TORCH)
    assert any(rc != 0 for rc, _out, _err in results), results
    # ...and for the reason phalanx fixes: a peer dialled the loopback address it was given.
    assert any("remote=[127.0.0.1]" in err and "refused" in err for _rc, _out, err in results)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_phalanx_init_connects_across_namespaces() -> None:
    _require_loopback_hostname()
    results = _run_two_hosts(WITH_PHALANX)
    for rc, _out, err in results:
        assert rc == 0, err[-3000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for _rc, out, _err in results]
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["node"] for r in reports] == [0, 1]
    assert [r["sum"] for r in reports] == [3.0, 3.0]
    # Each side pins gloo to its own end of the veth pair.
    assert reports[0]["ifname"] != reports[1]["ifname"]
    assert all(r["ifname"] and r["ifname"].startswith("phx") for r in reports)
