"""phalanx DDP options beyond the defaults, each against torch DDP on 2 real ranks.

static_graph, broadcast_buffers=False, a torch.compile'd module, bf16 autocast
and a custom comm hook must all train to torch DDP's parameters; the wrapper
must look like torch's (`.module`, `module.`-prefixed state_dict keys). All
scenarios share one spawn. (Two backward passes per step with retain_graph
are rejected: see test_ddp_errors.py.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.models import (
    MLP,
    BranchNet,
    ConvBN,
    DeepMLP,
    Recipe,
    ce_loss,
    ddp_under_test,
    hook_call_problems,
    image_batch,
    mse_loss,
    parity_problems,
    regression_batch,
    run_parity,
)
from tests.harness import Outcome, run_scenarios, run_workers


class HookState:
    """Counts calls, so a wrapper that silently ignores the hook cannot pass."""

    def __init__(self) -> None:
        self.calls = 0


# Unannotated on purpose: torch's DDP rejects a hook whose annotations are not
# the GradBucket / Future classes themselves, and `from __future__ import
# annotations` makes them strings. Users' hooks look like this one.
def allreduce_then_divide(state, bucket):  # type: ignore[no-untyped-def]
    # Sum first, divide after: a different order from the default hook's
    # divide-then-sum, so this also checks that the hook's result is what lands
    # in .grad (the results agree to rounding, well inside 1e-6).
    state.calls += 1
    world = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


class MLPBatchNorm(nn.Module):
    """BatchNorm1d between linears: buffers broadcast before every compiled forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def compile_aot_eager(net: nn.Module) -> nn.Module:
    return torch.compile(net, backend="aot_eager")  # type: ignore[return-value]


@dataclass(frozen=True)
class Feature:
    recipe: Recipe
    opt: str = "sgd"
    # aot_eager runs AOTAutograd's decomposed, functionalised graph of forward
    # and backward in eager mode: the same math, but some ops are split
    # differently (e.g. addmm vs mm + add), so float32 rounding may differ by an
    # ulp per op. Five steps keep that far under 1e-5, not always under 1e-6.
    tol: float = 1e-6
    prepare_ours: Callable[[nn.Module], nn.Module] = field(default=lambda net: net)
    after_wrap: Callable[[Any], Any] = field(default=lambda ddp: ddp)
    comm_hook: bool = False


MLP_RECIPE = Recipe(MLP, regression_batch, mse_loss)
FEATURES: dict[str, Feature] = {
    "static_graph": Feature(Recipe(MLP, regression_batch, mse_loss, {"static_graph": True})),
    "static_graph_adam": Feature(
        Recipe(MLP, regression_batch, mse_loss, {"static_graph": True}), opt="adam"
    ),
    # A static graph may leave parameters unused without find_unused_parameters.
    "static_graph_unused_branch": Feature(
        Recipe(BranchNet, regression_batch, mse_loss, {"static_graph": True})
    ),
    "broadcast_buffers_off": Feature(
        Recipe(ConvBN, image_batch, ce_loss, {"broadcast_buffers": False})
    ),
    "compiled_aot_eager": Feature(MLP_RECIPE, tol=1e-5, prepare_ours=compile_aot_eager),
    # torch.compile(DDP(model)): the wrapper's bookkeeping stays eager, the module compiles.
    "compiled_wrapper_aot_eager": Feature(
        Recipe(MLPBatchNorm, regression_batch, mse_loss), tol=1e-5, after_wrap=compile_aot_eager
    ),
    "autocast_bf16_mlp": Feature(Recipe(MLP, regression_batch, mse_loss, autocast_bf16=True)),
    "autocast_bf16_cnn": Feature(Recipe(ConvBN, image_batch, ce_loss, autocast_bf16=True)),
    "comm_hook": Feature(MLP_RECIPE, comm_hook=True),
    "comm_hook_adam": Feature(MLP_RECIPE, opt="adam", comm_hook=True),
    "comm_hook_tiny_buckets": Feature(
        Recipe(DeepMLP, regression_batch, mse_loss, {"bucket_cap_mb": 0.01}, min_buckets=4),
        comm_hook=True,
    ),
}


def _run_feature(feature: Feature, rank: int) -> dict[str, Any]:
    state = HookState()

    def setup(ddp: Any) -> None:
        if feature.comm_hook:
            ddp.register_comm_hook(state, allreduce_then_divide)

    result = run_parity(
        feature.recipe,
        rank,
        feature.opt,
        prepare_ours=feature.prepare_ours,
        setup_ours=setup,
        after_wrap=feature.after_wrap,
    )
    result["hook_calls"] = state.calls
    return result


def _wrapper_surface(rank: int) -> dict[str, Any]:
    """`.module` is the wrapped module; state_dict keys and contents interchange with torch's."""
    torch.manual_seed(rank)
    net = MLP()
    ours = ddp_under_test()(net)
    ref = torch.nn.parallel.DistributedDataParallel(MLP())
    ours.load_state_dict(ref.state_dict())
    pairs = zip(ref.parameters(), ours.parameters())
    gap = max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)
    return {
        "module_is_net": ours.module is net,
        "keys": list(ours.state_dict()),
        "torch_keys": list(ref.state_dict()),
        "loaded_gap": gap,
    }


def _all_features(rank: int, world_size: int) -> dict[str, Any]:
    scenarios: dict[str, Callable[[], Any]] = {
        name: functools.partial(_run_feature, feature, rank) for name, feature in FEATURES.items()
    }
    scenarios["wrapper_surface"] = functools.partial(_wrapper_surface, rank)
    return run_scenarios(scenarios, rank)


@pytest.fixture(scope="module")
def feature_run() -> list[Outcome]:
    # One spawn of 2 ranks for every scenario; torch.compile alone takes a few seconds.
    return run_workers(_all_features, 2, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_matches_torch_ddp(feature_run: list[Outcome], name: str) -> None:
    per_rank = [Outcome(o.rank, o.exitcode, value=o.value[name]) for o in feature_run]
    problems = parity_problems(per_rank, tol=FEATURES[name].tol)
    if FEATURES[name].comm_hook and not problems:
        problems = hook_call_problems(per_rank)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.timeout(200)
def test_wrapper_surface_like_torch(feature_run: list[Outcome]) -> None:
    for o in feature_run:
        got = o.value["wrapper_surface"]
        assert "error" not in got, f"rank {o.rank} raised:\n{got.get('error')}"
        assert got["module_is_net"], "DDP(...).module is not the module that was wrapped"
        assert got["keys"] == got["torch_keys"], (
            f"state_dict keys {got['keys']} differ from torch DDP's {got['torch_keys']}"
        )
        assert all(k.startswith("module.") for k in got["keys"])
        assert got["loaded_gap"] == 0.0, "load_state_dict(torch DDP's state_dict) did not load"
