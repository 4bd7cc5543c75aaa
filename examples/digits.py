"""Train an MLP on scikit-learn's handwritten digits, data-parallel with phalanx.

The 1,797 8x8 digit images ship inside scikit-learn, so this runs anywhere with
no download. Every rank holds the whole model, trains on its own shard of each
batch, and phalanx averages the gradients; at the end we prove that the
replicas are still bit-for-bit identical.

    python examples/digits.py                                  # one process
    phalanx launch --nproc-per-node 2 examples/digits.py       # two ranks
    torchrun --nproc-per-node 2 examples/digits.py             # the same script under torchrun

Needs scikit-learn (`pip install scikit-learn`). Reaches 96.4% test
accuracy with the defaults in a few seconds on CPU, on one process (95.8% where
torch runs its plain kernels, ATEN_CPU_CAPABILITY=default, rather than AVX2 or
AVX-512), on any number of cores: each rank computes with one thread (see `run`).
The batch size is global (split over the ranks) and rank r takes every
world_size-th sample, so one rank and two ranks see the very same batches; their
gradients are summed in another order (a mean over 64 against the average of
two means over 32), so two ranks end 2 of 359 test digits apart: 95.8% (96.4%
with the plain kernels). benchmarks/digits_accuracy.py runs every case.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

# The whole batch across ranks: keeping it fixed makes one and two ranks train the same way.
GLOBAL_BATCH = 64
# Adam, decayed to zero on a cosine: 1e-2 is high for Adam but this small MLP on
# standardised inputs takes it, and it gets near its final accuracy in ~100 steps.
# 30 epochs of 22 steps is where test accuracy stops improving (96.4%).
LEARNING_RATE = 1e-2
EPOCHS = 30
HIDDEN = 128
# The classic split: hold out a fifth of the images, fixed by its own seed so
# that every run and every rank tests on the same 359 images.
TEST_FRACTION = 0.2
SPLIT_SEED = 1234


def parse_args(
    description: str = __doc__,
    epochs: int = EPOCHS,
    lr: float = LEARNING_RATE,
    out: str = "runs/examples/digits.pt",
) -> argparse.Namespace:
    """The flags of this example and of cnn_digits.py, which passes its own defaults."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--batch-size", type=int, default=GLOBAL_BATCH, help="across all ranks")
    parser.add_argument("--out", type=Path, default=Path(out))
    return parser.parse_args()


def load_splits() -> tuple[TensorDataset, TensorDataset]:
    """Images as 64 features and labels, split the same way on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(x) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    # Standardise with the training images' statistics: the MLP then trains well at a high lr.
    # Pixels that never vary in training keep their scale (std floor 1, in pixel units 0-16):
    # a floor near 0 would blow a rare test pixel up a thousandfold, and with it the loss.
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1.0)
    x = (x - mean) / std
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 10),
    )


def all_reduce(values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
    """Combine per-rank numbers (a world of one has a real group too, so no special case)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def evaluate(model: nn.Module, test_set: TensorDataset, world: phalanx.World) -> float:
    """Exact test accuracy: each rank scores a disjoint share, and the counts are summed.

    pad=False makes every test image count exactly once, whatever the world size.
    `model` is the DDP wrapper on purpose: its first forward after training
    broadcasts rank 0's buffers (BatchNorm statistics in cnn_digits.py), so
    every rank scores with the same model.
    """
    sampler = phalanx.DistributedSampler(test_set, shuffle=False, pad=False)
    correct = seen = 0
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(test_set, batch_size=256, sampler=sampler):
            correct += int((model(x.to(world.device)).argmax(1) == y.to(world.device)).sum())
            seen += len(y)
    model.train()
    correct_all, seen_all = all_reduce([correct, seen])
    return correct_all / seen_all


def replica_gap(model: nn.Module) -> float:
    """Largest |difference| between this replica's state and rank 0's, over all ranks."""
    flat = torch.cat([t.detach().flatten().double().cpu() for t in model.state_dict().values()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    (gap,) = all_reduce([float((flat - reference).abs().max())], op=dist.ReduceOp.MAX)
    return gap


def save(model: nn.Module, path: Path) -> None:
    """Write to a temporary name then rename, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")
    torch.save(model.state_dict(), partial)
    os.replace(partial, path)


def train_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    steps_left: int,
    world: phalanx.World,
) -> tuple[float, int, int]:
    """One pass over this rank's shard (or fewer steps): mean loss, steps, samples seen."""
    loss_fn = nn.CrossEntropyLoss()
    loss_sum, steps, samples = 0.0, 0, 0
    for x, y in loader:
        loss = loss_fn(model(x.to(world.device)), y.to(world.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # phalanx all-reduces the gradients during this call
        optimizer.step()
        schedule.step()
        loss_sum, steps, samples = loss_sum + loss.item(), steps + 1, samples + len(y)
        if steps >= steps_left:
            break
    return loss_sum / max(1, steps), steps, samples * world.world_size


def main() -> None:
    run(parse_args(), load_splits, build_model)


def run(
    args: argparse.Namespace,
    load_splits: Callable[[], tuple[TensorDataset, TensorDataset]],
    build_model: Callable[[], nn.Module],
) -> None:
    """Train, evaluate, check the replicas and save: shared with cnn_digits.py."""
    world = phalanx.init()
    # One thread per rank, on any machine. These matrices (batches of 32 by 128) are too
    # small for more to help: two threads took 25-50x as long on a 2-core machine. And the
    # thread count decides how a matmul splits its sums, so it moved the test accuracy (one
    # process, AVX-512: 96.4% on one thread, 95.8% on 2 to 16): README's figure was a
    # machine's. benchmarks/digits_accuracy.py shows what is left: world size and kernels.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # same initial weights everywhere; DDP broadcasts rank 0's anyway
    train_set, test_set = load_splits()
    per_rank_batch = max(1, args.batch_size // world.world_size)
    sampler = phalanx.DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=per_rank_batch, sampler=sampler, drop_last=True)
    model = phalanx.DistributedDataParallel(build_model().to(world.device))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # --steps, when given, replaces --epochs as the budget (a short run for tests).
    budget = args.steps if args.steps is not None else args.epochs * len(loader)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=budget)
    if world.is_main:
        print(
            f"world size {world.world_size}, {world.backend} on {world.device}, "
            f"{len(train_set)} train / {len(test_set)} test images, "
            f"batch {per_rank_batch} per rank, {budget} steps"
        )

    step, samples, train_time, epoch = 0, 0, 0.0, 0
    while step < budget:
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        loss, steps, seen = train_epoch(model, loader, optimizer, schedule, budget - step, world)
        train_time += time.perf_counter() - started
        step, samples = step + steps, samples + seen
        (mean_loss,) = all_reduce([loss / world.world_size])
        if world.is_main and (epoch % 5 == 0 or step >= budget):
            print(f"epoch {epoch:3d} step {step:5d} train loss {mean_loss:.4f}")
        epoch += 1

    accuracy = evaluate(model, test_set, world)
    gap = replica_gap(model.module)
    if world.is_main:
        print(f"test accuracy: {accuracy:.4f}")
        print(
            f"throughput: {samples / max(train_time, 1e-9):.0f} samples/s "
            f"({world.world_size} ranks, {train_time:.2f}s training)"
        )
        print(f"replicas identical: {'yes' if gap == 0 else 'no'} (max |diff| {gap:.3g})")
        save(model.module, args.out)
        print(f"saved {args.out}")
    phalanx.shutdown()


if __name__ == "__main__":
    main()
