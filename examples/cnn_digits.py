"""Train a small CNN with BatchNorm on scikit-learn's 8x8 digits, data-parallel with phalanx.

The sibling of examples/digits.py, with one thing more to keep in sync:
BatchNorm's running mean and variance are buffers, not parameters, so no
gradient averages them. Each rank updates them from its own shard; the
DistributedDataParallel wrapper broadcasts rank 0's buffers before each
forward that follows a training step (broadcast_buffers=True, the default).
We evaluate through the wrapper, so that broadcast happens, and the final
check covers the buffers as well as the weights.

    python examples/cnn_digits.py                                  # one process
    phalanx launch --nproc-per-node 2 examples/cnn_digits.py       # two ranks
    torchrun --nproc-per-node 2 examples/cnn_digits.py             # the same script under torchrun

Needs scikit-learn (`pip install scikit-learn`). Reaches about 98% test
accuracy with the defaults in well under a minute on CPU. BatchNorm
normalises over each rank's own part of the batch, so one and two ranks train
slightly differently (SyncBatchNorm would make them agree).
"""

from __future__ import annotations

import torch

# The split, the batch and the loop are digits.py's: only the model and the images' shape differ.
from digits import SPLIT_SEED, TEST_FRACTION, parse_args, run
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

# Adam decayed to zero on a cosine; BatchNorm lets a small CNN take a high rate.
LEARNING_RATE = 3e-3
EPOCHS = 20
# Two 3x3 conv layers of 16 and 32 channels are plenty for 8x8 images.
CHANNELS = (16, 32)


def load_splits() -> tuple[TensorDataset, TensorDataset]:
    """Images as 1x8x8 tensors scaled to [0, 1], split the same way on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(x) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def build_model() -> nn.Module:
    """conv-BN-ReLU twice, pool 8x8 down to 4x4, then one linear layer to the 10 classes."""
    c1, c2 = CHANNELS
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1, bias=False),  # no bias: BatchNorm's shift replaces it
        nn.BatchNorm2d(c1),
        nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1, bias=False),
        nn.BatchNorm2d(c2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * 4 * 4, 10),
    )


def main() -> None:
    args = parse_args(__doc__, EPOCHS, LEARNING_RATE, "runs/examples/cnn_digits.pt")
    run(args, load_splits, build_model)


if __name__ == "__main__":
    main()
