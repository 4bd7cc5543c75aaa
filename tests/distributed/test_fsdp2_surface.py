"""FSDPModule's surface beyond the basics trains as torch's FSDP2 does (docs/fsdp2.md's table).

Real gloo ranks. Each case trains the same torchtitan-shaped model (blocks as
units, then `fully_shard([model.norm, model.lm_head])`, then the root) on the
same seeds through phalanx's fully_shard and torch's, and holds losses, clip
norms, which gradients are None, and the final parameters to 1e-6 (bit for
bit in fact; the force-sum cases are held to exactly 0, since dividing before
the sum instead of after moves the last bit):

- titan: torchtitan's line, `reshard_after_forward=False`, both modules every
  forward; and with bf16 compute, fp32 reduction and accumulation (its recipe);
- reshard: the group resharded after forward and gathered again in backward;
- skips_head: odd steps run only the norm, so the head gets no gradient (FSDP2
  leaves it None, Adam skips it); unused: the same with
  `set_reduce_scatter_unused_params(True)` (the head gets the reduced zeros);
- chunked: the root's forward runs only the norm and the head is called per
  chunk after it (chunked loss), its group resharded after forward or not;
  chunked-each: one backward per chunk through the head alone, then one through
  the trunk (each head backward ends with its own reduction, as in FSDP2);
- force_sum: `set_force_sum_reduction_for_comms` with a divide factor of 3;
  hsdp_force_sum: force-sum on a (2, 1) mesh with `set_requires_all_reduce(False)`
  on the first micro-batch (reduced rows kept, summed, all-reduced at the last,
  then divided);
- knobs: set_reshard_after_forward on the root, set_reshard_after_backward
  and set_is_last_backward around accumulation, set_reduce_scatter_divide_factor,
  set_reduce_scatter_max_input_buffers(2), set_separate_reduce_scatter_group;
- knobs also sets a post-optimizer event each step (set_post_optim_event);
- to_between: `fully_shard(block); block.to("cpu"); fully_shard(model)` (a
  `.to()` swaps a DTensor parameter's contents, and the unit still knows it);
- ignored: the embedding in `ignored_params` (left whole, its gradient not reduced:
  each rank steps its own);
- hook: `set_all_reduce_hook` halving the reduced rows of every unit;
- embed_not_gathered: the embedding as a unit of its own with
  `set_unshard_in_backward(False)` (its backward gathers nothing);
- tied: the head's weight is the embedding's, and `fully_shard([model.embed,
  model.lm_head])` holds it (FSDP2's advice for tied weights): the group's
  forward spans the whole model, the first module to the last.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import phalanx
from tests.distributed.models import ce_loss, token_batch
from tests.distributed.test_zero3 import Block
from tests.harness import Outcome, run_scenarios, run_workers

STEPS, MICRO = 6, 2


class TitanLike(nn.Module):
    """Embedding, blocks, then a final norm and an untied output head (torchtitan's llama)."""

    vocab = 24

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, self.vocab, bias=False)

    def forward(self, tokens: Tensor, head: bool = True) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        h = self.norm(x)
        return self.lm_head(h) if head else h


CASES: dict[str, dict[str, Any]] = {
    "titan": {},
    "titan-bf16-accumulate": {"bf16": True, "accumulate": True},
    "reshard": {"reshard": True},
    "skips_head": {"skip": True},
    "unused": {"skip": True, "unused": True},
    "chunked": {"chunked": True},
    "chunked-reshard": {"reshard": True, "chunked": True},
    "chunked-each": {"chunked": True, "each": True},
    "force_sum": {"force_sum": True},
    "hsdp_force_sum": {"hsdp": True, "force_sum": True},
    "knobs": {"knobs": True, "accumulate": True},
    "to_between": {"to_between": True},
    "ignored": {"ignored": True},
    "tied": {"tied": True},
    "hook": {"hook": True},
    "embed_not_gathered": {"embed_unit": True},
}
EXACT = ("force_sum", "hsdp_force_sum")


def _api(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.fsdp as api

        return api
    return phalanx


def _mesh(opts: dict[str, Any], world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if opts.get("hsdp"):
        return init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    return None


def _shard(net: TitanLike, impl: str, opts: dict[str, Any], world: int) -> Any:
    api = _api(impl)
    kwargs: dict[str, Any] = {"mesh": _mesh(opts, world)}
    if opts.get("bf16"):
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    if opts.get("embed_unit"):
        api.fully_shard(net.embed, **kwargs)
    for block in net.blocks:
        api.fully_shard(block, **kwargs)
    if opts.get("to_between"):
        net.blocks[0].to("cpu")
    if not opts.get("to_between"):  # (that case holds the .to() alone: no group)
        reshard = opts.get("reshard", False)
        members = [net.embed, net.lm_head] if opts.get("tied") else [net.norm, net.lm_head]
        group = api.fully_shard(members, reshard_after_forward=reshard, **kwargs)
        assert isinstance(group, list) and all(isinstance(m, api.FSDPModule) for m in group)
    ignored = {net.embed.weight} if opts.get("ignored") else None
    api.fully_shard(net, ignored_params=ignored, **kwargs)
    _settings(net, opts)
    return net


def _settings(net: Any, opts: dict[str, Any]) -> None:
    if opts.get("force_sum"):
        for module in [*net.blocks, net.norm, net]:
            # Not on the (2, 1) mesh: with one rank per shard group torch divides its input
            # by the factor and the sum again (FSDP2's world-size-1 copy), phalanx once.
            if not opts.get("hsdp"):
                module.set_gradient_divide_factor(3.0)
            module.set_force_sum_reduction_for_comms(True)
    if opts.get("unused"):
        net.set_reduce_scatter_unused_params(True)
    if opts.get("hook"):  # on the reduced rows, before they become the sharded gradients
        for module in [*net.blocks, net.norm, net]:
            module.set_all_reduce_hook(lambda reduced: reduced.mul_(0.5))
    if opts.get("embed_unit"):  # an embedding's backward needs no weight values
        net.embed.set_unshard_in_backward(False)
    if opts.get("knobs"):
        net.set_reshard_after_forward(True, recurse=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch: use the new name
            net.blocks[1].set_reduce_scatter_divide_factor(2.0)  # not 3: gloo has no PREMUL_SUM
        net.set_reduce_scatter_max_input_buffers(2)
        net.set_separate_reduce_scatter_group()


def _loss(net: Any, x: Tensor, y: Tensor, step: int, opts: dict[str, Any]) -> Tensor:
    """The loss, its backward still to run (or, "each", run already: one per chunk)."""
    if opts.get("skip") and step % 2:
        return net(x, head=False).float().pow(2).mean()  # the head is not run at all
    if not opts.get("chunked"):
        return ce_loss(net(x), y)
    h = net(x, head=False)
    half = h.shape[1] // 2
    chunks = (slice(0, half), slice(half, None))
    if not opts.get("each"):
        return sum((ce_loss(net.lm_head(h[:, s]), y[:, s]) for s in chunks), torch.zeros(()))
    # One backward per chunk through the head alone, then one through the trunk.
    cut = h.detach().requires_grad_()
    total = torch.zeros(())
    for s in chunks:
        loss = ce_loss(net.lm_head(cut[:, s]), y[:, s]) / MICRO
        loss.backward()
        total = total + loss.detach()
    h.backward(cut.grad)
    return total


def _micro_settings(net: Any, micro: int, opts: dict[str, Any]) -> None:
    last = micro == MICRO - 1
    if opts.get("accumulate"):
        net.set_requires_gradient_sync(last)
    if opts.get("hsdp"):
        net.set_requires_all_reduce(last)
    if opts.get("knobs"):
        net.set_reshard_after_backward(last)
        net.set_is_last_backward(last)


def train(case: str, impl: str, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    opts = CASES[case]
    torch.manual_seed(7)
    net = TitanLike()
    if opts.get("tied"):
        net.lm_head.weight = net.embed.weight
    net = _shard(net, impl, opts, world)
    opt = torch.optim.Adam(net.parameters(), lr=0.01, eps=1e-4)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            _micro_settings(net, micro, opts)
            x, y = token_batch(rank, step, micro)
            if opts.get("each"):
                losses.append(float(_loss(net, x, y, step, opts)))
                continue
            loss = _loss(net, x, y, step, opts) / MICRO
            loss.backward()
            losses.append(float(loss.detach()))
        head_grad = net.lm_head.weight.grad
        sharded = [p for p in net.parameters() if isinstance(p, DTensor)]  # not the ignored
        norm: Any = torch.nn.utils.clip_grad_norm_(sharded, 0.5)  # a DTensor
        norms.append(float(norm.full_tensor()))
        norms.append(float("nan") if head_grad is None else 0.0)  # None, as FSDP2 leaves it
        opt.step()
        opt.zero_grad()
        if opts.get("knobs"):
            net.set_post_optim_event(torch.Event(device="cpu"))  # (no record on the CPU)
    state = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    whole = {k: v.tolist() for k, v in state.items() if isinstance(v, torch.Tensor)}
    result = {"losses": losses, "norms": norms, "state": whole}
    if impl == "phalanx" and opts.get("embed_unit"):  # a gather per forward, none in backward
        embed = phalanx.zero3.communication(net.embed).collectives
        assert embed == STEPS * MICRO * 2, f"{embed} collectives: one gather, one reduction each"
    return result


def _gap(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    def apart(x: float, y: float) -> float:
        return 0.0 if x != x and y != y else abs(x - y)  # NaN marks a None gradient

    return {
        "loss": max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)),
        "norm": max(apart(x, y) for x, y in zip(a["norms"], b["norms"], strict=True)),
        "param": max(
            float((torch.tensor(a["state"][k]) - torch.tensor(b["state"][k])).abs().max())
            for k in b["state"]
        ),
        "keys_differ": float(set(a["state"]) != set(b["state"])),
    }


def _compare(case: str, rank: int, world: int) -> dict[str, float]:
    return _gap(train(case, "phalanx", rank, world), train(case, "torch", rank, world))


def _refused(rank: int) -> dict[str, str]:
    """Each method and argument phalanx refuses: one line naming itself, no collective."""
    from torch.distributed.fsdp import DataParallelMeshDims

    unit: Any = phalanx.fully_shard(nn.Linear(4, 4))
    group: Any = phalanx.fully_shard([nn.Linear(4, 4), nn.Linear(4, 4)])
    calls = {
        "fully_shard group": lambda: group[0](torch.ones(2, 4)),  # a group as the root
        "set_custom_all_gather": lambda: unit.set_custom_all_gather(None),
        "set_custom_reduce_scatter": lambda: unit.set_custom_reduce_scatter(None),
        "set_allocate_memory_from_process_group_for_comm": (
            lambda: unit.set_allocate_memory_from_process_group_for_comm(True)
        ),
        "set_symm_mem_for_comm": lambda: unit.set_symm_mem_for_comm(),
        "dp_mesh_dims": lambda: phalanx.fully_shard(
            nn.Linear(4, 4), dp_mesh_dims=DataParallelMeshDims(shard="dp")
        ),
        "set_reduce_scatter_max_input_buffers": (
            lambda: unit.set_reduce_scatter_max_input_buffers(0)
        ),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = "accepted"
        except phalanx.errors.PhalanxError as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
    phalanx.fully_shard(nn.Linear(4, 4), dp_mesh_dims=None)  # torchtitan passes None
    return messages


def _all(rank: int, world: int, cases: list[str]) -> dict[str, Any]:
    scenarios: dict[str, Any] = {c: functools.partial(_compare, c, rank, world) for c in cases}
    scenarios["refused"] = functools.partial(_refused, rank)
    return run_scenarios(scenarios, rank)


@pytest.fixture(scope="module")
def parity() -> list[Outcome]:
    return run_workers(_all, 2, list(CASES), timeout=240)


def _ok(outcomes: list[Outcome], key: str) -> dict[str, Any]:
    for o in outcomes:
        assert "error" not in o.value[key], f"rank {o.rank}:\n{o.value[key].get('error')}"
    value: dict[str, Any] = outcomes[0].value[key]
    return value


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_the_surface_trains_as_torch_fsdp2(parity: list[Outcome], case: str) -> None:
    gap = _ok(parity, case)
    assert gap["keys_differ"] == 0, gap
    bound = 0.0 if case in EXACT else 1e-6
    assert gap["loss"] <= bound and gap["norm"] <= bound and gap["param"] <= bound, gap


@pytest.mark.timeout(300)
def test_what_phalanx_refuses_is_one_line_naming_itself(parity: list[Outcome]) -> None:
    messages = _ok(parity, "refused")
    assert messages == _ok(parity[1:], "refused")  # the same on every rank
    for name, message in messages.items():
        assert message.startswith(("NotSupportedError", "ConfigurationError")), (name, message)
        assert name in message and "\n" not in message and " — " in message, message
    assert "torch.distributed.fsdp.fully_shard" in messages["dp_mesh_dims"]
