"""Uneven inputs: phalanx.Join against torch DDP + torch's Join, on 3 real ranks.

Ranks 0, 1, 2 get 7, 5 and 3 batches. Each scenario trains torch's DDP
inside torch's Join, then phalanx's inside phalanx's, on the same seeds and
data, and compares every parameter and buffer on every rank (all ranks end
with the last joiner's model). The ranks out of batches must shadow the
gradient buckets, the used-map all-reduce (find_unused_parameters) and the
buffer broadcast (BatchNorm), or the others hang: the harness's deadline
turns a hang into a failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.distributed.models import BranchNet, regression_batch
from tests.harness import run_scenarios, run_workers

BATCHES = (7, 5, 3)


class BNNet(nn.Module):
    """BatchNorm in train mode: the running stats follow the highest training rank."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _train(
    ddp_cls: Any,
    join_cls: Any,
    make: Callable[[], nn.Module],
    rank: int,
    ddp_kwargs: dict[str, Any],
    join_kwargs: dict[str, Any],
    accumulate: int = 1,
) -> nn.Module:
    torch.manual_seed(0)
    net = make()
    model = ddp_cls(net, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with join_cls([model], **join_kwargs):
        for step in range(BATCHES[rank]):
            x, y = regression_batch(rank, step, 0)
            kwargs = {"use_branch": step % 2 == 0} if isinstance(net, BranchNet) else {}
            sync = (step + 1) % accumulate == 0
            context = model.no_sync() if not sync else _nothing()
            with context:
                loss = torch.nn.functional.mse_loss(model(x, **kwargs), y)
                loss.backward()
            if sync:
                opt.step()
                opt.zero_grad()
    return net


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _parity(
    make: Callable[[], nn.Module],
    rank: int,
    ddp_kwargs: dict[str, Any] | None = None,
    join_kwargs: dict[str, Any] | None = None,
    accumulate: int = 1,
) -> dict[str, float]:
    import phalanx

    ddp_kwargs, join_kwargs = ddp_kwargs or {}, join_kwargs or {}
    ref = _train(TorchDDP, TorchJoin, make, rank, ddp_kwargs, join_kwargs, accumulate)
    ours = _train(
        phalanx.DistributedDataParallel,
        phalanx.Join,
        make,
        rank,
        ddp_kwargs,
        join_kwargs,
        accumulate,
    )
    ref_state, our_state = ref.state_dict(), ours.state_dict()
    diff = max(
        (ref_state[k].double() - our_state[k].double()).abs().max().item() for k in ref_state
    )
    initial = make_initial(make)
    moved = max(
        (p.detach().double() - initial[name].double()).abs().max().item()
        for name, p in ours.named_parameters()
    )
    return {"diff": diff, "moved": moved}


def make_initial(make: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return make().state_dict()


def _model_join(rank: int) -> dict[str, float]:
    """`with model.join():` is Join([model])."""
    import phalanx

    torch.manual_seed(0)
    net = BNNet()
    model = phalanx.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(BATCHES[rank]):
            x, y = regression_batch(rank, step, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    everything = torch.cat([t.reshape(-1).double() for t in net.state_dict().values()])
    gathered = [torch.zeros_like(everything) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, everything)
    stats = model.reducer.stats
    return {
        "spread": max((g - gathered[0]).abs().max().item() for g in gathered),
        "shadow_rounds": stats.shadow_rounds,
        "sync_rounds": stats.sync_rounds,
    }


def _throws(rank: int) -> dict[str, Any]:
    import phalanx

    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(BNNet())
    steps = 0
    try:
        with phalanx.Join([model], throw_on_early_termination=True):
            for step in range(BATCHES[rank]):
                x, y = regression_batch(rank, step, 0)
                torch.nn.functional.mse_loss(model(x), y).backward()
                steps += 1
    except phalanx.UnevenInputsError as exc:
        return {"error": str(exc), "steps": steps}
    return {"error": None, "steps": steps}


def _zero_under_join(rank: int, stage: int, divide: bool) -> dict[str, float]:
    """ZeRO stage 1 or 2 under Join, the ranks out of batches stepping with the others
    (shadow_round(send_local=True), as the Trainer's even_batches=False does): the model
    must end as torch DDP + torch's Join leaves it (its last joiner's)."""
    import phalanx
    from phalanx.ddp.join import Shadowed

    ref = _train(TorchDDP, TorchJoin, BNNet, rank, {}, {"divide_by_initial_world_size": divide})
    torch.manual_seed(0)
    net = BNNet()
    model = phalanx.DistributedDataParallel(net)
    opt = phalanx.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, shard_gradients=stage == 2, lr=0.1, momentum=0.9
    )
    with phalanx.Join([model], divide_by_initial_world_size=divide) as join:
        for step in range(BATCHES[rank]):
            x, y = regression_batch(rank, step, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        while (shadowed := join.shadow_round(send_local=True)) is not Shadowed.NOTHING_LEFT:
            if shadowed is Shadowed.REDUCED:
                opt.step()
                opt.zero_grad()
    ref_state, our_state = ref.state_dict(), net.state_dict()
    diff = max((ref_state[k] - our_state[k]).abs().max().item() for k in ref_state)
    return {"diff": diff}


def _hook_under_join(rank: int, hook_name: str, divide: bool) -> dict[str, float]:
    """A comm hook under Join: phalanx's hooks (a HookState) average over the ranks Join
    says, as the default all-reduce does; torch's hooks (a process group as state) divide
    by the group's size whatever Join says, as they do under torch's Join."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import phalanx

    torch.manual_seed(0)
    net = BNNet()
    model = phalanx.DistributedDataParallel(net)
    if hook_name == "torch":
        torch_hook: Any = default_hooks.allreduce_hook  # torch's GradBucket type, same calls
        model.register_comm_hook(None, torch_hook)
    else:
        model.register_comm_hook(phalanx.comm_hooks.HookState(), phalanx.comm_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with phalanx.Join([model], divide_by_initial_world_size=divide):
        for step in range(BATCHES[rank]):
            x, y = regression_batch(rank, step, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    join_kwargs = {"divide_by_initial_world_size": divide}
    # The reference: torch's DDP with the same hook under its Join, or for phalanx's hook
    # torch's default reduction, which divides as Join says.
    ref_ddp = _torch_ddp_with_hook if hook_name == "torch" else TorchDDP
    ref = _train(ref_ddp, TorchJoin, BNNet, rank, {}, join_kwargs)
    ref_state, our_state = ref.state_dict(), net.state_dict()
    diff = max((ref_state[k] - our_state[k]).abs().max().item() for k in ref_state)
    return {"diff": diff}


def _torch_ddp_with_hook(net: nn.Module, **kwargs: Any) -> TorchDDP:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = TorchDDP(net, **kwargs)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    return model


def _zero_left_alone(rank: int, stage: int) -> str:
    """torch's join with ZeRO: a rank out of batches cannot shadow the optimizer's gather."""
    import phalanx

    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(BNNet())
    opt = phalanx.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, shard_gradients=stage == 2, lr=0.1
    )
    try:
        with phalanx.Join([model]):
            for step in range(BATCHES[rank]):
                x, y = regression_batch(rank, step, 0)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    except phalanx.ConfigurationError as exc:
        return str(exc)
    return "no error"


def _join_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    return run_scenarios(
        {
            "bn": lambda: _parity(BNNet, rank),
            "bn_not_initial": lambda: _parity(
                BNNet, rank, join_kwargs={"divide_by_initial_world_size": False}
            ),
            "unused": lambda: _parity(BranchNet, rank, ddp_kwargs={"find_unused_parameters": True}),
            "no_sync": lambda: _parity(BNNet, rank, accumulate=2),
            "buckets": lambda: _parity(BNNet, rank, ddp_kwargs={"bucket_cap_mb": 0.001}),
            "model_join": lambda: _model_join(rank),
            "throws": lambda: _throws(rank),
            "zero1": lambda: _zero_under_join(rank, 1, divide=True),
            "zero1_not_initial": lambda: _zero_under_join(rank, 1, divide=False),
            "zero2": lambda: _zero_under_join(rank, 2, divide=True),
            "zero2_not_initial": lambda: _zero_under_join(rank, 2, divide=False),
            "hook": lambda: _hook_under_join(rank, "phalanx", divide=True),
            "hook_not_initial": lambda: _hook_under_join(rank, "phalanx", divide=False),
            "torch_hook_not_initial": lambda: _hook_under_join(rank, "torch", divide=False),
            "zero1_left_alone": lambda: _zero_left_alone(rank, 1),
            "zero2_left_alone": lambda: _zero_left_alone(rank, 2),
        },
        rank,
    )


@pytest.fixture(scope="module")
def join_run() -> list[Any]:
    return run_workers(_join_scenarios, 3, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scenario", ["bn", "bn_not_initial", "unused", "no_sync", "buckets"])
def test_join_matches_torch_join(join_run: list[Any], scenario: str) -> None:
    for o in join_run:
        got = o.value[scenario]
        assert "error" not in got, got.get("error")
        assert got["moved"] > 1e-3, f"rank {o.rank}: the model did not train: {got}"
        assert got["diff"] <= 1e-6, f"rank {o.rank}: {scenario} differs from torch: {got}"


@pytest.mark.timeout(200)
def test_model_join_leaves_identical_replicas(join_run: list[Any]) -> None:
    for o in join_run:
        got = o.value["model_join"]
        assert "error" not in got, got.get("error")
        assert got["spread"] == 0.0, got
        # rank r trained BATCHES[r] iterations and shadowed the rest of the 7
        assert got["sync_rounds"] == BATCHES[o.rank], got
        assert got["shadow_rounds"] == BATCHES[0] - BATCHES[o.rank], got


@pytest.mark.timeout(200)
def test_throw_on_early_termination_raises_on_every_rank_naming_the_rank(
    join_run: list[Any],
) -> None:
    for o in join_run:
        got = o.value["throws"]
        assert got["error"] is not None, f"rank {o.rank} did not raise: {got}"
        assert "rank(s) [2] ran out of batches" in got["error"], got
        assert got["steps"] == 3, got  # everyone stops at the first iteration rank 2 lacks


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scenario", ["zero1", "zero1_not_initial", "zero2", "zero2_not_initial"])
def test_zero_under_join_ends_as_torch_ddp_and_join(join_run: list[Any], scenario: str) -> None:
    """ZeRO-2's reduce-scatter averages over the ranks still training too (it kept 1/N)."""
    for o in join_run:
        got = o.value[scenario]
        assert "error" not in got, got.get("error")
        assert got["diff"] <= 1e-6, f"rank {o.rank}: {scenario} differs from torch: {got}"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scenario", ["hook", "hook_not_initial", "torch_hook_not_initial"])
def test_comm_hook_under_join_divides_as_join_says(join_run: list[Any], scenario: str) -> None:
    """divide_by_initial_world_size=False reaches phalanx's hooks: the ranks still training
    share the gradient, as without a hook; torch's own hooks keep torch's rule."""
    for o in join_run:
        got = o.value[scenario]
        assert "error" not in got, got.get("error")
        assert got["diff"] <= 1e-6, f"rank {o.rank}: {scenario} differs from torch: {got}"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_under_torchs_join_is_one_clear_error_on_every_rank(
    join_run: list[Any], stage: int
) -> None:
    """Was a gloo SIGABRT: the rank out of batches met the others' parameter all-gather."""
    for o in join_run:
        message = o.value[f"zero{stage}_left_alone"]
        assert "rank(s) [2] ran out of batches under Join while a ZeroRedundancyOptimizer" in (
            message
        ), f"rank {o.rank}: {message}"
        assert "\n" not in message
