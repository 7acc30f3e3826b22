"""Training algorithms. Each is a small recipe that turns data (or rollouts) into micro-batches and
per-token loss coefficients; trainer.py owns the one loop that runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from retrograd.native import Batch, LossInputs, LossOutputs


@dataclass
class MicroBatch:
    """One engine call: a packed batch and the loss over its targets' log-probs.

    loss(inputs) returns the coefficients d(loss)/d(logp) and a dict of additive metrics
    (e.g. the summed loss) for logging.
    """

    batch: Batch
    loss: Callable[[LossInputs], tuple[LossOutputs, dict]]
    want_entropy: bool = False
    want_hidden: bool = False


@dataclass
class StepWork:
    micro: list[MicroBatch]
    n_tokens: int                         # tokens processed (for throughput)
    info: dict = field(default_factory=dict)
    finalize: Callable[[dict], dict] | None = None   # summed loss metrics -> what is logged


class Recipe(Protocol):
    def next_step(self) -> StepWork: ...
    def estimate_steps(self) -> int: ...
    def evaluate(self) -> dict[str, float]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def recipe_for(name: str):
    if name == "sft":
        from retrograd.algorithms.sft import SFT
        return SFT
    if name == "grpo":
        from retrograd.algorithms.grpo import GRPO
        return GRPO
    if name == "ppo":
        from retrograd.algorithms.ppo import PPO
        return PPO
    if name == "distill":
        from retrograd.algorithms.distill import Distill
        return Distill
    if name == "preference":
        from retrograd.algorithms.preference import Preference
        return Preference
    raise ValueError(f"algorithm {name!r} is not built yet")
