"""The shapes every recipe shares: a micro-batch with its loss, the work of one optimizer step,
the step's metrics (Tally) and the Recipe protocol the trainer drives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from retrograd.batch import Batch, LossInputs, LossOutputs
from retrograd.data.batching import ExampleStream

if TYPE_CHECKING:
    pass


class Tally:
    """The metrics of one optimizer step, gathered over its micro-batches: sums (a loss already
    divided by the step's normaliser adds up to the step's loss) and weighted means (a per-token
    statistic: the total over the micro-batch's tokens and how many there were)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weighted: dict[str, list[float]] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def mean(self, key: str, total: float, count: float) -> None:
        acc = self.weighted.setdefault(key, [0.0, 0.0])
        acc[0] += float(total)
        acc[1] += float(count)

    def result(self) -> dict[str, float]:
        out = dict(self.sums)
        for k, (total, count) in self.weighted.items():
            out[k] = total / count if count else 0.0
        return out


@dataclass
class MicroBatch:
    """One engine call: a packed batch and the loss over its targets' log-probs.

    loss(inputs, tally) returns the coefficients d(loss)/d(logp) (and optionally d(loss)/d(hidden))
    and records what it wants logged in the step's tally."""

    batch: Batch
    loss: Callable[[LossInputs, Tally], LossOutputs]
    want_entropy: bool = False
    want_hidden: bool = False


@dataclass
class StepWork:
    """What one optimizer step trains on."""

    micro: list[MicroBatch]
    n_tokens: int                                   # tokens processed (for throughput)
    info: dict = field(default_factory=dict)        # logged as is (rollout statistics, timings)
    after_update: Callable[[], None] | None = None  # runs once the adapter's update is applied


class Recipe(Protocol):
    def next_step(self) -> StepWork: ...
    def estimate_steps(self) -> int: ...
    def evaluate(self) -> dict[str, float]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...


class DataRecipe:
    """What the recipes that walk a data set (sft, distill, preference) share: their state is the
    position in the stream of examples, and they hold nothing to release (subclasses that do
    override close)."""

    stream: ExampleStream

    def state_dict(self) -> dict:
        return {"cursor": self.stream.cursor.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.seek(state.get("cursor", {}))

    def close(self) -> None:
        pass
