"""common/embed.py: padding does not change an embedding, rows are unit length, pooling on given hidden states
equals embedding from scratch, and the LM head is never run."""
import pytest
import torch

from common.embed import embed, pool_hidden
from common.model import Transformer


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Transformer.from_pretrained(tiny_model_dir)


def seqs_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 5000, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("pool", ["mean", "last"])
def test_alone_equals_in_padded_batch(model, pool):
    seqs = seqs_of([3, 11, 7, 1, 20, 5])
    batched = embed(model, seqs, batch=4, pool=pool)  # two micro-batches, both padded
    for i, s in enumerate(seqs):
        alone = embed(model, [s], pool=pool)
        assert torch.allclose(batched[i], alone[0], atol=1e-5), i


def test_unit_length_and_distinct(model):
    seqs = seqs_of([4, 9, 9, 15])
    e = embed(model, seqs)
    assert e.shape == (4, model.cfg.hidden_size) and e.dtype == torch.float32
    assert torch.allclose(e.norm(dim=-1), torch.ones(4), atol=1e-5)
    cos = e @ e.T
    assert (cos.fill_diagonal_(0) < 0.9999).all()  # different texts, different embeddings
    same = embed(model, [seqs[1], seqs[1]])
    assert torch.allclose(same[0] @ same[1], torch.tensor(1.0), atol=1e-5)


def test_empty_sequence_is_zero_vector(model):
    e = embed(model, [[], [5, 6, 7]])
    assert e[0].abs().sum() == 0 and abs(e[1].norm().item() - 1) < 1e-5


@pytest.mark.parametrize("pool", ["mean", "last"])
def test_pool_hidden_left_padding_matches_embed(model, pool):
    """A scoring pass that already holds hidden states (here left-padded) pools to the same vectors."""
    seqs = seqs_of([6, 2, 9])
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for j, s in enumerate(seqs):
        ids[j, T - len(s):] = torch.tensor(s)
        mask[j, T - len(s):] = True
    with torch.no_grad():
        hidden = model(ids, attention_mask=mask, return_hidden=True)
    assert torch.allclose(pool_hidden(hidden, mask, pool), embed(model, seqs, pool=pool), atol=1e-5)


def test_never_runs_lm_head(model, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("LM head called")
    monkeypatch.setattr(model.lm_head, "forward", boom)
    embed(model, seqs_of([3, 5]))


def test_bad_pool():
    with pytest.raises(ValueError, match="pool"):
        pool_hidden(torch.zeros(1, 2, 4), torch.ones(1, 2), "max")
