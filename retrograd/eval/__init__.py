"""Measurements on held-out data, shared by the recipes' evaluations and `retrograd bench`:
perplexity (nll), distillation agreement (distill), preference accuracy (pairs) and reward
distributions of sampled answers (rewards). Nothing here trains."""
