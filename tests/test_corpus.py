"""Corpus-mode training data: exact greedy labels from one teacher-forced pass over text.

The oracle is transformers' greedy generate from each anchor: wherever a corpus label is marked
exact it must equal that continuation, and the mask must fall where the text leaves it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import draft_config, hf_greedy, near_bigram_target, random_draft, reduced_vocab

from dlite_trt.errors import ConfigError
from dlite_trt.model.target import TargetAdapter
from dlite_trt.training.corpus import (
    Corpus,
    CorpusMix,
    Document,
    exact_depth,
    frequent_vocabulary,
    write_corpus,
)
from dlite_trt.training.examples import draft_examples, target_states
from dlite_trt.training.pipeline import BatchSettings, BatchSource
from dlite_trt.training.stages import stage2_loss

V = 64


@pytest.fixture(scope="module")
def setup():
    hf, spec = near_bigram_target(V, seed=3)
    cfg = draft_config(spec, block_size=5, anchor_group_size=2)
    target = TargetAdapter(hf, spec, cfg.target_layer_ids).eval()
    return hf, spec, cfg, target


def texts_near_greedy(hf, count: int, length: int, seed: int) -> torch.Tensor:
    """[count, length] texts that follow the target's greedy choice except at seeded places
    (a token replaced by a random one with probability 0.25): long exact runs, and misses."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        text = [int(torch.randint(0, V, (1,), generator=g))]
        while len(text) < length:
            nxt = hf_greedy(hf, text, 1)[0]
            text.append(int(torch.randint(0, V, (1,), generator=g)) if torch.rand(1, generator=g) < 0.25 else nxt)
        rows.append(text)
    return torch.tensor(rows)


def brute_depth(tokens: list[int], greedy: list[int], a: int, max_depth: int) -> int:
    k = 1
    while k < max_depth and a + k < len(tokens) and tokens[a + k] == greedy[a + k - 1]:
        k += 1
    return k


def test_exact_depth_by_definition():
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        length, depth_cap = int(torch.randint(2, 14, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        tokens, greedy = torch.randint(0, 3, (2, length), generator=g), torch.randint(0, 3, (2, length), generator=g)
        got = exact_depth(tokens, greedy, depth_cap)
        for b in range(2):
            want = [brute_depth(tokens[b].tolist(), greedy[b].tolist(), a, depth_cap) for a in range(length)]
            assert got[b].tolist() == want


def test_exact_labels_equal_the_generated_greedy_continuation(setup):
    """Every label marked exact is the target's own greedy token from the anchor (transformers
    generate, no cache shared with the pass that made the labels); the first masked label is
    where the text left that continuation, and some labels past the mask are not greedy tokens."""
    hf, _, cfg, target = setup
    k_props = cfg.num_proposals
    tokens = texts_near_greedy(hf, 2, 20, seed=1)
    hidden, logits = target_states(target, tokens)
    anchors = torch.arange(1, tokens.shape[1] - 1).expand(2, -1)
    ex = draft_examples(tokens, hidden, logits, anchors, cfg.anchor_group_size, k_props, exact_only=True)
    checked = masked_wrong = masked = 0
    for i, (row, a) in enumerate((r, int(a)) for r in range(2) for a in anchors[r]):
        greedy = hf_greedy(hf, tokens[row, : a + 1].tolist(), k_props)
        for k in range(k_props):
            if a + k + 1 >= tokens.shape[1]:
                assert not ex.valid[i, k]
                continue
            if ex.valid[i, k]:
                assert ex.labels[i, k] == greedy[k]
                checked += 1
            else:
                masked += 1
                masked_wrong += int(ex.labels[i, k] != greedy[k])
        n_exact = int(ex.valid[i].sum())
        if n_exact < k_props and a + n_exact + 1 < tokens.shape[1]:  # masked inside the text: the text left it
            assert tokens[row, a + n_exact] != greedy[n_exact - 1]
            assert tokens[row, a + 1: a + n_exact].tolist() == greedy[: n_exact - 1]
    assert checked > 50 and masked > 10
    assert masked_wrong > 0  # the mask is needed: past it, labels are not the greedy continuation


def test_corpus_round_trip_and_errors(tmp_path):
    docs = [Document("a", (5, 6, 7)), Document("empty", ()), Document("b", (8,))]
    meta = write_corpus(docs, tmp_path / "c", eos_id=2, tokenizer_name="t", vocab_size=V)
    assert meta["documents"] == 2 and meta["offsets"] == [0, 4, 6]
    corpus = Corpus(tmp_path / "c", V)
    assert corpus.window([0, 2], 3).tolist() == [[5, 6, 7], [7, 2, 8]]
    assert corpus.token_counts(V)[2] == 2
    with pytest.raises(ConfigError, match="vocabulary"):
        Corpus(tmp_path / "c", V + 1)
    with pytest.raises(ConfigError, match="outside"):
        write_corpus([Document("bad", (V,))], tmp_path / "d", eos_id=2, tokenizer_name="t", vocab_size=V)
    (tmp_path / "c" / "tokens.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ConfigError, match="damaged"):
        Corpus(tmp_path / "c", V)


def test_frequent_vocabulary_keeps_the_mask_token():
    counts = np.array([0, 0, 9, 8, 7, 6, 5, 1])
    assert frequent_vocabulary(counts, 3).tolist() == [2, 3, 4]
    assert frequent_vocabulary(counts, 3, must_include=[1]).tolist() == [1, 2, 3]
    assert frequent_vocabulary(counts, 3, must_include=[3]).tolist() == [2, 3, 4]
    with pytest.raises(ConfigError):
        frequent_vocabulary(counts, 1, must_include=[1])


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_corpus_batches_train_with_exact_labels(setup, tmp_path, draft_vocab):
    """The corpus batch source: the target over windows, anchors weighted by exact depth, each
    valid label's chain of text tokens agrees with the labels before it; stage 2 trains on it,
    with and without a reduced draft vocabulary."""
    hf, spec, _, target = setup
    cfg = draft_config(spec, block_size=5, anchor_group_size=2, draft_vocab_size=draft_vocab)
    texts = texts_near_greedy(hf, 3, 40, seed=2)
    write_corpus([Document(str(i), tuple(t.tolist())) for i, t in enumerate(texts)], tmp_path / "c", eos_id=0,
                 tokenizer_name="t", vocab_size=V)
    mix = CorpusMix([Corpus(tmp_path / "c", V)], [1.0])
    draft = random_draft(cfg, draft_vocab=None if draft_vocab is None else reduced_vocab(V, draft_vocab))
    source = BatchSource(target, mix, draft, BatchSettings(seq_len=24, batch_seqs=3, anchors=8, min_context=4,
                                                           anchor_weight="depth", top_k=16))
    ex = source(0, 0, 1)
    assert ex.chs.shape[0] == 24 and bool(ex.valid[:, 0].all())
    for k in range(1, cfg.num_proposals):  # label k+1 counts only if the text took label k
        chained = ex.teacher_tokens[:, k - 1] == ex.labels[:, k - 1]
        assert bool((~ex.valid[:, k] | chained).all())
    assert torch.equal(source(0, 0, 1).group, ex.group)  # deterministic in (seed, step)
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    draft.train()
    first = None
    for _ in range(15):
        loss = stage2_loss(draft, ex, target.embed_weight)["loss"]
        first = float(loss.detach()) if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss) < first
