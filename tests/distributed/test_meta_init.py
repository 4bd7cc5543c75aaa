"""A model built on the meta device, sharded, then given values rank by rank, for real.

Each rank materialises only its shards (zero3/meta_init.py), and the values
must be those of the same model built whole on rank 0: rank 1 seeds its
generator differently to prove it draws rank 0's numbers. Through the
Trainer, a meta-built model must train bit for bit as the same model built
on the CPU, at stage 3 (in memory and disk-offloaded) and at stage 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from torch import Tensor, nn

from phalanx import zero3
from phalanx.train import Trainer
from tests.checkpoints import record_losses
from tests.distributed.test_trainer_zero import _args, _data, _xent
from tests.harness import run_scenarios, run_workers
from tests.unit.test_meta_init import Tied, _Raw

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor  # the parameters' type under stage 3


class _Stack(nn.Module):
    """Repeated blocks (the Trainer's default units) and a root layer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 16)
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        )
        self.head = nn.Linear(16, 3)

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.head(self.blocks(torch.tanh(self.stem(batch[0]))))


def _built(meta: bool, rank: int) -> nn.Module:
    torch.manual_seed(5 if rank == 0 else 1000 + rank)  # only rank 0's seed may count
    if not meta:
        return _Stack()
    with torch.device("meta"):
        return _Stack()


def _lists(state: dict[str, Tensor] | None) -> dict[str, list[Any]] | None:
    return None if state is None else {k: v.tolist() for k, v in state.items()}


def _sharded_init(rank: int, out_dir: str, disk: bool) -> dict[str, Any]:
    policy = zero3.DiskOffloadPolicy(path=f"{out_dir}/offload") if disk else None
    torch.manual_seed(3 if rank == 0 else 77)
    with torch.device("meta"):
        model = Tied()
    for block in (model.conv, model.body):
        zero3.fully_shard(block, offload_policy=policy)
    zero3.fully_shard(model, offload_policy=policy)
    done = zero3.materialize(model)
    in_files = None
    if disk:
        assert isinstance(policy, zero3.DiskOffloadPolicy)
        files = policy.files()  # the one directory the policy owns, which the units filled
        in_files = all(files.holds(cast("DTensor", p)._local_tensor) for p in model.parameters())
    return {
        "full": _lists(zero3.full_state_dict(model, to=0)),
        "largest": done.largest_temporary_bytes,
        "in_files": in_files,
        "tied": model.head.weight is model.embed.weight,
    }


def _train(rank: int, out: Path, meta: bool, **extra: Any) -> dict[str, Any]:
    args = _args(out, max_steps=6, logging_steps=1, save_steps=10_000, **extra)
    trainer = Trainer(model=_built(meta, rank), args=args, train_dataset=_data(), loss_fn=_xent)
    initial = _full(trainer, int(args.zero_stage))
    losses = record_losses(trainer)
    trainer.train()
    result = {"initial": initial, "final": _full(trainer, int(args.zero_stage)), "losses": losses}
    trainer.close()
    return result


def _full(trainer: Trainer, stage: int) -> dict[str, list[Any]] | None:
    if stage == 3:
        return _lists(zero3.full_state_dict(trainer.model, to=0))
    return _lists({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})


def _refused(rank: int, out: Path) -> str:
    with torch.device("meta"):
        model = _Raw()
    try:
        Trainer(model=model, args=_args(out, zero_stage=3), train_dataset=_data(), loss_fn=_xent)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _gpt2(meta: bool) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0
    )
    torch.manual_seed(11)
    if not meta:
        return transformers.GPT2LMHeadModel(config)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf(rank: int, out: Path) -> dict[str, Any]:
    """A transformers model built on meta: its own _init_weights, run unsharded here on
    every rank, must give what each rank's shards hold once the Trainer made them."""
    whole = _gpt2(meta=True)
    zero3.materialize(whole)
    args = _args(out, zero_stage=3, zero3_units=["GPT2Block"], max_steps=3, save_steps=10_000)
    trainer = Trainer(model=_gpt2(meta=True), args=args, train_dataset=_Tokens())
    initial = _lists(zero3.full_state_dict(trainer.model, to=0))
    trainer.train()
    trainer.close()
    expected = {k: v.tolist() for k, v in whole.state_dict().items()}
    return {"equal": None if initial is None else initial == expected, "steps": 3}


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    out = Path(root)
    return run_scenarios(
        {
            "hf": lambda: _hf(rank, out / "hf"),
            "sharded": lambda: _sharded_init(rank, root, disk=False),
            "sharded_disk": lambda: _sharded_init(rank, root, disk=True),
            "stage3_meta": lambda: _train(rank, out / "m3", True, zero_stage=3),
            "stage3_cpu": lambda: _train(rank, out / "c3", False, zero_stage=3),
            "stage3_meta_disk": lambda: _train(
                rank, out / "d3", True, zero_stage=3, zero_offload="disk"
            ),
            "stage3_cpu_disk": lambda: _train(
                rank, out / "cd3", False, zero_stage=3, zero_offload="disk"
            ),
            "stage0_meta": lambda: _train(rank, out / "m0", True, zero_stage=0),
            "stage0_cpu": lambda: _train(rank, out / "c0", False, zero_stage=0),
            "refused": lambda: _refused(rank, out / "r"),
        },
        rank,
    )


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("meta")
    return [o.value for o in run_workers(_scenarios, 2, str(root), timeout=240)]


def _ok(outcomes: list[dict[str, Any]], name: str, rank: int = 0) -> Any:
    value = outcomes[rank][name]
    assert not (isinstance(value, dict) and "error" in value), value
    return value


def test_each_rank_materialises_its_rows_of_rank_0s_whole_model(outcomes: list[Any]) -> None:
    torch.manual_seed(3)
    reference = {k: v.tolist() for k, v in Tied().state_dict().items()}
    for name in ("sharded", "sharded_disk"):
        got = _ok(outcomes, name)
        assert got["full"] == reference, f"{name}: the shards are not rank 0's whole model's rows"
        assert got["tied"], name
        whole = sum(v.numel() * 4 for v in Tied().state_dict().values())
        assert got["largest"] < whole / 3, "more than one module's tensors were made at once"
    assert all(_ok(outcomes, "sharded_disk", r)["in_files"] for r in (0, 1)), "not in files"


@pytest.mark.parametrize(
    ("meta", "cpu"),
    [
        ("stage3_meta", "stage3_cpu"),
        ("stage3_meta_disk", "stage3_cpu_disk"),  # the offloaded step runs fused AdamW
        ("stage0_meta", "stage0_cpu"),
    ],
)
def test_a_meta_built_model_trains_as_the_same_model_built_on_the_cpu(
    outcomes: list[Any], meta: str, cpu: str
) -> None:
    ours, theirs = _ok(outcomes, meta), _ok(outcomes, cpu)
    assert ours["initial"] == theirs["initial"]
    assert ours["losses"] == theirs["losses"] and len(ours["losses"]) == 6
    assert ours["final"] == theirs["final"]


def test_an_uninitialised_meta_tensor_is_refused_on_every_rank(outcomes: list[Any]) -> None:
    for rank in (0, 1):
        message = outcomes[rank]["refused"]
        assert message.startswith("ConfigurationError: parameter 'scale' of _Raw"), message


def test_a_transformers_model_on_meta_gets_its_own_init_in_shards(outcomes: list[Any]) -> None:
    pytest.importorskip("transformers")
    assert _ok(outcomes, "hf")["equal"] is True
