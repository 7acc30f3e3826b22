"""Training algorithms. Each is a small recipe that turns data (or rollouts) into micro-batches and
per-token loss coefficients; trainer.py owns the one loop that runs them.

A recipe is built from a RunContext and the maker of its generators (None: llama.cpp in this
process) and implements `Recipe`: `next_step()` returns the work of one optimizer step,
`evaluate()` the held-out metrics, `estimate_steps()` the run's length, `state_dict()` /
`load_state_dict()` what a checkpoint needs to continue exactly, and `distributed_gradients`
whether the [distributed] workers may compute its gradients.
"""

from __future__ import annotations

import importlib

from retrograd.algorithms.base import GeneratorFactory, MicroBatch, Recipe, RecipeFactory, StepWork, Tally
from retrograd.errors import ConfigError

#: algorithm -> module and class of its recipe (imported on demand: each pulls in what it needs)
RECIPES = {"sft": "sft:SFT", "grpo": "grpo:GRPO", "ppo": "ppo:PPO", "distill": "distill:Distill",
           "preference": "preference:Preference", "agent_grpo": "agent_grpo:AgentGRPO"}


def recipe_for(name: str) -> RecipeFactory:
    if name not in RECIPES:
        raise ConfigError(f"[run].algorithm = {name!r}: expected one of {', '.join(RECIPES)}")
    module, cls = RECIPES[name].split(":")
    return getattr(importlib.import_module(f"retrograd.algorithms.{module}"), cls)


__all__ = ["GeneratorFactory", "MicroBatch", "Recipe", "RecipeFactory", "StepWork", "Tally", "recipe_for"]
