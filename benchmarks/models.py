"""The models the DDP step benchmarks run, each chosen to stress one part of a reducer.

- `mlp`: ~8M parameters in a handful of big tensors: the cost is bandwidth (33 MB of
  gradients per step) and how well the all-reduce overlaps the backward pass.
- `gpt`: a small GPT with 16 blocks and separate q/k/v/proj weights and biases, so over
  250 parameter tensors of a few KB each: the cost is per-parameter work in the hook path,
  which torch does in C++ and we do in Python.
- `cnn`: a small ResNet-style net with BatchNorm: DDP broadcasts its running stats from
  rank 0 before every forward (`broadcast_buffers=True`), so buffers cost time too.
- `mlp50`: the MLP at 50M parameters: 200 MB of gradients, where bucket size and
  overlap decide most of the step.

`--tiny` shrinks each one to a few hundred parameters so a smoke test finishes in seconds.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """How to build one benchmark model and feed it."""

    name: str
    """Key used on the command line and in the JSON."""
    build: Callable[[], nn.Module]
    """Constructs the module; the caller seeds the RNG first so every variant starts equal."""
    make_batch: Callable[[torch.Generator], Batch]
    """One rank's (inputs, targets) for one step, drawn from the given generator."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Maps (model output, targets) to a scalar loss."""


class MLP(nn.Module):
    """Plain ReLU MLP; a few wide layers so the parameter count is in big tensors."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for d_in, d_out in itertools.pairwise(dims):
            layers += [nn.Linear(d_in, d_out), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])  # no ReLU on the logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-LayerNorm transformer block with q, k, v and proj as separate Linears.

    Separate projections (instead of one fused qkv) are deliberate: they triple the
    number of small parameter tensors, which is what this model is here to measure.
    """

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            lin(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for lin in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, a stack of `Block`s, final LayerNorm, untied head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def conv_bn(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class CNN(nn.Module):
    """Conv-BN-ReLU stages that halve the resolution and double the channels."""

    def __init__(self, widths: list[int], classes: int) -> None:
        super().__init__()
        stages = [conv_bn(3, widths[0], 1)]
        for c_in, c_out in itertools.pairwise(widths):
            stages += [conv_bn(c_in, c_out, 2), conv_bn(c_out, c_out, 1)]
        self.features = nn.Sequential(*stages)
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def mlp_spec(tiny: bool) -> ModelSpec:
    # 1024-2048-2048-1024-10 is 8.4M parameters in 8 tensors.
    dims = [16, 32, 10] if tiny else [1024, 2048, 2048, 1024, 10]
    batch = 4 if tiny else 32

    def make_batch(g: torch.Generator) -> Batch:
        return torch.randn(batch, dims[0], generator=g), torch.randint(0, 10, (batch,), generator=g)

    return ModelSpec(
        name="mlp", build=lambda: MLP(dims), make_batch=make_batch, loss=F.cross_entropy
    )


def gpt_spec(tiny: bool) -> ModelSpec:
    # 16 blocks x 16 tensors + 5 = 261 tensors, most of them 64 or 64x64 floats.
    vocab, seq, d, heads, layers, batch = (32, 8, 16, 2, 2, 2) if tiny else (512, 32, 64, 4, 16, 8)

    def make_batch(g: torch.Generator) -> Batch:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    return ModelSpec(
        name="gpt",
        build=lambda: GPT(vocab, seq, d, heads, layers),
        make_batch=make_batch,
        loss=token_loss,
    )


def cnn_spec(tiny: bool) -> ModelSpec:
    widths, size, batch = ([4, 8], 8, 2) if tiny else ([32, 64, 128], 32, 16)

    def make_batch(g: torch.Generator) -> Batch:
        images = torch.randn(batch, 3, size, size, generator=g)
        return images, torch.randint(0, 10, (batch,), generator=g)

    return ModelSpec(
        name="cnn", build=lambda: CNN(widths, 10), make_batch=make_batch, loss=F.cross_entropy
    )


def mlp50_spec(tiny: bool) -> ModelSpec:
    # 2048-4096-4096-4096-2048-10 is 50.4M parameters in 10 tensors: 200 MB of gradients.
    dims = [16, 64, 10] if tiny else [2048, 4096, 4096, 4096, 2048, 10]
    batch = 4 if tiny else 16

    def make_batch(g: torch.Generator) -> Batch:
        return torch.randn(batch, dims[0], generator=g), torch.randint(0, 10, (batch,), generator=g)

    return ModelSpec(
        name="mlp50", build=lambda: MLP(dims), make_batch=make_batch, loss=F.cross_entropy
    )


SPECS: dict[str, Callable[[bool], ModelSpec]] = {
    "mlp": mlp_spec,
    "gpt": gpt_spec,
    "cnn": cnn_spec,
    "mlp50": mlp50_spec,
}


class TanhMLP(nn.Module):
    """Square Linears with Tanh between (the offload benchmarks' model); takes (x, y), the
    Trainer's batch, and returns the output for x."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        body: list[nn.Module] = []
        for _ in range(layers):
            body += [nn.Linear(width, width), nn.Tanh()]
        self.body = nn.Sequential(*body[:-1])

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.body(batch[0])
        return out
