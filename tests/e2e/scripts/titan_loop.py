"""A training loop in torchtitan's style, written for torch's FSDP2.

The test runs it as it is and with only its `torch.distributed.fsdp` import
swapped for phalanx's. What it does, as torchtitan does: a data-parallel
`DeviceMesh` (1-D, or 2-D `(replicate, shard)` for HSDP with --hsdp), the
model built on the meta device and sharded block by block
(`reshard_after_forward` from a flag) then at the root with
`reshard_after_forward=False`, `to_empty` and `init_weights`, AdamW,
gradient accumulation with `set_requires_gradient_sync`, the global norm
from `torch.nn.utils.get_total_norm` (`.full_tensor()`) and
`clip_grads_with_norm_`, and checkpoints through `torch.distributed.checkpoint`
of `Stateful` wrappers over `get/set_model_state_dict` and
`get/set_optimizer_state_dict` (sharded, resharded on load).

Usage: titan_loop.py OUT_DIR [--steps N] [--first-step N] [--reshard {true,false,2}] [--hsdp]
                     [--load CHECKPOINT_DIR]
Saves OUT_DIR/step-<last> (DCP); rank 0 writes OUT_DIR/result.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

DIM, VOCAB, LAYERS, MICRO = 32, 48, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up, self.gate, self.down = nn.Linear(DIM, 64), nn.Linear(DIM, 64), nn.Linear(64, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def init_weights(self, std: float) -> None:
        self.norm.reset_parameters()
        for linear in (self.up, self.gate, self.down):
            nn.init.trunc_normal_(linear.weight, std=std)
            nn.init.zeros_(linear.bias)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def init_weights(self) -> None:
        nn.init.normal_(self.embed.weight)
        for i, block in enumerate(self.blocks):
            assert isinstance(block, Block)
            block.init_weights(0.02 / (2 * (i + 1)) ** 0.5)
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.head.weight, std=DIM**-0.5)


class ModelState(Stateful):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def parallelize(model: Model, mesh: Any, reshard: bool | int) -> Model:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    # torchtitan's line: the final norm and the output head, one unit of two modules.
    fully_shard([model.norm, model.head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--first-step", type=int, default=0)
    parser.add_argument("--reshard", default="true")
    parser.add_argument("--hsdp", action="store_true")
    parser.add_argument("--load", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    choices: dict[str, bool | int] = {"true": True, "false": False}
    reshard = choices[args.reshard] if args.reshard in choices else int(args.reshard)
    with torch.device("meta"):
        model = Model()
    parallelize(model, mesh, reshard)
    assert isinstance(model, FSDPModule)  # fully_shard swapped its class in place
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}
    if args.load is not None:
        dcp.load(state, checkpoint_id=str(args.load))
    losses, norms = [], []
    for step in range(args.first_step, args.first_step + args.steps):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            generator = torch.Generator().manual_seed(step * 100 + micro * 10 + rank)
            tokens = torch.randint(0, VOCAB, (4, 12), generator=generator)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / MICRO
            loss.backward()
            losses.append(loss.item())
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        assert isinstance(total, DTensor)  # of sharded gradients
        total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm=1.0, total_norm=total)
        norms.append(float(total))
        optimizer.step()
        optimizer.zero_grad()
    dcp.save(state, checkpoint_id=str(args.out / f"step-{args.first_step + args.steps}"))
    if rank == 0:
        (args.out / "result.json").write_text(json.dumps({"losses": losses, "norms": norms}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
