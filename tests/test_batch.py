"""common/batch.py: the flat batch and the trainer's packed forward (completions that share a context are
computed after one copy of it) give the log-probs, entropies and gradients of each sequence computed alone."""
import pytest
import torch

from common import batch as cb
from common.batch import Batch, completion_logprobs, to_batch, token_index, trainer_logprobs
from common.model import Transformer
from common.sampler import Sample


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return Transformer.from_pretrained(tiny_model_dir)


def shared_batch(seed=0):
    """Two prompts with 3 and 4 completions, one prompt with 1, in mixed order, with skipped prefixes."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 9, 4)]
    owner = [0, 1, 0, 1, 2, 1, 0, 1]
    comps = [torch.randint(3, 1000, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist() for _ in owner]
    skip = torch.tensor([0, 1, 0, 0, 2, 0, 1, 0])
    lengths = [len(c) for c in comps]
    return Batch([prompts[o] for o in owner], comps, torch.tensor(owner), skip, torch.zeros(sum(lengths)),
                 torch.ones(len(owner), dtype=torch.bool), ["1"] * len(owner))


def alone(model, b, temperature):
    """Each completion's log-probs and entropies from its own unpadded forward with full logits, in float64."""
    logp, ent = [], []
    for c, t in zip(b.context, b.tokens):
        z = model(torch.tensor([c + t]))[0, len(c) - 1:-1].double() / temperature
        lp = torch.log_softmax(z, -1)
        logp.append(lp.gather(1, torch.tensor(t)[:, None])[:, 0])
        ent.append(-(lp.exp() * lp).sum(-1))
    return torch.cat(logp), torch.cat(ent)


def test_packed_rows_share_the_context(monkeypatch):
    b = shared_batch()
    ids, targets, tmask, pos, mask, owner = cb.pack_inputs(b.context, b.tokens, [0] * 8, 0)
    contexts = list(dict.fromkeys(map(tuple, b.context)))
    blocks = [len(c) - 1 + sum(len(t) + 1 for t, bc in zip(b.tokens, b.context) if tuple(bc) == c) for c in contexts]
    # each context once (pad id 0 marks the padding), and the two shorter blocks share a row: 2 rows for 3 contexts
    assert int((ids != 0).sum()) == sum(blocks) and mask is not None
    assert ids.shape == (2, max(blocks)) and sorted(blocks)[0] + sorted(blocks)[1] <= max(blocks)
    first_row = [i for i in range(8) if b.context[i] == b.context[0]]  # each block's targets in order
    assert owner.tolist().count(first_row[0]) == len(b.tokens[first_row[0]])
    in_row = [sorted(set(owner[int(tmask[:r].sum()):int(tmask[:r + 1].sum())].tolist())) for r in range(2)]
    assert sorted(sum(in_row, [])) == list(range(8))
    assert int(tmask.sum()) == sum(len(t) for t in b.tokens)
    monkeypatch.setattr(cb, "MAX_PACKED_TOKENS", 12)  # a full block starts another block with the context again
    assert cb.pack_inputs(b.context, b.tokens, [0] * 8, 0)[0].shape[0] > 3


@pytest.mark.parametrize("loss_only", [False, True])
def test_packed_logprobs_equal_each_sequence_alone(model, loss_only):
    b = shared_batch()
    idx = [5, 0, 3, 4, 1, 7, 2, 6]  # any order: the result follows idx
    logp, entropy, tok = completion_logprobs(model, b, idx, 0.7, 0, torch.device("cpu"), loss_only=loss_only)
    want_logp, want_ent = alone(model, b, 0.7)
    expected = token_index(b.lengths, idx)
    if loss_only:
        expected = expected[b.train_mask()[expected]]
    assert torch.equal(tok, expected)
    torch.testing.assert_close(logp.double(), want_logp[tok].detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), want_ent[tok].detach(), atol=2e-5, rtol=1e-5)


def test_packed_gradient_equals_the_unpacked_gradient(model):
    b = shared_batch()
    weights = torch.randn(int(b.lengths.sum()), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    logp, entropy, tok = completion_logprobs(model, b, list(range(8)), 0.9, 0, torch.device("cpu"))
    ((logp + 0.1 * entropy) * weights[tok]).sum().backward()
    packed = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    want_logp, want_ent = alone(model, b, 0.9)
    ((want_logp + 0.1 * want_ent)[tok] * weights[tok].double()).sum().backward()
    unpacked = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(packed, unpacked, atol=1e-5, rtol=1e-4)


def test_trainer_logprobs_cover_every_token_in_order(model):
    b = shared_batch()
    logp, entropy = trainer_logprobs(model, b, 3, 0.7, 0, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    want_logp, _ = alone(model, b, 0.7)
    torch.testing.assert_close(logp.double(), want_logp.detach(), atol=2e-5, rtol=1e-5)


def test_to_batch_and_select():
    s = lambda toks, pre=0: Sample(toks, -torch.rand(len(toks)), torch.rand(len(toks)), True, prefix_len=pre)  # noqa: E731
    b = to_batch([[1, 2], [3]], [[s([5, 6]), s([7], 0)], [s([8, 9, 10], 1)]], ["a", "b"], group_ids=[4, 2])
    assert b.group.tolist() == [4, 4, 2] and b.skip.tolist() == [0, 0, 1] and b.answer == ["a", "a", "b"]
    assert b.context == [[1, 2], [1, 2], [3]] and b.train_mask().tolist() == [True, True, True, False, True, True]
    kept = b.select(torch.tensor([True, False, True]))
    assert kept.tokens == [[5, 6], [8, 9, 10]]
    torch.testing.assert_close(kept.sampler_logp, torch.cat([b.sampler_logp[:2], b.sampler_logp[3:]]))


def test_select_and_concat_keep_every_per_token_array_aligned():
    """select and concat move each completion's sampler log-probs and entropies with it (a mutation that slices one
    array by completions instead of tokens, or drops the entropies, fails)."""
    b = shared_batch()
    n_tok = int(b.lengths.sum())
    b.sampler_logp, b.sampler_entropy = -torch.arange(n_tok, dtype=torch.float), torch.arange(n_tok, dtype=torch.float)
    keep = torch.tensor([True, False, True, True, False, False, True, True])
    part = b.select(keep)
    tok = token_index(b.lengths, keep.nonzero()[:, 0].tolist())
    assert torch.equal(part.sampler_entropy, b.sampler_entropy[tok]) and torch.equal(part.sampler_logp, -part.sampler_entropy)
    both = cb.concat(part, b.select(~keep))
    assert both.tokens == part.tokens + b.select(~keep).tokens and len(both.group) == 8
    assert torch.equal(both.sampler_entropy[:len(tok)], b.sampler_entropy[tok])
    assert len(both.sampler_logp) == len(both.sampler_entropy) == n_tok
    assert cb.concat(part, shared_batch()).sampler_entropy is None  # one side without entropies: none


def test_micro_batches_keep_groups_whole_where_they_fit():
    group = torch.tensor([0] * 3 + [1] * 3 + [2] * 5 + [3] * 13 + [4] * 2)
    idx = list(range(len(group)))
    micro = cb.micro_batches(idx, group, 8)
    assert sum(micro, []) == idx  # every completion once, in order
    # 3 + 3 fit together; 5 does not join them; 13 fills 8 then leaves 5, which 2 joins
    assert [len(m) for m in micro] == [6, 5, 8, 7]
    assert all(len(set(group[m].tolist())) <= 2 for m in micro) and max(len(m) for m in micro) <= 8
    # grpo.py's batch (groups of micro_batch each, some inactive and left out of idx): fixed chunks, as before
    group = torch.arange(6).repeat_interleave(8)
    idx = [i for i in range(48) if int(group[i]) != 2]
    assert cb.micro_batches(idx, group, 8) == [idx[i:i + 8] for i in range(0, len(idx), 8)]
