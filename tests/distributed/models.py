"""Small models, their data, and the training recipe the DDP parity tests share.

Every model here is tiny on purpose: the tests run many scenarios on two
shared cores, and a parity bug shows up as well on 2 000 parameters as on 2
billion. Each model stresses one thing the reducer must get right (buffers,
unused or frozen or tied parameters, dict outputs, many buckets).

The models are built inside the worker processes, so nothing here needs to
pickle except the module-level functions the tests hand to `run_workers`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

# Which DDP the tests call "ours": phalanx's by default. PHALANX_TEST_DDP=torch
# points it at torch's own DDP, which must pass every parity test: that is how
# the tests themselves are checked (a failure there is a bug in the test).
# "package.module:Class" names any other class, e.g. a deliberately broken one.
DDP_UNDER_TEST_ENV = "PHALANX_TEST_DDP"


def ddp_under_test() -> type[Any]:
    """The DistributedDataParallel class the parity tests compare to torch's."""
    choice = os.environ.get(DDP_UNDER_TEST_ENV, "phalanx")
    if choice == "torch":
        return torch.nn.parallel.DistributedDataParallel
    if choice == "phalanx":
        import phalanx

        return phalanx.DistributedDataParallel
    module, _, name = choice.partition(":")
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class DeepMLP(nn.Module):
    """Nine layers of ~9 KiB each: a 0.01 MB bucket cap splits them into several buckets."""

    def __init__(self, width: int = 48, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width if i else 16, width) for i in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class ConvBN(nn.Module):
    """BatchNorm in train mode: running stats move every forward and must follow rank 0."""

    def __init__(self) -> None:
        super().__init__()
        # No conv bias: BatchNorm removes it, so its gradient is rounding noise,
        # which Adam would amplify into full steps that differ between reducers.
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)
        # Random running stats, so a rank whose buffers were not taken from rank 0
        # (or were, when torch would not) ends up visibly different.
        with torch.no_grad():
            for bn in (self.bn1, self.bn2):
                bn.running_mean.normal_()  # type: ignore[union-attr]
                bn.running_var.uniform_(0.5, 1.5)  # type: ignore[union-attr]

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class BranchNet(nn.Module):
    """`branch` takes part only when the caller asks: the unused-parameter cases."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.branch = nn.Linear(32, 4)

    def forward(self, x: Tensor, use_branch: bool = False) -> Tensor:
        h = torch.relu(self.trunk(x))
        out = self.head(h)
        return out + self.branch(h) if use_branch else out


class TiedLM(nn.Module):
    """The output projection is the embedding matrix: one Parameter used twice per forward."""

    vocab = 24

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, self.vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        features = torch.tanh(self.body(x))
        return {"logits": self.head(features), "features": features}


def frozen_mlp() -> MLP:
    net = MLP()
    net.fc1.requires_grad_(False)
    return net


# ----------------------------------------------------------------------- data


def _gen(rank: int, step: int, micro: int) -> torch.Generator:
    # Distinct per rank, step and micro-batch: ranks must not see the same data,
    # or a reducer that forgot to all-reduce would still pass.
    return torch.Generator().manual_seed(10_000 + 1_000 * rank + 10 * step + micro)


def regression_batch(rank: int, step: int, micro: int, n: int = 8) -> tuple[Tensor, Tensor]:
    g = _gen(rank, step, micro)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def class_batch(rank: int, step: int, micro: int, n: int = 8) -> tuple[Tensor, Tensor]:
    g = _gen(rank, step, micro)
    return torch.randn(n, 16, generator=g), torch.randint(0, 5, (n,), generator=g)


def image_batch(rank: int, step: int, micro: int, n: int = 4) -> tuple[Tensor, Tensor]:
    g = _gen(rank, step, micro)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def token_batch(rank: int, step: int, micro: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, TiedLM.vocab, (4, 7), generator=_gen(rank, step, micro))
    return tokens[:, :-1], tokens[:, 1:]


def mse_loss(out: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(out.float(), target)


def ce_loss(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.float().flatten(0, -2), target.flatten())


def dict_loss(out: dict[str, Tensor], target: Tensor) -> Tensor:
    return F.cross_entropy(out["logits"], target) + 0.1 * out["features"].pow(2).mean()


# --------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class Recipe:
    """One training scenario: what to build, what to feed it, how DDP is configured."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, int, int], tuple[Any, Tensor]]  # (rank, step, micro) -> (input, target)
    loss: Callable[[Any, Tensor], Tensor]
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    # Extra forward kwargs per (rank, step): how a branch is switched on and off.
    forward_kwargs: Callable[[int, int], dict[str, Any]] = lambda rank, step: {}
    micro_batches: int = 1  # >1: all but the last run inside no_sync()
    min_buckets: int = 1  # all-reduces a synced backward must launch (tiny bucket caps)
    autocast_bf16: bool = False


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        # eps well above gradient rounding: a correct reducer may add the ranks in
        # another order than torch (other bucket layout), an ulp apart. Where the
        # ranks' gradients nearly cancel, Adam with eps=1e-8 turns that ulp into
        # a visible step (seen: 2.6e-6 after 5 steps on 3 ranks); eps=1e-4 keeps
        # the update error under lr * ulp / eps, ~1e-8 per step.
        return torch.optim.Adam(params, lr=0.01, eps=1e-4)
    raise ValueError(f"unknown optimizer {name!r}")


def _autocast(on: bool) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def train(model: Any, recipe: Recipe, rank: int, opt_name: str, steps: int) -> list[float]:
    """Run `steps` optimizer steps on this rank's data; return the synced-step losses."""
    opt = make_optimizer(opt_name, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(recipe.micro_batches):
            inputs, target = recipe.batch(rank, step, micro)
            last = micro == recipe.micro_batches - 1
            # A plain module (the single-process reference) has no no_sync().
            no_sync = getattr(model, "no_sync", nullcontext)
            with no_sync() if not last else nullcontext():
                with _autocast(recipe.autocast_bf16):
                    out = model(inputs, **recipe.forward_kwargs(rank, step))
                loss = recipe.loss(out, target) / recipe.micro_batches
                loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


# ---------------------------------------------------------------- comparisons


def flat(tensors: Any) -> Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def spread_from_rank0(vector: Tensor) -> float:
    """Max |this rank's vector - rank 0's|, taken over all ranks (a collective)."""
    ref = vector.clone()
    dist.broadcast(ref, src=0)
    gap = torch.tensor([float((vector - ref).abs().max())], dtype=torch.float64)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap)


def compare_modules(ref: nn.Module, ours: nn.Module) -> dict[str, Any]:
    """Worst parameter and buffer differences, matched by position.

    Not by name: a compiled module prefixes its names with `_orig_mod.`.
    """
    worst, worst_name = 0.0, ""
    ours_params = list(ours.parameters())
    ref_named = list(ref.named_parameters())
    assert len(ours_params) == len(ref_named), "parameter counts differ"
    for (name, a), b in zip(ref_named, ours_params):
        gap = float((a.detach().double() - b.detach().double()).abs().max())
        if gap > worst:
            worst, worst_name = gap, name
    ours_buffers = list(ours.buffers())
    assert len(ours_buffers) == len(list(ref.buffers())), "buffer counts differ"
    buffer_gap, ints_equal = 0.0, True
    for x, y in zip(ref.buffers(), ours_buffers):
        if x.is_floating_point():
            buffer_gap = max(buffer_gap, float((x.double() - y.double()).abs().max()))
        else:
            ints_equal = ints_equal and bool(torch.equal(x, y))
    return {
        "param_diff": worst,
        "worst_param": worst_name,
        "buffer_diff": buffer_gap,
        "int_buffers_equal": ints_equal,
        "buffer_count": len(ours_buffers),
    }


def run_parity(
    recipe: Recipe,
    rank: int,
    opt_name: str,
    *,
    steps: int = 5,
    seed: int = 0,
    prepare_ours: Callable[[nn.Module], nn.Module] = lambda net: net,
    setup_ours: Callable[[Any], None] = lambda ddp: None,
    after_wrap: Callable[[Any], Any] = lambda ddp: ddp,
    setup_both: Callable[[Any], None] = lambda ddp: None,
    ours_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train torch DDP, then ours, from the same per-rank start and data; compare.

    The two never run interleaved: two reducers hooked into one backward would
    each see the other's collectives. Initial parameters differ per rank
    (seed + rank), so parity also proves the wrap-time broadcast from rank 0.
    `setup_both` runs on both wrappers (e.g. `_set_static_graph()`); `ours_kwargs`
    are extra arguments for ours only (where torch's would hang).
    """
    torch.manual_seed(seed + rank)
    ref_net = recipe.build()
    torch.manual_seed(seed + rank)
    our_net = recipe.build()
    initial = flat(ref_net.parameters())
    init_spread = spread_from_rank0(initial)
    rank0_initial = initial.clone()
    dist.broadcast(rank0_initial, src=0)

    ref = torch.nn.parallel.DistributedDataParallel(ref_net, **recipe.ddp_kwargs)
    setup_both(ref)
    ref_losses = train(ref, recipe, rank, opt_name, steps)

    our_kwargs = {**recipe.ddp_kwargs, **(ours_kwargs or {})}
    ours = after_wrap(ddp_under_test()(prepare_ours(our_net), **our_kwargs))
    wrap_diff = float((flat(ours.module.parameters()) - rank0_initial).abs().max())
    setup_both(ours)
    setup_ours(ours)
    our_losses = train(ours, recipe, rank, opt_name, steps)

    final = flat(ours.module.parameters())
    result = compare_modules(ref.module, ours.module)
    result.update(
        init_spread=init_spread,
        wrap_diff=wrap_diff,
        moved=float((final - rank0_initial).abs().max()),
        spread_ours=spread_from_rank0(final),
        spread_torch=spread_from_rank0(flat(ref.module.parameters())),
        losses_torch=ref_losses,
        losses_ours=our_losses,
        steps=steps,
        min_buckets=recipe.min_buckets,
        stats=reducer_stats(ours),
    )
    return result


def reducer_stats(ddp: Any) -> dict[str, Any] | None:
    """phalanx's `reducer.stats` counters as a dict; None for torch's DDP, which has none."""
    stats = getattr(getattr(ddp, "reducer", None), "stats", None)
    return None if stats is None else dict(vars(stats))


def _stats_problems(rank: int, r: dict[str, Any]) -> list[str]:
    # Parity alone cannot see an ignored no_sync() (reducing every micro-batch
    # gives the same average) or a bucket cap that was ignored: the counters can.
    stats = r["stats"]
    if stats is None:
        if os.environ.get(DDP_UNDER_TEST_ENV, "phalanx") == "phalanx":
            return [f"rank {rank}: phalanx DDP has no reducer.stats"]
        return []
    problems = []
    if stats["sync_rounds"] != r["steps"]:
        problems.append(
            f"rank {rank}: {stats['sync_rounds']} synced backward passes for {r['steps']} "
            f"optimizer steps (no_sync ignored?); stats {stats}"
        )
    if stats["buckets_launched"] < r["steps"] * r["min_buckets"]:
        problems.append(
            f"rank {rank}: {stats['buckets_launched']} bucket all-reduces over {r['steps']} "
            f"steps, expected >= {r['min_buckets']} per step (bucket_cap_mb ignored?)"
        )
    return problems


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


def parity_problems(outcomes: list[Any], tol: float = 1e-6) -> list[str]:
    """Everything wrong with one scenario's per-rank results, as readable lines."""
    problems = []
    for o in outcomes:
        r = o.value
        if "error" in r:
            problems.append(f"rank {o.rank} raised:\n{r['error']}")
            continue
        if not r["param_diff"] <= tol:
            problems.append(
                f"rank {o.rank}: params differ from torch DDP by {r['param_diff']:.3g} "
                f"(worst {r['worst_param']}); losses torch {_fmt(r['losses_torch'])} "
                f"ours {_fmt(r['losses_ours'])}"
            )
        if not r["buffer_diff"] <= tol or not r["int_buffers_equal"]:
            problems.append(
                f"rank {o.rank}: buffers differ from torch DDP by {r['buffer_diff']:.3g} "
                f"(integer buffers equal: {r['int_buffers_equal']})"
            )
        if r["wrap_diff"] != 0.0:
            problems.append(
                f"rank {o.rank}: after wrap, params differ from rank 0's by "
                f"{r['wrap_diff']:.3g} (no broadcast at wrap?)"
            )
        problems.extend(_stats_problems(o.rank, r))
    if problems:
        return problems
    first = outcomes[0].value
    # Sanity: the scenario can fail at all. Ranks started apart, training moved
    # the parameters, and torch's own replicas agree bit for bit.
    if not first["init_spread"] > 0:
        problems.append("test bug: initial parameters did not differ across ranks")
    if not first["moved"] > 1e-4:
        problems.append(f"test bug: training barely moved the parameters ({first['moved']})")
    if first["spread_torch"] != 0.0:
        problems.append(f"test bug: torch DDP replicas differ by {first['spread_torch']}")
    if first["spread_ours"] != 0.0:
        problems.append(f"replicas differ across ranks by {first['spread_ours']:.3g}")
    return problems


def hook_call_problems(per_rank: list[Any]) -> list[str]:
    """The hook, not the built-in all-reduce, must have reduced every bucket."""
    problems = []
    for o in per_rank:
        calls, stats = o.value["hook_calls"], o.value["stats"]
        # torch's DDP has no counters; it still must call the hook once per step at least.
        launched = stats["buckets_launched"] if stats else o.value["steps"]
        if calls < launched or calls == 0:
            problems.append(f"rank {o.rank}: comm hook called {calls} times; stats {stats}")
    return problems
