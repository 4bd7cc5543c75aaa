"""plan_grid.py's models, candidate space, budgets and tables (the driver stays short)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

HEADROOM = 0.05


class GPTLM(nn.Module):
    """benchmarks/models.GPT taking the Trainer's batch (inputs, targets)."""

    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        import models

        self.gpt = models.GPT(vocab, seq, d, heads, layers)

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.gpt(batch[0])
        return out


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    data: Callable[[], Any]
    loss: Callable[[torch.Tensor, Any], torch.Tensor]
    global_batch: int
    micros: tuple[int, ...]


def _mlp(layers: int, width: int) -> Spec:
    import models

    def data() -> Any:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, width, generator=g)
        return torch.utils.data.TensorDataset(x, torch.randn(256, width, generator=g))

    return Spec(
        build=lambda: models.TanhMLP(layers, width),
        data=data,
        loss=lambda out, batch: nn.functional.mse_loss(out, batch[1]),
        global_batch=16,
        micros=(8,),
    )


def _gpt(vocab: int, seq: int, d: int, heads: int, layers: int) -> Spec:
    def data() -> Any:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab, (256, seq + 1), generator=g)
        return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), batch[1].flatten())

    return Spec(
        build=lambda: GPTLM(vocab, seq, d, heads, layers),
        data=data,
        loss=loss,
        global_batch=16,
        micros=(8, 2),
    )


MODELS: dict[str, Spec] = {
    "gpt-s": _gpt(8192, 64, 512, 8, 6),  # 27M parameters, 0.44 GB of training state
    "mlp-m": _mlp(16, 2048),  # 67M, 1.07 GB
    "mlp-l": _mlp(60, 2048),  # 252M, 4.03 GB
    "mlp-t": _mlp(4, 256),  # a smoke test of the script (--models mlp-t)
}
GRID = ("gpt-s", "mlp-m", "mlp-l")
TIERS = [
    (0, "none", 0.0),
    (1, "none", 0.0),
    (2, "none", 0.0),
    (3, "none", 0.0),
    (1, "disk", 1.0),
    (3, "disk", 0.25),
    (3, "disk", 0.5),
    (3, "disk", 0.75),
    (3, "disk", 1.0),
]


def candidates(name: str) -> list[Any]:
    """The planner's space for this model in the grid (every one of them is run)."""
    from phalanx.train.plan import Config

    spec = MODELS[name]
    per_rank = spec.global_batch // 2
    return [
        Config(stage, tier, fraction, m, per_rank // m)  # type: ignore[arg-type]
        for stage, tier, fraction in TIERS
        for m in spec.micros
    ]


def key(config: Any) -> str:
    where = "mem" if config.offload == "none" else f"disk{config.fraction:g}"
    return f"s{config.stage}-{where}-m{config.micro_batch}x{config.accumulation}"


def micro_step(name: str) -> Callable[[nn.Module, int], torch.Tensor]:
    """The Trainer's micro-step on this model's data (phalanx.train.plan.auto's)."""
    from phalanx.train.plan.auto import trainer_micro_step

    spec = MODELS[name]
    return trainer_micro_step(spec.data(), None, spec.loss)


def count(name: str) -> Any:
    from phalanx.train.plan import count_model

    spec = MODELS[name]
    with torch.device("meta"):
        model = spec.build()
    return count_model(model, micro_step(name), lambda ps: torch.optim.AdamW(ps, lr=1e-4))


def count_json(c: Any) -> dict[str, Any]:
    return {
        k: v if not isinstance(v, tuple) or len(v) < 8 else f"{len(v)} entries"
        for k, v in dataclasses.asdict(c).items()
    }


def worker_config(name: str, config: Any, steps: int) -> dict[str, Any]:
    """What plan_grid_worker.py runs: a model and a configuration (None: the Trainer's)."""
    out: dict[str, Any] = {"model": name, "steps": steps}
    if config is not None:
        out |= {
            "stage": config.stage,
            "offload": None if config.offload == "none" else config.offload,
            "fraction": config.fraction if config.offload == "disk" else 1.0,
            "window_mb": config.window_mb,
            "micro": config.micro_batch,
            "accumulation": config.accumulation,
        }
    else:
        per_rank = MODELS[name].global_batch // 2
        out |= {"micro": per_rank, "accumulation": 1}
    return out


def _predicted(name: str, c: Any, rates: Any, configs: list[Any]) -> list[float]:
    from phalanx.train.plan import predict_memory

    return sorted(predict_memory(x, c, 2, rates).total / 2**20 for x in configs)


def budgets(name: str, c: Any, rates: Any, configs: list[Any], n: int) -> list[float]:
    """`n` budgets (MB) from roomy (everything fits) down, geometrically, to the smallest
    that fits; down to 8x below the whole training state where that fits."""
    totals = _predicted(name, c, rates, configs)
    roomy = totals[-1] / (1 - HEADROOM) * 1.15
    smallest = totals[0] / (1 - HEADROOM) * 1.02
    state = (4 + 4 + 4 * c.state_per_param_byte) * c.params / 2**20
    lowest = state / 8 if state / 8 >= smallest else smallest
    ratio = (lowest / roomy) ** (1 / max(1, n - 1))
    return [round(roomy * ratio**i) for i in range(n)]


def killing_cap(name: str, c: Any, rates: Any) -> float:
    """A cap that stage 0 does not fit (0.6 of its predicted peak) but stage 3 does."""
    from phalanx.train.plan import Config, predict_memory

    spec = MODELS[name]
    stage0 = Config(0, "none", 0.0, spec.global_batch // 2, 1)
    return round(0.6 * predict_memory(stage0, c, 2, rates).total / 2**20)


def cell(
    budget_mb: float, choice: Any, measured: dict[str, Any], capped: dict[str, Any]
) -> dict[str, Any]:
    chosen = key(choice.chosen.config)
    mine = measured[chosen]
    fitting = {
        k: m for k, m in measured.items() if m.get("trained") and m["peak_rss_mb"] <= budget_mb
    }
    fastest = min(fitting, key=lambda k: fitting[k]["step_s"]) if fitting else None
    predicted = choice.chosen.memory.total / 2**20
    return {
        "budget_mb": budget_mb,
        "chosen": chosen,
        "predicted_peak_mb": predicted,
        "measured_peak_mb": mine.get("peak_rss_mb"),
        "error": predicted / mine["peak_rss_mb"] - 1 if mine.get("trained") else None,
        "predicted_step_s": choice.chosen.step_s,
        "measured_step_s": mine.get("step_s"),
        "fastest_fitting": fastest,
        "over_fastest": mine["step_s"] / fitting[fastest]["step_s"] if fastest else None,
        "capped": {k: capped.get(k) for k in ("trained", "killed", "peak_rss_mb", "step_s")}
        | {"cgroup_peak_mb": max(r["cgroup_peak_mb"] for r in capped["ranks"])},
        "capped_run": capped,
    }


def tables(report: dict[str, Any]) -> str:
    lines = [
        "| model | budget MB | chosen | predicted peak MB | measured peak MB | error "
        "| capped run | step s | fastest that fits | chosen ÷ fastest |",
        "|---|---:|---|---:|---:|---:|---|---:|---|---:|",
    ]
    for name, entry in report["models"].items():
        for c in entry["cells"]:
            if "nothing_fits" in c:
                lines.append(f"| {name} | {c['budget_mb']:.0f} | {c['nothing_fits']} |||||||")
                continue
            capped = (
                "trained"
                if c["capped"]["trained"]
                else ("killed" if c["capped"]["killed"] else "failed")
            )
            err = c["error"]
            lines.append(
                f"| {name} | {c['budget_mb']:.0f} | {c['chosen']} | {c['predicted_peak_mb']:.0f} "
                f"| {c['measured_peak_mb'] or math.nan:.0f} | "
                f"{'' if err is None else f'{err:+.1%}'} | {capped} | "
                f"{c['measured_step_s'] or math.nan:.2f} | {c['fastest_fitting']} | "
                f"{c['over_fastest'] or math.nan:.2f} |"
            )
    return "\n".join(lines)
