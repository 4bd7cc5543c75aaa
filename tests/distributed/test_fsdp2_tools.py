"""torch's own tools give the right answers on a phalanx stage-3 model, as on torch's FSDP2.

Real gloo ranks. Each scenario runs once on phalanx's fully_shard and once on
torch's, and the test compares the two:

- the FSDP2 surface: `isinstance(m, FSDPModule)` with the original class kept,
  DTensor parameters placed `(Shard(0),)`, `model.state_dict()` of DTensors,
  `unshard()` / `reshard()` outside forward (bf16 under a bf16 policy),
  `unshard(async_op=True)`, `register_fsdp_forward_method`, explicit prefetch;
- meta-device construction, `to_empty`, `reset_parameters`, then training;
- torch.distributed.checkpoint: `get/set_model_state_dict` and
  `get/set_optimizer_state_dict`, full and sharded, `dcp.save` / `dcp.load`,
  and each side loading the other's checkpoint;
- HSDP on a 2-D mesh (replicate 2 x shard 1 at world 2; 2 x 2 at world 4);
- `check_replicas` on DTensor models, ours and torch's.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from tests.distributed.models import ce_loss, token_batch
from tests.distributed.test_zero3 import TinyGPT
from tests.harness import Outcome, run_scenarios, run_workers


def _api(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.fsdp as api

        return api
    return phalanx


def _shard(net: TinyGPT, impl: str, **kwargs: Any) -> Any:
    """`net` itself, now also an FSDPModule: a class made at run time, which no annotation
    names, so Any (its unshard, reshard and prefetch methods are what the tests call)."""
    api = _api(impl)
    for block in net.blocks:
        api.fully_shard(block, **kwargs)
    api.fully_shard(net, **kwargs)
    return net


def _steps(net: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = token_batch(rank, step, 0)
        loss = ce_loss(net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(net: nn.Module) -> dict[str, Any]:
    """The whole parameters, as plain lists (tensors must not travel through the harness's
    queue: their shared memory goes with the worker)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    full: dict[str, Any] = {}
    for k, v in state.items():
        assert isinstance(v, torch.Tensor), k  # full_state_dict: plain tensors
        full[k] = v.float().tolist()
    return full


# ------------------------------------------------------------------ scenarios


def _surface(impl: str, rank: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    api = _api(impl)
    torch.manual_seed(0)
    policy = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    net = _shard(TinyGPT(), impl, mp_policy=policy)
    out: dict[str, Any] = {
        "is_fsdp": isinstance(net, api.FSDPModule) and isinstance(net, TinyGPT),
        "class": type(net).__name__,
        "placements": {str(p.placements) for p in net.parameters()},
        "state_dict_dtensors": all(isinstance(v, DTensor) for v in net.state_dict().values()),
        "sharded_dtype": {str(p.dtype) for p in net.parameters()},
    }
    root_params = lambda: [net.embed.weight, net.ln_f.weight, net.head.weight]  # noqa: E731
    net.unshard()
    out["unsharded_dtype"] = {str(p.dtype) for p in root_params()}
    out["unsharded_plain"] = not any(isinstance(p, DTensor) for p in root_params())
    net.reshard()
    out["resharded"] = all(p.placements == (Shard(0),) for p in root_params())
    handle = net.blocks[0].unshard(async_op=True)
    handle.wait()
    net.blocks[0].reshard()
    blocks = list(net.blocks)
    for i, block in enumerate(blocks[:-1]):
        block.set_modules_to_forward_prefetch([blocks[i + 1]])
        blocks[i + 1].set_modules_to_backward_prefetch([block])
    api.register_fsdp_forward_method(net, "logits_of")
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    out["losses"] = _steps(net, opt, rank, range(3))
    out["method"] = float(net.logits_of(token_batch(rank, 9, 0)[0]).float().sum())
    return out


def _meta_init(impl: str, rank: int) -> dict[str, Any]:
    with torch.device("meta"):
        net = TinyGPT()
    _shard(net, impl)
    net.to_empty(device="cpu")
    torch.manual_seed(1)
    for module in net.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()  # type: ignore[operator]
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    return {"losses": _steps(net, opt, rank, range(4)), "state": _full(net)}


def _checkpoints(impl: str, rank: int, root: str) -> dict[str, Any]:
    """Train 3 steps, save (DCP, sharded) and full state dicts, train 3 more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    torch.manual_seed(0)
    net = _shard(TinyGPT(), impl)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    _steps(net, opt, rank, range(3))
    state = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}
    dcp.save(state, checkpoint_id=str(Path(root) / impl))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if rank == 0:
        torch.save(
            {
                "model": get_model_state_dict(net, options=full),
                "optim": get_optimizer_state_dict(net, opt, options=full),
            },
            Path(root) / f"{impl}-full.pt",
        )
    else:
        get_model_state_dict(net, options=full)
        get_optimizer_state_dict(net, opt, options=full)
    return {"after": _steps(net, opt, rank, range(3, 6)), "state": _full(net)}


def _resume(impl: str, rank: int, root: str, source: str, form: str) -> dict[str, Any]:
    """Load `source`'s checkpoint (sharded DCP, or full from rank 0) into a fresh model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    torch.manual_seed(7)  # other values: the load must bring the checkpoint's
    net = _shard(TinyGPT(), impl)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    if form == "sharded":
        model_sd, optim_sd = get_model_state_dict(net), get_optimizer_state_dict(net, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(root) / source))
        set_model_state_dict(net, model_sd)
        set_optimizer_state_dict(net, opt, optim_sd)
    else:
        full: dict[str, Any] = {}
        if rank == 0:
            full = torch.load(Path(root) / f"{source}-full.pt", weights_only=True)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        model_state: dict[str, Any] = full.get("model", {})
        optim_state: dict[str, Any] = full.get("optim", {})
        set_model_state_dict(net, model_state, options=options)
        set_optimizer_state_dict(net, opt, optim_state, options=options)
    return {"after": _steps(net, opt, rank, range(3, 6)), "state": _full(net)}


def _hsdp(impl: str, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = _shard(TinyGPT(), impl, mesh=mesh)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = _steps(net, opt, rank, range(4))
    placements = {str(p.placements) for p in net.parameters()}
    phalanx.check_replicas(net)
    return {"losses": losses, "state": _full(net), "placements": placements}


def _replicas(impl: str, rank: int) -> dict[str, Any]:
    import warnings

    net = _shard(TinyGPT(), impl)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        phalanx.check_replicas(net)  # FSDP over every rank: nothing replicated to compare
    return {"warned": [str(w.message) for w in caught]}


def _all(rank: int, world: int, root: str) -> dict[str, Any]:
    scenarios: dict[str, Any] = {}
    for impl in ("phalanx", "torch"):
        scenarios[f"surface/{impl}"] = functools.partial(_surface, impl, rank)
        scenarios[f"meta/{impl}"] = functools.partial(_meta_init, impl, rank)
        scenarios[f"save/{impl}"] = functools.partial(_checkpoints, impl, rank, root)
        scenarios[f"hsdp/{impl}"] = functools.partial(_hsdp, impl, rank, world)
        scenarios[f"replicas/{impl}"] = functools.partial(_replicas, impl, rank)
    for source in ("phalanx", "torch"):
        for impl in ("phalanx", "torch"):
            for form in ("sharded", "full"):
                key = f"load/{source}->{impl}/{form}"
                scenarios[key] = functools.partial(_resume, impl, rank, root, source, form)
    return run_scenarios(scenarios, rank)


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    root = tmp_path_factory.mktemp("fsdp2")
    return run_workers(_all, 2, str(root), timeout=240)


def _ok(outcomes: list[Outcome], key: str) -> dict[str, Any]:
    for o in outcomes:
        assert "error" not in o.value[key], f"rank {o.rank} {key}:\n{o.value[key]['error']}"
    value: dict[str, Any] = outcomes[0].value[key]
    return value


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(torch.tensor(a[k]), torch.tensor(b[k])), k


@pytest.mark.timeout(300)
def test_the_fsdp2_surface_is_torchs(tools: list[Outcome]) -> None:
    ours, theirs = _ok(tools, "surface/phalanx"), _ok(tools, "surface/torch")
    assert ours["is_fsdp"] and ours["class"] == "FSDPTinyGPT"
    assert ours["placements"] == {"(Shard(dim=0),)"} and ours["state_dict_dtensors"]
    assert ours["sharded_dtype"] == {"torch.float32"}
    assert ours["unsharded_dtype"] == {"torch.bfloat16"} and ours["unsharded_plain"]
    assert ours["resharded"]
    for key in ("placements", "sharded_dtype", "unsharded_dtype", "losses", "method"):
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])


@pytest.mark.timeout(300)
def test_meta_device_initialisation_trains_as_torchs(tools: list[Outcome]) -> None:
    ours, theirs = _ok(tools, "meta/phalanx"), _ok(tools, "meta/torch")
    assert ours["losses"] == theirs["losses"]
    assert all(loss == loss for loss in ours["losses"])  # not NaN: every block initialised
    _same_state(ours["state"], theirs["state"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", ["sharded", "full"])
@pytest.mark.parametrize("source", ["phalanx", "torch"])
@pytest.mark.parametrize("impl", ["phalanx", "torch"])
def test_checkpoints_load_across_implementations(
    tools: list[Outcome], impl: str, source: str, form: str
) -> None:
    saved = _ok(tools, f"save/{source}")
    loaded = _ok(tools, f"load/{source}->{impl}/{form}")
    assert loaded["after"] == saved["after"]
    _same_state(loaded["state"], saved["state"])


@pytest.mark.timeout(300)
def test_hsdp_on_a_two_dimensional_mesh_matches_torch(tools: list[Outcome]) -> None:
    ours, theirs = _ok(tools, "hsdp/phalanx"), _ok(tools, "hsdp/torch")
    assert ours["placements"] == {"(Replicate(), Shard(dim=0))"} == theirs["placements"]
    assert ours["losses"] == theirs["losses"]
    _same_state(ours["state"], theirs["state"])


@pytest.mark.timeout(300)
def test_check_replicas_says_when_nothing_is_replicated(tools: list[Outcome]) -> None:
    for impl in ("phalanx", "torch"):
        warned = _ok(tools, f"replicas/{impl}")["warned"]
        assert any("sharded over every rank" in w for w in warned), warned


def _hsdp_only(rank: int, world: int) -> dict[str, Any]:
    return run_scenarios(
        {
            f"hsdp/{impl}": functools.partial(_hsdp, impl, rank, world)
            for impl in ("phalanx", "torch")
        },
        rank,
    )


@pytest.mark.slow  # make test-slow: four ranks, 2 replicas x 2 shards
@pytest.mark.timeout(300)
def test_hsdp_two_by_two_matches_torch() -> None:
    outcomes = run_workers(_hsdp_only, 4, timeout=240)
    ours, theirs = _ok(outcomes, "hsdp/phalanx"), _ok(outcomes, "hsdp/torch")
    assert ours["losses"] == theirs["losses"]
    _same_state(ours["state"], theirs["state"])
