"""The logged traffic against the wire: two ranks in two network namespaces, one veth link.

Each rank trains the same 400k-parameter MLP under every data-parallel strategy
(ZeRO stages 0-3, local SGD, PowerSGD; tests/e2e/scripts/traffic_wire.py) and
reads its end of the link's byte counters across steps 5-8, which one log line
covers. Nothing else talks on that link, so what it carried, less what TCP sent
twice (a loaded machine's peer may drop or acknowledge late a burst, which TCP
resends whole), read once every socket's send queue is empty, is an independent
measure of what the collectives sent: the test holds the logged
`comm_wire_bytes_per_step` (the ring estimate of the logged payload) to it, and
the payload to the bytes gradients and parameters must take. docs/trainer.md
("What the traffic fields mean") gives the figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_netif import run_two_hosts

SCRIPT = Path(__file__).parent / "scripts" / "traffic_wire.py"
PORT = 29518  # the namespaces are fresh and private: a fixed port cannot collide
PARAM_BYTES = 4 * (256 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10)
"""The MLP's fp32 parameters (and gradients): 1,597,480 bytes."""

# What the link may carry beyond the estimate: TCP/IP headers and the ACKs of what the
# rank receives, in proportion to the bytes; and per collective, gloo's framing, the
# headers of its small messages and the Trainer's own one-number collectives (the stop
# and callback agreements). docs/trainer.md gives the measured margins these bound.
HEADER_SHARE = 0.03
PER_COLLECTIVE_BYTES = 4000.0


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("wire")
    results = []
    for rc, stdout, stderr in run_two_hosts([str(SCRIPT), str(out)], PORT, timeout_s=240):
        assert rc == 0, stderr[-4000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    print(json.dumps(results, indent=1))  # the figures, for docs/trainer.md (pytest -s)
    return results


STRATEGIES = ["stage0", "stage1", "stage2", "stage3", "local_sgd", "powersgd"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_link_carried_what_the_log_says(measured: list[dict[str, Any]], strategy: str) -> None:
    for rank, result in enumerate(measured):
        got = result[strategy]
        # A resent segment is traffic no collective asked for twice: TCP's, not ours.
        logged, tx = got["logged"], got["tx_per_step"] - got["resent_per_step"]
        wire, calls = logged["comm_wire_bytes_per_step"], logged["collectives_per_step"]
        assert wire > 0, f"rank {rank}: {strategy} logged no traffic: {got}"
        # Never less than the estimate: a counter that books bytes no collective sent fails.
        assert tx >= 0.99 * wire, f"rank {rank}: {strategy}: the link carried less: {got}"
        ceiling = wire * (1 + HEADER_SHARE) + PER_COLLECTIVE_BYTES * max(calls, 1)
        assert tx <= ceiling, f"rank {rank}: {strategy}: the link carried more: {got}"


@pytest.mark.timeout(300)
def test_the_payload_is_what_each_strategy_must_move(measured: list[dict[str, Any]]) -> None:
    """Per step and rank, on 2 ranks: DDP hands over the gradients once (and the step's
    flags), ZeRO-1 and ZeRO-2 the gradients (all-reduced or reduce-scattered) and then the
    whole parameters to gather; stage 3 gathers the parameters twice (forward, backward)
    and reduce-scatters the gradients; local SGD (every 2 steps) half the parameters;
    PowerSGD (rank 4) a small fraction of the gradients."""
    for result in measured:
        payload = {name: result[name]["logged"]["comm_bytes_per_step"] for name in STRATEGIES}
        assert PARAM_BYTES <= payload["stage0"] < PARAM_BYTES * 1.001
        for stage in ("stage1", "stage2"):
            assert payload[stage] == pytest.approx(2 * PARAM_BYTES, rel=1e-3), payload
        assert payload["stage3"] == pytest.approx(3 * PARAM_BYTES, rel=1e-3), payload
        assert payload["local_sgd"] == PARAM_BYTES / 2
        assert 0 < payload["powersgd"] < PARAM_BYTES / 10
