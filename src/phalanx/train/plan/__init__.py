"""The memory planner: which stage, offload and micro-batch fit a budget, and which of
those is fastest (docs/planner.md). `phalanx plan` and `zero_stage="auto"` ask it.

count.py counts what a model allocates on the meta device; probe.py measures
this machine; predict.py turns both into each configuration's peak memory by
part and its step time; choose.py picks; render.py prints; auto.py resolves the
Trainer's "auto" arguments; budget.py finds the budget when none is given.
"""

from __future__ import annotations

from phalanx.train.plan.budget import detect_budget, parse_size
from phalanx.train.plan.choose import Candidate, Choice, NothingFits, choose
from phalanx.train.plan.count import ModelCount, count_model
from phalanx.train.plan.predict import Config, Parts, predict_memory, predict_step_s
from phalanx.train.plan.probe import Rates, measure_rates
from phalanx.train.plan.render import render

__all__ = [
    "Candidate",
    "Choice",
    "Config",
    "ModelCount",
    "NothingFits",
    "Parts",
    "Rates",
    "choose",
    "count_model",
    "detect_budget",
    "measure_rates",
    "parse_size",
    "predict_memory",
    "predict_step_s",
    "render",
]
