"""Chunked per-token logprobs and entropy (``learner.losses.token_logprobs_entropy``, issue 16 point 4):
the same values and gradients as the whole-sequence computation, and what backward keeps is bounded
by the chunk, not by tokens x vocabulary.

The memory figure: ``python benchmarks/logprob_memory.py`` (peak RSS of one logprob + entropy
forward/backward at Qwen's 151,936 vocabulary and 4,096 tokens, whole vs chunked, fresh process each).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # as the CLI: no torch_tpu probe on a CPU box

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from learner.losses import token_entropy, token_logprobs, token_logprobs_entropy  # noqa: E402
from learner.trainer import TrainerEngine  # noqa: E402

torch.set_num_threads(1)


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The unchunked computation as it was before chunking (two full log-softmaxes)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def _grads(fn, *inputs):
    """Values and d(sum(a * logp) + sum(b * entropy))/d inputs, with fixed random a, b."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    lp, ent = fn(*xs)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(lp.shape, generator=g), torch.randn(ent.shape, generator=g)
    ((lp * a).sum() + (ent * b).sum()).backward()
    return lp.detach(), ent.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("chunk", [1, 7, 50, 111, 0])
def test_chunked_logits_equal_unchunked_values_and_grads(chunk):
    """(3, 37) tokens at a 32,003 vocabulary: chunks of 1, 7 (odd boundaries inside rows), 50 (a
    chunk straddling rows, a short last chunk), 111 = all tokens, 0 = off."""
    torch.manual_seed(0)
    B, T, V = 3, 37, 32_003
    logits = torch.randn(B, T, V) * 3
    targets = torch.randint(0, V, (B, T))
    want_lp, want_ent, (want_g,) = _grads(lambda x: _reference(x, targets, 0.7), logits)
    lp, ent, (g,) = _grads(lambda x: token_logprobs_entropy(x, targets, 0.7, True, chunk), logits)
    assert want_g.abs().max() > 0
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-6)
    torch.testing.assert_close(g, want_g, rtol=0, atol=1e-6)
    # the thin wrappers take the same knob
    torch.testing.assert_close(token_logprobs(logits, targets, 0.7, chunk), want_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(token_entropy(logits, 0.7, chunk), want_ent, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk", [13, 64])
def test_chunked_head_equals_full_logits_values_and_grads(chunk):
    """With the LM head fused in (hidden states + weight, the trainer's path), logprobs, entropies and
    the gradients of the hidden states and of the head's weight equal the full-logits computation."""
    torch.manual_seed(0)
    B, T, H, V = 2, 45, 32, 32_000
    hidden = torch.randn(B, T, H)
    weight = torch.randn(V, H) * 0.3
    targets = torch.randint(0, V, (B, T))
    want_lp, want_ent, want_g = _grads(
        lambda h, w: _reference(torch.nn.functional.linear(h, w), targets, 1.0), hidden, weight)
    lp, ent, got_g = _grads(lambda h, w: token_logprobs_entropy(h, targets, 1.0, True, chunk, weight=w),
                            hidden, weight)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)
    for g, w in zip(got_g, want_g):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _saved_bytes(fn, exclude: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs, leaving out the
    inputs' own storages (the caller holds those anyway; checkpointed chunks keep only views of them)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_saved_for_backward_is_bounded_by_the_chunk():
    """A 4,096-token row at 152k/16 = 9,496 vocabulary (bytes scale linearly with the vocabulary):
    whole, backward keeps the fp32 log-softmax and its exp, 8 x V bytes a token (76 KB here, 1.2 MB
    at 152k); chunked by 512, only the targets and the outputs: a few bytes a token, the same at any V."""
    torch.manual_seed(0)
    N, H, V, chunk = 4096, 16, 151_936 // 16, 512
    hidden = torch.randn(N, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (N,))

    def run(c):
        return _saved_bytes(lambda: token_logprobs_entropy(hidden, targets, 1.0, True, c, weight=weight),
                            (hidden, weight))

    whole, chunked = run(0), run(chunk)
    assert whole >= 2 * N * V * 4  # log-softmax + its exp, fp32, every token
    assert chunked <= 32 * N  # targets (int64 views) + small per-chunk scalars; no (N, V) term
    assert chunked < chunk * V * 4  # below even one chunk's log-softmax


def test_trainer_step_with_chunking_equals_without():
    """A tiny policy (vocab 17) with a frozen reference (KL) and an entropy bonus: the loss's gradients
    and one optimizer step with 5-token chunks (checkpointed, odd boundaries) equal the unchunked step."""
    from test_trainer_fsdp import MCFG, SEED, TCFG, TEMPERATURE, V, _global, _params, synthetic_batch

    batch = _global(synthetic_batch())
    assert batch["tokens"][:, 1:].size > 5  # several chunks
    res = {}
    for chunk in (0, 5):
        eng = TrainerEngine(MCFG, TCFG.model_copy(update={"logprob_chunk_tokens": chunk}), V, SEED, TEMPERATURE)
        lp, ref = eng.logprobs(batch), eng.logprobs(batch, reference=True)  # no-grad path, chunked too
        grads = {k: v.numpy() for k, v in eng.grads(batch).items()}
        stats = eng.train_step(batch)
        res[chunk] = (grads, stats, _params(eng), lp, ref)
    (g0, s0, p0, lp0, ref0), (g1, s1, p1, lp1, ref1) = res[0], res[5]
    for name, g in g0.items():
        assert np.abs(g).max() > 0, name
        np.testing.assert_allclose(g1[name], g, rtol=1e-5, atol=1e-6, err_msg=name)
    for key in ("pg_sum", "kl_sum", "entropy_sum", "grad_norm", "tokens"):
        assert s1[key] == pytest.approx(s0[key], rel=1e-5, abs=1e-6), key
    for name, p in p0.items():
        np.testing.assert_allclose(p1[name], p, rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(lp1, lp0, atol=1e-6)
    np.testing.assert_allclose(ref1, ref0, atol=1e-6)


def test_chunk_knob_is_validated():
    from rltpu.config import TrainerConfig

    assert TrainerConfig().logprob_chunk_tokens == 512
    with pytest.raises(ValueError):
        TrainerConfig(logprob_chunk_tokens=-1)
