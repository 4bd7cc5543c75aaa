"""An FSDP2 training script as FSDP2's own tutorial structures one, written for torch.

The test runs it as it is (torch's fully_shard, under torchrun) and with only
its `torch.distributed.fsdp` import line swapped for phalanx's; nothing else
changes. What it does, as the tutorial does: a transformer built on the meta
device, `fully_shard` on each layer then the root, `to_empty` and
initialisation (every layer initialised: the tutorial's own `reset_parameters`
skips the layers), or a full checkpoint loaded instead (DCP's
`set_model_state_dict(broadcast_from_rank0=True)` or the DTensor API:
`distribute_tensor` and `load_state_dict(assign=True)`), checks of
`FSDPModule` and placements, mixed precision (`unshard` shows bf16),
explicit prefetching, Adam, `clip_grad_norm_`, and a full-state checkpoint
written by rank 0.

Usage: fsdp2_train.py OUT_DIR [--steps N] [--mixed-precision] [--explicit-prefetching]
                      [--dcp-api] [--load CHECKPOINT_DIR]
Writes OUT_DIR/checkpoint/{model,optim}.pt and, on rank 0, OUT_DIR/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 32, 4, 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, HEADS, DIM // HEADS).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, DIM))

    def reset_parameters(self) -> None:
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(F.gelu(self.w1(self.ffn_norm(h))))

    def reset_parameters(self) -> None:
        for m in (self.attention_norm, self.attention, self.ffn_norm, self.w1, self.w2):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self) -> None:
        for m in (self.tok_embeddings, self.pos_embeddings, *self.layers, self.norm, self.output):
            m.reset_parameters()


def load_model(model: nn.Module, path: Path, dcp_api: bool) -> None:
    full = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    if dcp_api:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
        return
    meta_sharded = model.state_dict()
    sharded = {
        name: nn.Parameter(
            distribute_tensor(tensor, meta_sharded[name].device_mesh, meta_sharded[name].placements)
        )
        for name, tensor in full.items()
    }
    model.load_state_dict(sharded, strict=False, assign=True)


def inspect(model: nn.Module, mixed_precision: bool) -> None:
    assert isinstance(model, Transformer) and isinstance(model, FSDPModule), type(model)
    for param in model.parameters():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), param
        assert param.dtype == torch.float32
    if mixed_precision:
        model.unshard()
        for param in model.output.parameters():
            assert param.dtype == torch.bfloat16, param.dtype
        model.reshard()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--explicit-prefetching", action="store_true")
    parser.add_argument("--dcp-api", action="store_true")
    parser.add_argument("--load", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.distributed.init_process_group(backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer()
    kwargs: dict[str, Any] = {}
    if args.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    assert isinstance(model, FSDPModule)  # fully_shard swapped its class in place
    if args.load is None:
        model.to_empty(device="cpu")
        model.reset_parameters()
    else:
        load_model(model, args.load / "model.pt", args.dcp_api)
    inspect(model, args.mixed_precision)
    if args.explicit_prefetching:
        layers = list(model.layers)
        for i, layer in enumerate(layers[:-1]):
            after = layers[i + 1]
            assert isinstance(layer, FSDPModule) and isinstance(after, FSDPModule)
            layer.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([layer])
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if args.load is not None:
        full = torch.load(args.load / "optim.pt", mmap=True, weights_only=True, map_location="cpu")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(model, optim, full, options=options)
    losses, norms = [], []
    generator = torch.Generator().manual_seed(100 + rank + (1000 if args.load else 0))
    for _ in range(args.steps):
        if args.explicit_prefetching:
            model.unshard()
        x = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        assert isinstance(norm, DTensor)  # of sharded gradients
        norms.append(float(norm.full_tensor()))
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optim, options=options)
    if rank == 0:
        checkpoint = args.out / "checkpoint"
        os.makedirs(checkpoint, exist_ok=True)
        torch.save(model_state, checkpoint / "model.pt")
        torch.save(optim_state, checkpoint / "optim.pt")
        result = {"losses": losses, "norms": norms, "world": torch.distributed.get_world_size()}
        (args.out / "result.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
