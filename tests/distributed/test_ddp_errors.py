"""Every DDP mistake a user can make ends in a clear error on every rank, never a hang.

Each case spawns its own ranks (the error ends them) and checks: every rank
raised a phalanx error carrying the stable fragments (a parameter's qualified
name, the flag to pass), every rank exited non-zero, and the group finished
well inside the deadline. The actual messages are printed on failure, so
their wording can be polished without guessing.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from tests.distributed.models import MLP, BranchNet, ddp_under_test, mse_loss, regression_batch
from tests.harness import Outcome, run_workers

# Well under the harness's 60 s collective timeout: an error that leaves a rank
# waiting in a collective shows up as a deadline failure, not a late pass.
DEADLINE = 40.0


def _phalanx_error_names() -> set[str]:
    # The harness reports the exception's class name only; any subclass of
    # PhalanxError defined by the time the DDP is imported counts.
    ddp_under_test()
    found, todo = set(), [phalanx.PhalanxError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return found


def _messages(outcomes: list[Outcome]) -> str:
    return "\n".join(
        f"  rank {o.rank} exit={o.exitcode} {o.error_type}: {o.error}" for o in outcomes
    )


def assert_error_on_every_rank(outcomes: list[Outcome], *fragments: str) -> None:
    shown = _messages(outcomes)
    names = _phalanx_error_names()
    for o in outcomes:
        assert o.error_type is not None, (
            f"rank {o.rank} raised nothing (returned {o.value!r}):\n{shown}"
        )
        assert o.exitcode not in (0, None), f"rank {o.rank} exited {o.exitcode}:\n{shown}"
        assert o.error_type in names, f"rank {o.rank}: not a PhalanxError:\n{shown}\n{o.traceback}"
        for fragment in fragments:
            assert fragment in (o.error or ""), f"rank {o.rank}: no {fragment!r} in:\n{shown}"


def _train_steps(model: Any, steps: int, use_branch: bool | None = None) -> str:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(steps):
        x, y = regression_batch(rank, step, 0)
        kwargs = {} if use_branch is None else {"use_branch": use_branch}
        mse_loss(model(x, **kwargs), y).backward()
        opt.step()
        opt.zero_grad()
    return f"trained {steps} steps without an error"


# ------------------------------------------------------------ the mistakes


def _hidden_size_differs_on_rank1(rank: int, world_size: int) -> None:
    ddp_under_test()(MLP(hidden=33 if rank == 1 else 32))


def _extra_layer_on_rank2(rank: int, world_size: int) -> None:
    net = MLP()
    if rank == 2:
        net.extra = nn.Linear(4, 4)
    ddp_under_test()(net)


def _batchnorm_size_differs_on_rank1(rank: int, world_size: int) -> None:
    # The parameters agree (BatchNorm without affine has none): only the buffers differ.
    net = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(9 if rank == 1 else 8, affine=False))
    ddp_under_test()(net)


def _buffer_on_rank2_only(rank: int, world_size: int, folder: str) -> None:
    net = MLP()
    if rank == 2:
        net.register_buffer("step_count", torch.zeros(1))
    start = time.monotonic()  # timed in the rank: spawning on a loaded machine does not count
    try:
        ddp_under_test()(net)
    finally:
        Path(folder, str(rank)).write_text(str(time.monotonic() - start))


def _frozen_module_wrapped_on_rank0_only(rank: int, world_size: int) -> None:
    # Rank 1 never wraps: a check made after the wrap's collectives would leave rank 0
    # waiting in them for the group's whole timeout (60 s, past DEADLINE).
    if rank == 0:
        ddp_under_test()(MLP().requires_grad_(False))


def _branch_unused_without_flag(rank: int, world_size: int) -> str:
    return _train_steps(ddp_under_test()(BranchNet()), steps=3, use_branch=False)


def _branch_used_on_rank0_only_without_flag(rank: int, world_size: int) -> str:
    # The nasty variant: rank 0 finishes its buckets, rank 1 never can. A reducer
    # that waits for rank 1's missing bucket hangs rank 0 instead of failing.
    return _train_steps(ddp_under_test()(BranchNet()), steps=3, use_branch=rank == 0)


def _branch_used_on_rank0_only_with_comm_hook(rank: int, world_size: int) -> str:
    # The same, with a compression hook: the hook owns the wire format, so the
    # failure flag must still reach every rank by some other way.
    model = ddp_under_test()(BranchNet())
    model.register_comm_hook(None, phalanx.comm_hooks.fp16_compress_hook)
    return _train_steps(model, steps=3, use_branch=rank == 0)


def _branch_used_on_rank0_only_with_chaining_hook(rank: int, world_size: int) -> str:
    # A hook that issues a second all-reduce from its future's callback: the
    # failure flags must not travel while that chain is still running.
    from tests.distributed.test_comm_hooks import chained_allreduce_hook

    model = ddp_under_test()(BranchNet(), bucket_cap_mb=0.0001)
    model.register_comm_hook(None, chained_allreduce_hook)
    return _train_steps(model, steps=3, use_branch=rank == 0)


def _backward_twice_retain_graph(rank: int, world_size: int) -> str:
    model = ddp_under_test()(MLP())
    x, y = regression_batch(rank, 0, 0)
    loss = mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    return "second backward through the same forward was accepted"


# ------------------------------------------------------------------ tests


@pytest.mark.timeout(90)
def test_parameter_shape_mismatch_names_parameter_and_rank() -> None:
    outcomes = run_workers(_hidden_size_differs_on_rank1, 2, allow_errors=True, timeout=DEADLINE)
    assert_error_on_every_rank(outcomes, "fc1.weight")
    for o in outcomes:
        assert re.search(r"rank", o.error or "", re.I) and re.search(r"\b1\b", o.error or ""), (
            f"the message does not name rank 1:\n{_messages(outcomes)}"
        )


@pytest.mark.timeout(90)
def test_extra_layer_on_one_rank_names_parameter_and_rank() -> None:
    outcomes = run_workers(_extra_layer_on_rank2, 3, allow_errors=True, timeout=DEADLINE)
    assert_error_on_every_rank(outcomes, "extra.weight")
    for o in outcomes:
        assert re.search(r"rank", o.error or "", re.I) and re.search(r"\b2\b", o.error or ""), (
            f"the message does not name rank 2:\n{_messages(outcomes)}"
        )


@pytest.mark.timeout(90)
def test_buffer_shape_mismatch_names_buffer_and_rank() -> None:
    outcomes = run_workers(_batchnorm_size_differs_on_rank1, 2, allow_errors=True, timeout=DEADLINE)
    assert_error_on_every_rank(outcomes, "1.running_mean", "buffers differ")
    for o in outcomes:
        assert re.search(r"rank\(s\) \[1\]", o.error or ""), _messages(outcomes)


@pytest.mark.timeout(120)
def test_buffer_on_one_rank_only_fails_fast_naming_it(tmp_path: Path) -> None:
    # Before buffers were compared, this waited out the whole collective timeout (the
    # harness's group has 60 s): the wrap must fail well before it.
    outcomes = run_workers(
        _buffer_on_rank2_only, 3, str(tmp_path), allow_errors=True, timeout=DEADLINE + 30
    )
    assert_error_on_every_rank(outcomes, "step_count", "buffers differ")
    for o in outcomes:
        assert re.search(r"rank\(s\) \[2\]", o.error or ""), _messages(outcomes)
        waited = float((tmp_path / str(o.rank)).read_text())
        assert waited < 30, f"rank {o.rank} waited {waited:.0f} s: on a collective's timeout?"


@pytest.mark.timeout(90)
def test_frozen_module_fails_before_any_collective() -> None:
    outcomes = run_workers(
        _frozen_module_wrapped_on_rank0_only, 2, allow_errors=True, timeout=DEADLINE
    )
    rank0 = outcomes[0]
    assert rank0.error_type == "ConfigurationError", _messages(outcomes)
    assert "requires a gradient" in (rank0.error or ""), _messages(outcomes)
    assert outcomes[1].error_type is None, _messages(outcomes)


@pytest.mark.timeout(90)
def test_unused_parameter_without_flag_names_it_and_the_fix() -> None:
    outcomes = run_workers(_branch_unused_without_flag, 2, allow_errors=True, timeout=DEADLINE)
    assert_error_on_every_rank(
        outcomes, "branch.weight", "branch.bias", "find_unused_parameters=True"
    )


@pytest.mark.timeout(90)
def test_parameter_unused_on_one_rank_fails_every_rank_without_hang() -> None:
    outcomes = run_workers(
        _branch_used_on_rank0_only_without_flag, 2, allow_errors=True, timeout=DEADLINE
    )
    assert_error_on_every_rank(outcomes, "find_unused_parameters=True")
    # Only rank 1 knows which of its parameters got no gradient; rank 0 may just
    # point at rank 1's error.
    assert "branch.weight" in (outcomes[1].error or ""), _messages(outcomes)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_parameter_unused_on_one_rank_fails_every_rank_with_a_comm_hook() -> None:
    outcomes = run_workers(
        _branch_used_on_rank0_only_with_comm_hook, 2, allow_errors=True, timeout=DEADLINE
    )
    assert_error_on_every_rank(outcomes, "find_unused_parameters=True")
    assert "branch.weight" in (outcomes[1].error or ""), _messages(outcomes)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_parameter_unused_on_one_rank_fails_every_rank_with_a_chaining_hook() -> None:
    outcomes = run_workers(
        _branch_used_on_rank0_only_with_chaining_hook, 2, allow_errors=True, timeout=DEADLINE
    )
    assert_error_on_every_rank(outcomes, "find_unused_parameters=True")
    assert "branch.weight" in (outcomes[1].error or ""), _messages(outcomes)


@pytest.mark.timeout(90)
def test_parameter_ready_twice_is_named() -> None:
    outcomes = run_workers(_backward_twice_retain_graph, 2, allow_errors=True, timeout=DEADLINE)
    assert_error_on_every_rank(outcomes)
    names = [name for name, _ in MLP().named_parameters()]
    for o in outcomes:
        assert any(name in (o.error or "") for name in names), (
            f"rank {o.rank}: no parameter name ({names}) in:\n{_messages(outcomes)}"
        )


@pytest.mark.timeout(30)
def test_wrap_without_process_group_says_call_init() -> None:
    # This process (pytest's) never joined a group.
    assert not (dist.is_available() and dist.is_initialized())
    with pytest.raises(phalanx.PhalanxError) as caught:
        ddp_under_test()(MLP())
    assert "phalanx.init()" in str(caught.value), f"message: {caught.value}"
