"""The losses, as numpy functions over per-token log-probs: each returns its value and the
coefficients d(loss)/d(logp) that the engine backpropagates (and, where a loss has them, per-item
values for evaluation). They know nothing of models or files, so the tests check each one
against numerical derivatives, and both the recipes (algorithms/) and the measurements (eval/)
share them.
"""
