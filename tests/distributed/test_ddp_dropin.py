"""Drop-in cases that torch's DDP handles, each trained side by side with torch DDP on 2 ranks.

Reentrant checkpointing (the finalize must wait for the outermost backward),
static_graph with a layer shared by two reentrant segments (and
`_set_static_graph()`), ignored parameters and buffers, `copy.deepcopy` of the
wrapper, and torch 2.13's newer constructor arguments: each one honoured is
trained against torch's DDP given the same argument; each one refused must
name itself. All scenarios share one spawn.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.distributed.models import (
    DDP_UNDER_TEST_ENV,
    MLP,
    BranchNet,
    DeepMLP,
    Recipe,
    ddp_under_test,
    flat,
    mse_loss,
    parity_problems,
    regression_batch,
    run_parity,
    spread_from_rank0,
    train,
)
from tests.harness import Outcome, run_scenarios, run_workers

# ----------------------------------------------------------------------- models


class CheckpointedHead(nn.Module):
    """The output layers run in a reentrant checkpoint; `a` is reached after it ends."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def _head(self, t: Tensor) -> Tensor:
        return self.c(torch.relu(self.b(t)))

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        out: Tensor = checkpoint(self._head, h, use_reentrant=True)
        return out


class SharedCheckpointed(nn.Module):
    """One block used by two reentrant checkpoints: its gradient arrives in two parts."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.block = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def _segment(self, t: Tensor) -> Tensor:
        return torch.tanh(self.block(t))

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h = checkpoint(self._segment, h, use_reentrant=True)
        h = checkpoint(self._segment, h, use_reentrant=True)
        out: Tensor = self.c(h)
        return out


class MLPWithStats(nn.Module):
    """An MLP with a BatchNorm: buffers that move every step, for the ignore list."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4)
        with torch.no_grad():
            assert self.bn.running_mean is not None and self.bn.running_var is not None
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc2(torch.relu(self.bn(self.fc1(x))))
        return out


class ComplexMix(nn.Module):
    """A complex weight beside real ones: its bucket goes over the wire as real pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8, dtype=torch.cfloat) * 0.3)
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        z = x.to(torch.cfloat) @ self.w
        out: Tensor = self.out(torch.cat([z.real, z.imag], dim=-1))
        return out


IGNORED = ["fc1.weight", "bn.running_mean"]


# -------------------------------------------------------------------- scenarios


def _parity(recipe: Recipe, rank: int, **kw: Any) -> dict[str, Any]:
    return run_parity(recipe, rank, "sgd", **kw)


def _static_graph_set_later(ddp: Any) -> None:
    ddp._set_static_graph()


def _with_mesh(kwargs: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    return {**kwargs, "device_mesh": init_device_mesh("cpu", (dist.get_world_size(),))}


def _ignore_list(rank: int, via_attribute: bool) -> dict[str, Any]:
    """Ignored parameters train on local gradients and ignored buffers are never broadcast:
    in ours exactly as in torch's DDP, while everything else is synchronised."""
    results = []
    at_wrap: dict[str, float] = {}
    for ddp_class in (torch.nn.parallel.DistributedDataParallel, ddp_under_test()):
        torch.manual_seed(rank)
        net = MLPWithStats()
        if via_attribute:
            net._ddp_params_and_buffers_to_ignore = IGNORED  # type: ignore[assignment]
        else:
            ddp_class._set_params_and_buffers_to_ignore_for_model(net, IGNORED)
        model = ddp_class(net)
        at_wrap = {
            "ignored_weight": spread_from_rank0(flat([net.fc1.weight])),
            "ignored_buffer": spread_from_rank0(flat([net.bn.running_mean])),
            "synced": spread_from_rank0(flat([net.fc2.weight, net.bn.running_var])),
        }
        train(model, Recipe(MLPWithStats, regression_batch, mse_loss), rank, "sgd", steps=4)
        results.append(net)
    ref, ours = results
    pairs = zip(ref.state_dict().values(), ours.state_dict().values())
    return {
        "max_gap_to_torch": max(float((a.double() - b.double()).abs().max()) for a, b in pairs),
        "at_wrap": at_wrap,
        "ignored_weight_spread": spread_from_rank0(flat([ours.fc1.weight])),
        "synced_spread": spread_from_rank0(flat([ours.fc2.weight, ours.bn.weight])),
        "flag_set": via_attribute or hasattr(ours.fc1.weight, "_ddp_ignored"),
    }


def _refusals(rank: int) -> dict[str, str]:
    """Each refused argument raises an error naming it (and nothing is built half-way)."""
    net = MLP()
    cases: dict[str, dict[str, Any]] = {
        "mixed_precision": {"mixed_precision": object()},
        "delay_all_reduce_named_params": {
            "delay_all_reduce_named_params": [("fc1.weight", net.fc1.weight)],
            "param_to_hook_all_reduce": net.fc2.weight,
        },
        "skip_all_reduce_unused_params": {"skip_all_reduce_unused_params": True},
        "bucket_cap_mb=nan": {"bucket_cap_mb": float("nan")},
        "bucket_cap_mb=inf": {"bucket_cap_mb": float("inf")},
        "bucket_cap_mb_list": {"bucket_cap_mb_list": [1.0, -2.0]},
        "device_mesh": {"device_mesh": object(), "process_group": dist.group.WORLD},
    }
    messages = {}
    for name, kwargs in cases.items():
        try:
            ddp_under_test()(net, **kwargs)
            messages[name] = "accepted"
        except Exception as exc:  # the type is checked by the test
            messages[name] = f"{type(exc).__name__}: {exc}"
    return messages


REFUSED_METHODS = [
    "_register_fused_optim",
    "_register_buffer_comm_hook",
    "_get_ddp_logging_data",
    "_set_ddp_runtime_logging_sample_rate",
    "_set_sparse_metadata",
    "_update_process_group",
]


def _surface(rank: int) -> dict[str, Any]:
    """torch's smaller methods: the provided ones do what torch's do, the refused ones say so."""
    torch.manual_seed(rank)
    net = MLPWithStats()
    model = ddp_under_test()(net)
    result: dict[str, Any] = {"syncs_before": model.will_sync_module_buffers()}
    model.broadcast_buffers = False  # the older name must reach forward_sync_buffers
    result["syncs_after_off"] = model.will_sync_module_buffers()
    x, y = regression_batch(rank, 0, 0)
    mse_loss(model(x), y).backward()
    model._check_reducer_finalized()
    result["synced_grad_spread"] = spread_from_rank0(flat([net.fc2.weight.grad]))
    model._remove_autograd_hooks()
    net.zero_grad()
    mse_loss(model(x), y).backward()  # no longer reduced: each rank keeps its own gradient
    result["local_grad_spread"] = spread_from_rank0(flat([net.fc2.weight.grad]))
    result["refused"] = {}
    for method in REFUSED_METHODS:
        try:
            getattr(model, method)(None)
            result["refused"][method] = "accepted"
        except Exception as exc:
            result["refused"][method] = f"{type(exc).__name__}: {exc}"
    return result


def _builtin_hook(ddp: Any) -> None:
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)


PARITY: dict[str, Callable[[int], dict[str, Any]]] = {
    "reentrant_checkpoint_head": lambda rank: _parity(
        Recipe(CheckpointedHead, regression_batch, mse_loss), rank
    ),
    "reentrant_checkpoint_head_adam": lambda rank: run_parity(
        Recipe(CheckpointedHead, regression_batch, mse_loss), rank, "adam"
    ),
    "static_graph_shared_reentrant": lambda rank: _parity(
        Recipe(SharedCheckpointed, regression_batch, mse_loss, {"static_graph": True}), rank
    ),
    "static_graph_shared_reentrant_tiny_buckets": lambda rank: _parity(
        Recipe(
            SharedCheckpointed,
            regression_batch,
            mse_loss,
            {"static_graph": True, "bucket_cap_mb": 0.001},
            min_buckets=2,
        ),
        rank,
    ),
    "set_static_graph_later": lambda rank: _parity(
        Recipe(SharedCheckpointed, regression_batch, mse_loss),
        rank,
        setup_both=_static_graph_set_later,
    ),
    "deepcopy": lambda rank: _parity(
        Recipe(MLP, regression_batch, mse_loss), rank, after_wrap=copy.deepcopy
    ),
    "pickle_round_trip": lambda rank: _parity(
        Recipe(MLP, regression_batch, mse_loss),
        rank,
        after_wrap=lambda ddp: pickle.loads(pickle.dumps(ddp)),
    ),
    "deepcopy_static_graph": lambda rank: _parity(
        Recipe(SharedCheckpointed, regression_batch, mse_loss, {"static_graph": True}),
        rank,
        after_wrap=copy.deepcopy,
    ),
    "device_mesh": lambda rank: _parity(
        Recipe(MLP, regression_batch, mse_loss, _with_mesh({})), rank
    ),
    "bucket_cap_mb_list": lambda rank: _parity(
        Recipe(
            DeepMLP,
            regression_batch,
            mse_loss,
            {"bucket_cap_mb_list": [0.005, 0.02]},
            min_buckets=3,
        ),
        rank,
    ),
    "batched_grad_copy": lambda rank: _parity(
        Recipe(
            DeepMLP, regression_batch, mse_loss, {"batched_grad_copy": True, "bucket_cap_mb": 0.01}
        ),
        rank,
    ),
    "batched_grad_copy_bucket_view": lambda rank: _parity(
        Recipe(
            MLP,
            regression_batch,
            mse_loss,
            {"batched_grad_copy": True, "gradient_as_bucket_view": True},
            micro_batches=2,
        ),
        rank,
    ),
    # The branch fills a bucket of its own (0.0005 MB holds one layer) and no rank uses it.
    "skip_unused_bucket": lambda rank: _parity(
        Recipe(
            BranchNet,
            regression_batch,
            mse_loss,
            {"find_unused_parameters": True, "bucket_cap_mb": 0.0005},
        ),
        rank,
        ours_kwargs={"skip_all_reduce_unused_params": True},
    ),
    # Used on rank 0 only: torch's skip would hang here; ours must not skip it.
    "skip_unused_bucket_ranks_differ": lambda rank: _parity(
        Recipe(
            BranchNet,
            regression_batch,
            mse_loss,
            {"find_unused_parameters": True, "bucket_cap_mb": 0.0005},
            forward_kwargs=lambda r, step: {"use_branch": r == 0},
        ),
        rank,
        ours_kwargs={"skip_all_reduce_unused_params": True},
    ),
    "complex_parameter": lambda rank: _parity(
        Recipe(ComplexMix, regression_batch, mse_loss, min_buckets=2), rank
    ),
    "builtin_allreduce_hook": lambda rank: _parity(
        Recipe(MLP, regression_batch, mse_loss), rank, setup_both=_builtin_hook
    ),
}


# What torch's DDP cannot pass, so `PHALANX_TEST_DDP=torch` (which checks the tests
# themselves) leaves out: torch's skip_all_reduce_unused_params hangs when ranks
# differ, and torch accepts the arguments phalanx refuses.
PHALANX_ONLY = {"skip_unused_bucket_ranks_differ", "refusals", "surface"}


def _torch_under_test() -> bool:
    return os.environ.get(DDP_UNDER_TEST_ENV) == "torch"


def _all(rank: int, world_size: int) -> dict[str, Any]:
    scenarios: dict[str, Callable[[], Any]] = {
        name: functools.partial(fn, rank) for name, fn in PARITY.items()
    }
    scenarios["ignore_via_helper"] = functools.partial(_ignore_list, rank, False)
    scenarios["ignore_via_attribute"] = functools.partial(_ignore_list, rank, True)
    scenarios["refusals"] = functools.partial(_refusals, rank)
    scenarios["surface"] = functools.partial(_surface, rank)
    if _torch_under_test():
        scenarios = {k: v for k, v in scenarios.items() if k not in PHALANX_ONLY}
    return run_scenarios(scenarios, rank)


@pytest.fixture(scope="module")
def dropin_run() -> list[Outcome]:
    return run_workers(_all, 2, timeout=150)


def _per_rank(run: list[Outcome], name: str) -> list[Outcome]:
    if name in PHALANX_ONLY and _torch_under_test():
        pytest.skip("phalanx-only scenario")
    return [Outcome(o.rank, o.exitcode, value=o.value[name]) for o in run]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(PARITY))
def test_trains_like_torch_ddp(dropin_run: list[Outcome], name: str) -> None:
    problems = parity_problems(_per_rank(dropin_run, name))
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.timeout(200)
def test_unused_bucket_is_skipped_only_when_unused_everywhere(dropin_run: list[Outcome]) -> None:
    if _torch_under_test():
        pytest.skip("torch's DDP has no counters")
    for o in dropin_run:
        everywhere = o.value["skip_unused_bucket"]["stats"]
        differ = o.value["skip_unused_bucket_ranks_differ"]["stats"]
        assert everywhere["buckets_skipped"] == everywhere["sync_rounds"] == 5, everywhere
        assert differ["buckets_skipped"] == 0, differ


@pytest.mark.timeout(200)
@pytest.mark.parametrize("variant", ["ignore_via_helper", "ignore_via_attribute"])
def test_ignored_parameters_and_buffers_stay_local_as_in_torch(
    dropin_run: list[Outcome], variant: str
) -> None:
    for o in dropin_run:
        got = o.value[variant]
        assert "error" not in got, got.get("error")
        assert got["max_gap_to_torch"] <= 1e-6, got
        wrap = got["at_wrap"]
        assert wrap["ignored_weight"] > 0, f"ignored fc1.weight was broadcast at wrap: {got}"
        assert wrap["ignored_buffer"] > 0, f"ignored bn.running_mean was broadcast: {got}"
        assert wrap["synced"] == 0.0, got
        assert got["ignored_weight_spread"] > 0, f"ignored fc1.weight was synchronised: {got}"
        assert got["synced_spread"] == 0.0, got
        assert got["flag_set"], got


@pytest.mark.timeout(200)
def test_refused_arguments_name_themselves(dropin_run: list[Outcome]) -> None:
    expect = {
        "mixed_precision": "NotSupportedError",
        "delay_all_reduce_named_params": "NotSupportedError",
        "skip_all_reduce_unused_params": "ConfigurationError",
        "bucket_cap_mb=nan": "ConfigurationError",
        "bucket_cap_mb=inf": "ConfigurationError",
        "bucket_cap_mb_list": "ConfigurationError",
        "device_mesh": "ConfigurationError",
    }
    for o in _per_rank(dropin_run, "refusals"):
        got = o.value
        assert "error" not in got, got.get("error")
        for case, error_type in expect.items():
            message = got[case]
            argument = case.split("=")[0]
            assert message.startswith(error_type), f"{case}: {message}"
            assert argument in message and "\n" not in message, f"{case}: {message}"


@pytest.mark.timeout(200)
def test_smaller_torch_methods_work_or_refuse_by_name(dropin_run: list[Outcome]) -> None:
    for o in _per_rank(dropin_run, "surface"):
        got = o.value
        assert "error" not in got, got.get("error")
        assert got["syncs_before"] and not got["syncs_after_off"], got
        assert got["synced_grad_spread"] == 0.0, got
        assert got["local_grad_spread"] > 0, f"_remove_autograd_hooks left the reducer: {got}"
        for method, message in got["refused"].items():
            assert message.startswith("NotSupportedError"), f"{method}: {message}"
            assert method.strip("_") in message and "\n" not in message, f"{method}: {message}"
