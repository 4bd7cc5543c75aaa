"""One rank of tests/e2e/test_traffic_wire.py: every data-parallel strategy on one model,
each step's traffic counted twice, by the Trainer's log and by the link's own counter.

Runs in its own network namespace, its only link a veth to the other rank's: every
byte a collective carries crosses that interface, and /sys/class/net/<veth>/statistics
counts it (payload, gloo's framing, TCP/IP headers, the ACKs of what it receives, and
what TCP sent again: a segment the loaded peer dropped or acknowledged late, which
`ss` reports per socket as bytes_retrans). Prints one JSON line: per strategy, the
link's counts over steps 5-8, the bytes TCP resent in them, and the log line of step 8,
which covers the same four steps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.train import Trainer, TrainerCallback, TrainingArguments

STRATEGIES: dict[str, dict[str, Any]] = {
    "stage0": {},
    "stage1": {"zero_stage": 1},
    "stage2": {"zero_stage": 2},
    "stage3": {"zero_stage": 3},
    "local_sgd": {"sync_method": "local_sgd", "sync_every": 2},
    "powersgd": {"ddp_comm_hook": "powersgd", "powersgd_start_iter": 2, "powersgd_rank": 4},
}
FIRST, LAST = 4, 8
"""The window: from the start of step FIRST + 1 to the end of step LAST (one log line)."""


class MLP(nn.Module):
    """400k fp32 parameters, no buffers: 1.6 MB of gradients a step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10)
        )

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _loss(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def _link_counts() -> tuple[int, int]:
    """(bytes sent, bytes received) on the interface gloo uses (phalanx.init chose it)."""
    stats = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _sockets() -> dict[str, tuple[int, int]]:
    """Per TCP socket of this namespace (by its two ends): the bytes in its send queue
    (given it, not yet acknowledged) and the payload bytes TCP has sent more than once."""
    listing = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, check=True)
    sockets: dict[str, tuple[int, int]] = {}
    name = ""
    for line in listing.stdout.splitlines():
        if line and not line[0].isspace():  # a socket's first line: state, queues, ends
            fields = line.split()
            name = " ".join(fields[3:5])
            sockets[name] = (int(fields[2]), 0)
        found = re.search(r"\bbytes_retrans:(\d+)", line)
        if found:
            sockets[name] = (sockets[name][0], int(found.group(1)))
    return sockets


def _resent_by_socket() -> dict[str, int]:
    """Per TCP socket of this namespace, the payload bytes TCP has sent more than once."""
    return {name: resent for name, (_, resent) in _sockets().items()}


def _drained(deadline_s: float = 30.0) -> None:
    """Wait until every TCP socket of this namespace has sent and had acknowledged all it
    was given: a collective ends when its bytes are received, but on a loaded machine its
    last bytes sent may still sit in the socket's queue, counted by the link only later
    (the window would lose them at its end and gain them at its start)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if all(queued == 0 for queued, _ in _sockets().values()):
            return
        time.sleep(0.001)
    raise TimeoutError(f"a socket still had bytes to send after {deadline_s} s")


class LinkWindow(TrainerCallback):
    """The link's counts across the window, what TCP resent in it, and the log line
    that covers it."""

    def __init__(self) -> None:
        self.start = self.end = (0, 0)
        self.resent_start: dict[str, int] = {}
        self.resent = 0
        self.logged: dict[str, float] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == FIRST:
            _drained()
            self.resent_start = _resent_by_socket()
            self.start = _link_counts()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == LAST:
            _drained()
            self.end = _link_counts()
            now = _resent_by_socket()
            self.resent = sum(n - self.resent_start.get(s, 0) for s, n in now.items())

    def on_log(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == LAST and "comm_bytes_per_step" in kw["logs"]:
            self.logged = dict(kw["logs"])


def _run(name: str, root: Path) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 256, generator=gen), torch.randint(0, 10, (256,)))
    args = TrainingArguments(
        output_dir=str(root / name),
        per_device_train_batch_size=8,
        max_steps=LAST,
        logging_steps=LAST - FIRST,
        max_grad_norm=0.0,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        ddp_backend="gloo",
        ddp_timeout=60,
        **STRATEGIES[name],
    )
    window = LinkWindow()
    trainer = Trainer(MLP(), args, train_dataset=data, loss_fn=_loss, callbacks=[window])
    try:
        trainer.train()
    finally:
        trainer.close()
    steps = LAST - FIRST
    return {
        "tx_per_step": (window.end[0] - window.start[0]) / steps,
        "rx_per_step": (window.end[1] - window.start[1]) / steps,
        "resent_per_step": window.resent / steps,
        "logged": {k: v for k, v in window.logged.items() if k.startswith(("comm", "coll"))},
    }


def main() -> None:
    phalanx.init(backend="gloo", timeout=60)
    root = Path(sys.argv[1])  # the same output_dir on every rank, as the Trainer asks
    print(json.dumps({name: _run(name, root) for name in STRATEGIES}), flush=True)


if __name__ == "__main__":
    main()
