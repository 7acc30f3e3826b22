"""The shapes every recipe shares: a micro-batch with its loss, the work of one optimizer step,
the step's metrics (Tally), the Recipe protocol the trainer drives and what a recipe is built from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from retrograd.batch import Batch, CoeffFn, LossInputs, LossOutputs, Tally  # noqa: F401 - Tally re-exported
from retrograd.context import RunContext
from retrograd.data.batching import ExampleStream

#: what makes a recipe's generators, with Generator's signature: llama.cpp in this process when the
#: trainer gives None, or with [distributed].rollouts sampling on the Ray workers (Cluster.generator)
GeneratorFactory = Callable[..., Any]


@dataclass
class MicroBatch:
    """One engine call: a packed batch and the loss over its targets' log-probs.

    loss(inputs, tally) returns the coefficients d(loss)/d(logp) (and optionally d(loss)/d(hidden))
    and records what it wants logged in the step's tally."""

    batch: Batch
    loss: Callable[[LossInputs, Tally], LossOutputs]
    want_entropy: bool = False
    want_hidden: bool = False

    def coefficients(self, tally: Tally) -> CoeffFn:
        """The function the engine calls with the targets' log-probs: loss, recording in `tally`."""
        return lambda inp: self.loss(inp, tally)


@dataclass
class StepWork:
    """What one optimizer step trains on."""

    micro: list[MicroBatch]
    n_tokens: int                                   # tokens processed (for throughput)
    info: dict = field(default_factory=dict)        # logged as is (rollout statistics, timings)
    after_update: Callable[[], None] | None = None  # runs once the adapter's update is applied
    # seconds the generator took to take the adapter before this step's rollout (0.0: the step reuses
    # an earlier rollout; None: the recipe samples nothing); the rollout's gen_s includes them
    swap_s: float | None = None
    # receives what the losses kept (Tally.keep) once the step's gradients are in: a loss may run in
    # another process (distributed training), so it hands values back instead of writing to the recipe
    on_kept: Callable[[dict], None] | None = None


def micro_seed(cfg, at: dict, i: int, *stream: int) -> np.random.SeedSequence:
    """The seed of micro-batch i's random draws (NEFTune's noise, dropout's masks; `stream` keeps
    them apart): the run seed, where the step starts in the data (`at`, the stream cursor) and the
    index, so a resumed run draws what the uninterrupted one drew."""
    return np.random.SeedSequence([cfg.run.seed, *(int(v) for v in at.values()), i, *stream])


def train_batch(batch: Batch, cfg, at: dict, i: int) -> Batch:
    """A training micro-batch with [lora].dropout's probability and its masks' seed (micro_seed).
    Evaluation batches never get them."""
    if cfg.lora.dropout > 0:
        batch.lora_dropout = cfg.lora.dropout
        batch.dropout_seed = int(micro_seed(cfg, at, i, 1).generate_state(1, np.uint64)[0])
    return batch


class Recipe(Protocol):
    """What the trainer drives. The recipes inherit it (DataRecipe, RolloutRecipe) for its default."""

    #: whether the step's gradients may be computed on the [distributed] workers; False keeps them in
    #: this process (PPO: its loss also trains a value head of its own, here)
    distributed_gradients: bool = True

    def next_step(self) -> StepWork: ...
    def estimate_steps(self) -> int: ...
    def evaluate(self) -> dict[str, float]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...


#: a recipe's class: built from the run and the maker of its generators (ignored by those that sample nothing)
RecipeFactory = Callable[[RunContext, GeneratorFactory | None], Recipe]


class DataRecipe(Recipe):
    """What the recipes that walk a data set (sft, distill, preference) share: their state is the
    position in the stream of examples, they sample nothing (no generator: the trainer's
    `generators` goes unused) and they hold nothing to release (subclasses that do override close)."""

    stream: ExampleStream

    def state_dict(self) -> dict:
        return {"cursor": self.stream.cursor.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.seek(state.get("cursor", {}))

    def close(self) -> None:
        pass
