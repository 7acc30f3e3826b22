"""Loss recipes as numpy functions: coefficients equal the numerical derivatives of the loss
values, for SFT and every policy-gradient variant; group advantages; reward functions."""

from __future__ import annotations

import numpy as np
import pytest

from retrograd import rewards as rw
from retrograd.losses.nll import nll
from retrograd.losses.pg import VARIANTS, PGBatch, PGConfig, group_advantages, kl_k3, policy_loss


def numeric_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for i in range(len(x)):
        a, b = x.copy(), x.copy()
        a[i] += h
        b[i] -= h
        g[i] = (f(a) - f(b)) / (2 * h)
    return g


def test_sft_coefficients():
    rng = np.random.default_rng(0)
    logp, w = -rng.random(12) * 3, rng.random(12)
    loss, coeff = nll(logp, w, 7.0)
    assert loss == pytest.approx(-(w * logp).sum() / 7.0)
    np.testing.assert_allclose(coeff, numeric_grad(lambda x: nll(x, w, 7.0)[0], logp), rtol=1e-5, atol=1e-7)


def make(seed=0, n_seq=4, beta=0.1, spread=0.4):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 6, n_seq).astype(float)
    seq = np.repeat(np.arange(n_seq), lengths.astype(int))
    old = -rng.random(len(seq)) * 2
    logp = old + rng.normal(0, spread, len(seq))      # ratios inside and outside the clip range
    adv = rng.normal(0, 1, n_seq)[seq]
    ref = old + rng.normal(0, 0.3, len(seq))
    return PGBatch(logp, old, adv, seq, ref), lengths


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_loss_coefficients_match_numerical_derivatives(variant, seed):
    b, lengths = make(seed)
    c = PGConfig(variant, 0.2, 0.28 if variant == "dapo" else 0.2, 0.1, n_seqs=4, n_tokens=int(lengths.sum()),
                 max_new_tokens=8, lengths=lengths)
    loss, coeff, stats = policy_loss(b, c)

    def value(x):
        return policy_loss(PGBatch(x, b.old, b.adv, b.seq, b.ref), c)[0]

    np.testing.assert_allclose(coeff, numeric_grad(value, b.logp.copy()), rtol=1e-4, atol=1e-6)
    assert 0.0 <= stats["clip_frac"] <= 1.0 and stats["kl"] >= 0


def test_first_iteration_is_the_plain_policy_gradient():
    """With old = logp every ratio is 1: the coefficient is -A times the token weight."""
    b, lengths = make(3, beta=0.0)
    b.logp = b.old.copy()
    c = PGConfig("grpo", 0.2, 0.2, 0.0, n_seqs=4, lengths=lengths)
    _, coeff, stats = policy_loss(b, c)
    np.testing.assert_allclose(coeff, -b.adv / (4 * lengths[b.seq]), rtol=1e-6)
    assert stats["clip_frac"] == 0.0


def test_kl_estimator_is_zero_at_the_reference_and_positive_elsewhere():
    lp = np.array([-1.0, -2.0, -0.5])
    kl, d = kl_k3(lp, lp)
    assert np.allclose(kl, 0) and np.allclose(d, 0)
    kl, _ = kl_k3(lp, lp + np.array([0.3, -0.4, 1.0]))
    assert (kl > 0).all()


def test_group_advantages():
    r = np.array([1.0, 0.0, 1.0, 0.0, 2.0, 2.0])
    g = np.array([0, 0, 0, 0, 1, 1])
    a = group_advantages(r, g)
    assert a[:4].mean() == pytest.approx(0) and a[:4].std() == pytest.approx(1, rel=1e-3)
    assert np.all(a[4:] == 0)                                   # a group without signal
    np.testing.assert_allclose(group_advantages(r, g, scale=False)[:4], [0.5, -0.5, 0.5, -0.5])


def test_builtin_rewards(tmp_path):
    rewards = rw.build([{"name": "answer_match", "weight": 1.0}, {"name": "regex", "pattern": r"^\d+$", "weight": 0.5},
                        {"name": "json_valid", "keys": ["a"]}, {"name": "length", "target": 10}], tmp_path, "grpo")
    sc = rw.score(rewards, ["42", "It is 42.", '{"a": 1}', "x" * 20], {"answer": "42"}, 1)
    assert sc.per_fn["answer_match"] == [1.0, 1.0, 0.0, 0.0]
    assert sc.per_fn["regex"] == [1.0, 0.0, 0.0, 0.0]
    assert sc.per_fn["json_valid"] == [0.0, 0.0, 1.0, 0.0]
    assert sc.per_fn["length"] == [0.0, 0.0, 0.0, -1.0]
    assert sc.total[0] == pytest.approx(1.5)
    assert rw.normalise("1,000.") == "1000" and rw.extract(r"so \boxed{7}", "boxed") == "7"


def test_user_reward_function_and_errors(tmp_path):
    (tmp_path / "mine.py").write_text("def score(completion, record, bonus=0.0):\n"
                                      "    if completion == 'boom':\n        raise RuntimeError('kaput')\n"
                                      "    if completion == 'text':\n        return 'high'\n"
                                      "    return len(completion) + bonus\n")
    rewards = rw.build([{"function": "mine.py:score", "bonus": 1.0}], tmp_path, "grpo")
    assert rw.score(rewards, ["abc"], {}, 3).total == [4.0]
    with pytest.raises(rw.RewardError, match="reward 'score' failed on the prompt at line 3.*kaput"):
        rw.score(rewards, ["boom"], {}, 3)
    with pytest.raises(rw.RewardError, match="returned 'high', expected a finite number"):
        rw.score(rewards, ["text"], {}, 3)
    sc = rw.score(rewards, ["boom", "ab"], {}, 3, on_error="zero")
    assert sc.total == [0.0, 3.0] and sc.errors == 1


@pytest.mark.parametrize("spec, message", [
    ({"name": "nope"}, r"\[grpo\].rewards\[0\].name: expected one of"),
    ({"name": "regex", "pattern": "("}, "not a valid regular expression"),
    ({"name": "regex", "flags": 1}, "unknown option 'flags'"),
    ({"function": "missing.py:f"}, "file not found"),
    ({"function": "nocolon"}, "expected 'path/to/file.py:function'"),
    ({"name": "regex", "weight": "1"}, "weight: expected a number"),
])
def test_reward_config_errors(tmp_path, spec, message):
    with pytest.raises(rw.RewardError, match=message):
        rw.build([spec], tmp_path, "grpo")


def test_gae_matches_its_definition():
    from retrograd.algorithms.ppo import gae
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=6), rng.normal(size=6)
    gamma, lam = 0.9, 0.8
    adv, ret = gae(r, v, gamma, lam)
    vn = np.append(v, 0.0)
    delta = r + gamma * vn[1:] - v
    want = np.array([sum((gamma * lam) ** k * delta[t + k] for k in range(6 - t)) for t in range(6)])
    np.testing.assert_allclose(adv, want)
    np.testing.assert_allclose(ret, want + v)


@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_loss_derivatives(seed):
    from retrograd.losses.pg import ppo_loss as ppo_token_loss
    rng = np.random.default_rng(seed)
    n = 10
    old, adv = -rng.random(n), rng.normal(size=n)
    logp = old + rng.normal(0, 0.4, n)
    oldv, ret = rng.normal(size=n), rng.normal(size=n)
    values = oldv + rng.normal(0, 0.4, n)
    args = (0.2, 0.2, 0.5, 17)
    _, d_logp, d_v, _ = ppo_token_loss(logp, old, adv, values, oldv, ret, *args)
    f_lp = lambda x: ppo_token_loss(x, old, adv, values, oldv, ret, *args)[0]   # noqa: E731
    f_v = lambda x: ppo_token_loss(logp, old, adv, x, oldv, ret, *args)[0]      # noqa: E731
    np.testing.assert_allclose(d_logp, numeric_grad(f_lp, logp.copy()), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(d_v, numeric_grad(f_v, values.copy()), rtol=1e-4, atol=1e-6)
