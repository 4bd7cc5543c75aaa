"""static_graph: how many gradients each parameter receives in one backward, learnt once.

A parameter used by several reentrant checkpoints (torch's recipe: the same
layer checkpointed in two segments) gets one gradient per segment: each nested
backward accumulates into `.grad` and fires the hook. Without knowing the
count, the reducer would take the first one as the whole gradient. With
`static_graph=True` the graph is the same every iteration, so, as torch's DDP
does, the first synced backward only counts the hooks and reduces every bucket
at its end; from then on a parameter is ready at its last expected gradient.
Parameters counted zero times are the static set of unused parameters.
"""

from __future__ import annotations

from phalanx.errors import ReducerError

# Counts live in a bytearray (the hook path indexes it): more gradients than
# this for one parameter in one backward is refused rather than wrapped around.
MAX_GRADIENTS_PER_BACKWARD = 255


class GradientCounts:
    """Expected gradients per parameter: 1 each, or what static_graph's first backward saw."""

    def __init__(self, names: list[str], static_graph: bool) -> None:
        self.names = names
        self.recording = static_graph
        """True until static_graph's counting backward has ended."""
        self.expected = bytearray(b"\x01") * len(names)
        """Per parameter, how many gradients make it ready (0-gradient ones are marked
        ready by the unused-parameter path, which counts as one)."""
        self._seen = [0] * len(names)

    def start_recording(self) -> None:
        """`_set_static_graph()` on a wrapper built without static_graph."""
        self.recording = True

    def count(self, i: int) -> None:
        self._seen[i] += 1

    def seen(self, i: int) -> int:
        return self._seen[i]

    def finish(self) -> list[int]:
        """End of the counting backward: fix the expected counts; return the unused indices."""
        self.recording = False
        unused = [i for i, n in enumerate(self._seen) if n == 0]
        too_many = [i for i, n in enumerate(self._seen) if n > MAX_GRADIENTS_PER_BACKWARD]
        if too_many:
            i = too_many[0]
            raise ReducerError(
                f"parameter '{self.names[i]}' received {self._seen[i]} gradients in one "
                f"backward, more than the {MAX_GRADIENTS_PER_BACKWARD} static_graph=True "
                "supports — checkpoint it in fewer segments, or drop static_graph"
            )
        self.expected = bytearray(max(1, n) for n in self._seen)
        return unused
