"""Host-side sampling (retrograd/generation/sampling.py) against a plain reference: the nucleus from
a full stable sort of the vocabulary, the log-probability from a float64 log-softmax."""

from __future__ import annotations

import numpy as np
import pytest

from retrograd.generation.sampling import SamplingParams, _nucleus, sample


def reference_nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")       # most probable first, ties by token id
    cum = np.cumsum(probs[order])
    return order[: int(np.searchsorted(cum, top_p)) + 1]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def cases(n: int):
    rng = np.random.default_rng(7)
    for i in range(n):
        vocab = (50, 4000, 49152)[i % 3]
        logits = rng.standard_normal(vocab).astype(np.float32) * rng.choice([0.3, 2.0, 6.0, 15.0])
        if i % 5 == 0:
            logits[rng.choice(vocab, 20, replace=False)] = logits.max()     # ties at the top
        if i % 7 == 0:
            logits = np.round(logits)                                        # ties everywhere
        yield i, logits


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.999999])
def test_nucleus_equals_a_full_stable_sort(top_p):
    for _, logits in cases(60):
        z = log_softmax(logits)
        probs = np.exp(z)
        got = _nucleus(probs, top_p)
        want = reference_nucleus(probs, top_p)
        np.testing.assert_array_equal(got, want)


def test_nucleus_of_a_flat_distribution_is_found_by_lowering_the_threshold():
    probs = np.full(1000, 1e-3)
    probs[0] = 0.5
    probs /= probs.sum()
    np.testing.assert_array_equal(_nucleus(probs, 0.99), reference_nucleus(probs, 0.99))


def test_sampled_token_lies_in_the_nucleus_and_reports_the_untempered_logprob():
    for i, logits in cases(60):
        params = SamplingParams(temperature=(0.7, 1.0, 1.4)[i % 3], top_p=0.9, top_k=(0, 0, 30)[i % 3], seed=i)
        tok, lp = sample(logits, params, np.random.default_rng(i))
        z = log_softmax(logits)
        assert lp == pytest.approx(z[tok], abs=1e-12)
        tempered = logits.astype(np.float64) / params.temperature
        probs = np.exp(tempered - tempered.max())
        if params.top_k:
            probs[probs < np.sort(probs)[-params.top_k]] = 0.0
        probs /= probs.sum()
        assert tok in set(reference_nucleus(probs, 0.9).tolist())


def test_greedy_and_seeded_sampling():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(3000).astype(np.float32) * 3
    tok, lp = sample(logits, SamplingParams(temperature=0.0), np.random.default_rng(1))
    assert tok == int(np.argmax(logits)) and lp == pytest.approx(log_softmax(logits)[tok], abs=1e-12)
    p = SamplingParams(temperature=1.0, top_p=0.95)
    draws = [sample(logits, p, np.random.default_rng(5))[0] for _ in range(3)]
    assert len(set(draws)) == 1                       # the same seed, the same token
    many = {sample(logits, p, np.random.default_rng(s))[0] for s in range(50)}
    assert len(many) > 5                              # and different seeds spread


def test_sampling_frequencies_follow_the_nucleus_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    p = SamplingParams(temperature=1.0, top_p=0.9)     # nucleus: the first three (0.95 >= 0.9)
    rng = np.random.default_rng(3)
    counts = np.bincount([sample(logits, p, rng)[0] for _ in range(6000)], minlength=4)
    assert counts[3] == 0
    np.testing.assert_allclose(counts[:3] / 6000, np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.02)


def test_fast_mode_samples_from_the_same_nucleus(monkeypatch):
    monkeypatch.setenv("RETRO_FAST_TOP_P", "1")
    for i, logits in cases(30):
        tok, lp = sample(logits, SamplingParams(temperature=1.0, top_p=0.9), np.random.default_rng(i))
        z = log_softmax(logits)
        assert lp == pytest.approx(z[tok], abs=1e-4)
        assert tok in set(reference_nucleus(np.exp(z), 0.9 + 1e-4).tolist())


def test_draw_matches_numpy_choice_for_the_same_seed():
    # _draw sums in pieces, so the two can differ where a uniform falls within rounding of a
    # boundary between tokens (about 1e-13 a draw); these 600 draws are nowhere near one
    from retrograd.generation.sampling import _draw
    for s in range(600):
        r = np.random.default_rng(s)
        n = (3, 50, 1024, 1025, 4000, 49152)[s % 6]
        p = r.random(n) ** (1 + s % 7 * 3)
        if s % 4 == 0:
            p[r.random(n) < 0.9] = 0.0              # long runs of zeros, whole pieces of them
            p[r.integers(n)] = 1.0
        want = np.random.default_rng(s + 1).choice(n, p=p / p.sum())
        assert _draw(p, np.random.default_rng(s + 1)) == want        # unnormalized weights
        assert _draw(p / p.sum(), np.random.default_rng(s + 1)) == want


class _Uniform:
    """A generator whose uniform is fixed, for the ends of [0, 1)."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def test_draw_at_the_ends_of_the_uniform_takes_the_first_and_last_tokens_with_weight():
    from retrograd.generation.sampling import _draw
    w = np.zeros(5000)
    w[[7, 1500, 3100]] = [0.2, 0.5, 0.3]
    assert _draw(w, _Uniform(0.0)) == 7
    assert _draw(w, _Uniform(np.nextafter(1.0, 0.0))) == 3100
    assert _draw(w, _Uniform(0.2 + 1e-9)) == 1500
    w = np.zeros(3000)
    w[2999] = 1e-300                                  # a single tiny weight, in the last piece
    assert _draw(w, _Uniform(np.nextafter(1.0, 0.0))) == 2999


def test_draw_frequencies_follow_the_weights():
    from retrograd.generation.sampling import _draw
    w = np.zeros(3000)
    w[[5, 1023, 1024, 2999]] = [1.0, 2.0, 3.0, 4.0]
    rng = np.random.default_rng(11)
    counts = np.bincount([_draw(w, rng) for _ in range(8000)], minlength=3000)
    assert counts.sum() == counts[[5, 1023, 1024, 2999]].sum()
    np.testing.assert_allclose(counts[[5, 1023, 1024, 2999]] / 8000, [0.1, 0.2, 0.3, 0.4], atol=0.02)
