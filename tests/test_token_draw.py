"""The token draw both engines share (``rltpu.sampling.common.inverse_cdf``): two levels of cumsum
(block sums, then inside the chosen block) instead of one over the vocabulary."""

import jax.numpy as jnp
import numpy as np

from rltpu.sampling.common import inverse_cdf


def draw(probs, u, block):
    return np.asarray(inverse_cdf(jnp.asarray(probs, jnp.float32), jnp.asarray(u, jnp.float32)[:, None], block))


def test_draws_by_hand_across_blocks_and_a_padded_tail():
    # V = 5 in blocks of 2: [0.1 0.2 | 0.3 0.25 | 0.15 pad]; the target is (1 - u) * total
    p = [0.1, 0.2, 0.3, 0.25, 0.15]
    u = [0.95, 0.85, 0.75, 0.5, 0.35, 0.1, 0.0]  # targets .05 .15 .25 .5 .65 .9 1.0 (cdf .1 .3 .6 .85 1)
    assert draw([p] * len(u), u, block=2).tolist() == [0, 1, 1, 2, 3, 4, 4]
    # one block (block >= V) is the plain cumsum
    assert draw([p] * len(u), u, block=256).tolist() == [0, 1, 1, 2, 3, 4, 4]


def test_a_masked_id_is_never_drawn_even_at_the_edges():
    # zero mass at the end of a block, at the end of the vocabulary, and a whole zero block
    p = [0.3, 0.0, 0.0, 0.0, 0.7, 0.0]
    assert draw([p] * 3, [0.0, 0.69, 0.71], block=2).tolist() == [4, 4, 0]
    rng = np.random.default_rng(0)
    probs = rng.random((4096, 1000)) * (rng.random((4096, 1000)) < 0.05)  # ~95% masked per row
    probs[:, 7] += 1e-3  # no empty row
    probs /= probs.sum(1, keepdims=True)
    u = np.concatenate([np.zeros(64), np.full(64, np.nextafter(np.float32(1), np.float32(0))),
                        rng.random(4096 - 128)])
    tok = draw(probs, u, block=64)
    assert (probs[np.arange(4096), tok] > 0).all()


def test_frequencies_follow_the_distribution_and_match_the_one_level_draw():
    rng = np.random.default_rng(1)
    V, n = 300, 60_000
    p = rng.dirichlet(np.ones(V) * 0.3)
    u = rng.random(n)
    tok = draw(np.tile(p, (n, 1)), u, block=32)
    freq = np.bincount(tok, minlength=V) / n
    # each id within 5 standard errors of its probability
    assert (np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9).all()
    # the one-level draw (a cumsum over the whole vocabulary) picks the same ids up to float rounding
    cdf = np.cumsum(p.astype(np.float32))
    one = np.minimum(np.sum(cdf[None, :] < ((1 - u.astype(np.float32)) * cdf[-1])[:, None], axis=1), V - 1)
    assert np.mean(one == tok) > 0.999
