"""The reducer's errors: which parameter, which ranks, and what to do about it.

Built here, raised by the reducer (phalanx.ddp.reducer) on every rank: the
missing-gradient errors come after the ranks exchanged their flags, so each
rank knows who failed.
"""

from __future__ import annotations

from phalanx.errors import ReducerError

_UNUSED_FIX = (
    "pass find_unused_parameters=True to DistributedDataParallel if some parameters are "
    "legitimately unused"
)


def ready_twice(name: str, static_graph: bool) -> ReducerError:
    changed = (
        "; with static_graph=True this means the graph changed since the first iteration"
        if static_graph
        else ""
    )
    return ReducerError(
        f"parameter '{name}' was marked ready twice in one iteration: its gradient arrived "
        "after it had already been reduced (a second backward through the same forward, a "
        "parameter used outside forward(), or one used by several reentrant checkpoints"
        f"{changed}) — run one forward per backward through the DDP model, accumulate with "
        "no_sync(), or pass static_graph=True when the graph is the same every iteration"
    )


def missing_gradients(missing: list[str], failed: list[int]) -> ReducerError:
    """This rank missed gradients: name them (the first 20)."""
    shown = ", ".join(missing[:20]) + (
        f" and {len(missing) - 20} more" if len(missing) > 20 else ""
    )
    return ReducerError(
        f"{len(missing)} parameter(s) received no gradient in this backward (ranks with "
        f"missing gradients: {failed}): {shown} — {_UNUSED_FIX}, or make sure every parameter "
        "contributes to the loss"
    )


def missing_elsewhere(failed: list[int]) -> ReducerError:
    """Another rank missed gradients; its own error names them."""
    return ReducerError(
        f"rank(s) {failed} received no gradient for some parameters in this backward (their "
        f"own error names them) — {_UNUSED_FIX} on some ranks"
    )


def static_graph_too_late() -> ReducerError:
    return ReducerError(
        "_set_static_graph() was called after training started — call it right after "
        "wrapping the model, before the first forward, or pass static_graph=True"
    )


def not_finalized() -> ReducerError:
    return ReducerError(
        "the last synced backward did not finish its gradient reduction — a backward was "
        "interrupted, or ran outside the autograd engine; run forward and backward again "
        "before optimizer.step()"
    )
