"""Verification logic on constructed cases. Tier: integer logic, exact."""

from __future__ import annotations

import torch

from dlite_trt.runtime.sampling import greedy_accept, rejection_accept, sample_categorical

V = 10


def logits_with_argmax(posterior: list[list[int]]) -> torch.Tensor:
    """Target logits [B, K+1, V] whose argmax at each block index is the given token."""
    post = torch.tensor(posterior)
    logits = torch.randn(*post.shape, V)
    logits.scatter_(2, post[..., None], 100.0)
    return logits


def test_greedy_all_accepted():
    n, nxt = greedy_accept(torch.tensor([[3, 4, 5]]), logits_with_argmax([[3, 4, 5, 6]]))
    assert n.tolist() == [3] and nxt.tolist() == [6]  # bonus token from the last position


def test_greedy_none_accepted():
    n, nxt = greedy_accept(torch.tensor([[3, 4, 5]]), logits_with_argmax([[7, 4, 5, 6]]))
    assert n.tolist() == [0] and nxt.tolist() == [7]  # the target's own token at the anchor


def test_greedy_mismatch_in_the_middle_stops_acceptance():
    # d_3 matches its posterior again, but acceptance stops at the first mismatch (d_2).
    n, nxt = greedy_accept(torch.tensor([[3, 4, 5]]), logits_with_argmax([[3, 9, 5, 6]]))
    assert n.tolist() == [1] and nxt.tolist() == [9]


def test_greedy_per_sequence_counts_in_a_batch():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 4, 4]])
    post = [[1, 2, 3, 0], [0, 2, 3, 0], [1, 2, 8, 0], [4, 5, 4, 4]]
    n, nxt = greedy_accept(drafts, logits_with_argmax(post))
    assert n.tolist() == [3, 0, 2, 1]
    assert nxt.tolist() == [0, 0, 8, 5]


def one_hot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_rejection_accepts_when_p_covers_q():
    # p(d) >= q(d): accepted whatever the uniform; all accepted -> bonus sampled from p_K.
    drafts = torch.tensor([[2, 3]])
    q = torch.full((1, 2, V), 1.0 / V)
    p = torch.stack([one_hot([2]), one_hot([3]), one_hot([7])], dim=1)  # [1, 3, V]
    n, nxt = rejection_accept(drafts, q, p, torch.tensor([[0.999, 0.999]]), torch.tensor([0.5]))
    assert n.tolist() == [2] and nxt.tolist() == [7]


def test_rejection_rejects_where_p_is_zero_and_resamples_from_residual():
    drafts = torch.tensor([[2, 3]])
    q = torch.stack([one_hot([2]), one_hot([3])], dim=1)
    p = torch.stack([one_hot([5]), one_hot([3]), one_hot([7])], dim=1)
    n, nxt = rejection_accept(drafts, q, p, torch.tensor([[0.0, 0.0]]), torch.tensor([0.3]))
    # p(2) = 0 < u * q(2): rejected at 0; residual max(p_0 - q_0, 0) is all on token 5.
    assert n.tolist() == [0] and nxt.tolist() == [5]


def test_rejection_threshold_is_p_over_q():
    drafts = torch.tensor([[1], [1]])
    q = torch.zeros(2, 1, V)
    q[:, 0, 1] = 0.8
    q[:, 0, 2] = 0.2
    p = torch.zeros(2, 2, V)
    p[:, 0, 1] = 0.4  # accept probability p/q = 0.5
    p[:, 0, 2] = 0.6
    p[:, 1, 9] = 1.0
    n, nxt = rejection_accept(drafts, q, p, torch.tensor([[0.49], [0.51]]), torch.tensor([0.0, 0.0]))
    assert n.tolist() == [1, 0]
    # row 1: residual = max(p - q, 0) = 0.4 on token 2 only
    assert nxt.tolist() == [9, 2]


def test_sample_categorical_inverse_cdf():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    us = torch.tensor([0.0, 0.05, 0.1, 0.69, 0.71, 0.9999])
    got = sample_categorical(probs.expand(len(us), -1), us)
    assert got.tolist() == [0, 0, 2, 2, 3, 3]  # never the zero-probability token 1


def test_sample_categorical_over_a_large_vocabulary_is_the_inverse_cdf():
    """The two-level search (block sums, then inside the block) picks the token a full-vocabulary
    inverse CDF in float64 picks, wherever u * total is not within float32 rounding of a CDF entry
    (where either neighbour is right), for vocabularies that are and are not a multiple of the block
    and for u at the ends; never a token of probability 0."""
    from dlite_trt.runtime.sampling import SAMPLE_BLOCK

    gen = torch.Generator().manual_seed(3)
    for v in (SAMPLE_BLOCK * 3, 1000, 49152 + 17):
        probs = torch.softmax(torch.randn(64, v, generator=gen) * 4, dim=-1)
        probs[:, 5] = 0.0  # a token that must never be drawn
        u = torch.cat([torch.rand(61, generator=gen), torch.tensor([0.0, 0.5, 1 - 1e-7])])
        got = sample_categorical(probs, u)
        cdf = probs.double().cumsum(-1)
        target = u.double()[:, None] * cdf[:, -1:]
        want = (cdf <= target).sum(-1).clamp(max=v - 1)
        near = ((cdf - target).abs() <= 1e-5 * cdf[:, -1:]).any(-1)
        assert ((got == want) | near).all(), v
        assert (got != 5).all() and (got < v).all()
