"""The sampler against `transformers` greedy decoding and against the full no-cache forward: every
reported log-prob, entropy and hidden state must be what the model computes over prompt + completion."""
import pytest
import torch

from common import sampler
from common.model import KVCache, ModelConfig, Transformer
from common.sampler import generate

KINDS = ["llama-gqa", "llama-tied", "qwen2", "qwen3"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: a second thread buys little, and on a shared machine OpenMP barriers with an
    oversubscribed core made this file 10x slower (80-140 s instead of 14 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (our model, the transformers model it was saved from), built once per module."""
    from conftest import make_hf_model

    models = {}
    for kind in KINDS:
        hf = make_hf_model(kind)
        folder = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(folder)
        models[kind] = Transformer.from_pretrained(folder).eval(), hf
    return models


def rand_prompts(lens, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def full_forward(model, prompt, sample, temperature=1.0):
    """(logp, entropy, hidden) of the sample's tokens from one no-cache forward over prompt + completion."""
    ids = torch.tensor([prompt + sample.tokens])
    with torch.no_grad():
        h = model(ids, return_hidden=True)[0, len(prompt) - 1:-1]
        logp_all = torch.log_softmax(model.lm_head(h) / temperature, -1)
    logp = logp_all.gather(-1, torch.tensor(sample.tokens)[:, None])[:, 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1), h


def check_scores(model, prompts, groups, temperature):
    for p, group in zip(prompts, groups):
        for s in group:
            logp, ent, _ = full_forward(model, p, s, temperature)
            torch.testing.assert_close(s.logprobs, logp, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(s.entropies, ent, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(tiny, kind):
    ours, hf = tiny[kind]
    prompts = rand_prompts([7, 3, 12], seed=1)
    groups = generate(ours, prompts, n=1, max_new_tokens=20, temperature=0, stop_ids=())
    for p, (s,) in zip(prompts, groups):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert s.tokens == ref[0, len(p):].tolist()
        assert not s.finished and len(s.logprobs) == len(s.entropies) == 20


def test_one_sample_per_prompt_decodes_in_the_prefilled_cache(tiny, monkeypatch):
    """Evaluation's case (one sample per prompt, in order) must not copy the prefilled cache into a new one: the
    copy held two whole caches at once (at 150 prompts, ~0.9 GB more peak memory for SmolLM2-135M)."""
    model, _ = tiny["llama-gqa"]
    copies, index_select = [], torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda t, *a: copies.append(t.dim()) or index_select(t, *a))
    cache = model.new_cache(3, 20)
    assert cache.select(torch.arange(3)) is cache and copies == []
    generate(model, rand_prompts([7, 3, 12], seed=1), n=1, max_new_tokens=8, temperature=0, stop_ids=())
    assert 5 not in copies  # no cache tensor [layers, rows, kv_heads, columns, head_dim] was copied
    generate(model, rand_prompts([7, 3, 12], seed=1) * 2, n=1, max_new_tokens=8, temperature=0, stop_ids=())
    assert 5 not in copies  # a repeated prompt is prefilled once and its two rows read it (KVCache.share): no copy


def test_greedy_matches_transformers_smollm2():
    from transformers import AutoModelForCausalLM

    from common.hub import resolve_model_dir
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained("smollm2")
    ours = Transformer.from_pretrained("smollm2").eval()
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir("smollm2"), dtype=torch.float32).eval()
    prompts = [tok.prompt("What is 2 + 3?"), tok.prompt("Write one sentence about the sea, the sky and a small boat.")]
    groups = generate(ours, prompts, max_new_tokens=32, temperature=0, stop_ids=())
    for p, (s,) in zip(prompts, groups):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert s.tokens == ref[0, len(p):].tolist()


# ------------------------------------------------------------------------------- what it reports

def test_logprobs_entropies_equal_full_forward_with_per_prompt_n(tiny):
    """Ragged prompts, n per prompt, top-k/top-p (which must not truncate the reported scores), stops that
    end rows at different steps (so the batch gets compacted), temperature 0.7."""
    model, _ = tiny["qwen3"]
    prompts = rand_prompts([5, 9, 4, 1], seed=2)
    stops = list(range(0, 256, 9))
    groups = generate(model, prompts, n=[1, 3, 0, 2], max_new_tokens=24, temperature=0.7, top_k=40, top_p=0.9,
                      stop_ids=stops, seed=0, check_every=2)
    assert [len(g) for g in groups] == [1, 3, 0, 2]
    lens = [len(s.tokens) for g in groups for s in g]
    assert len(set(lens)) > 1, lens
    check_scores(model, prompts, groups, 0.7)


def test_prompts_with_a_shared_start(tiny):
    """Prompts that begin alike (a chat template's system turn) have that start prefilled once, for one row:
    each must still decode and score exactly as alone, whatever its rest (none at all for the shortest)."""
    model, _ = tiny["llama-gqa"]
    head = rand_prompts([11], seed=5)[0]
    prompts = [head + rest for rest in rand_prompts([4, 0, 7], seed=6)] + [head[:-1] + [head[-1] ^ 1]]
    prompts[1] = head + [3]  # its prefill part is exactly the shared start
    assert sampler._common_prefix_len([p[:-1] for p in prompts]) == 10
    groups = generate(model, prompts, n=2, max_new_tokens=12, temperature=0.9, stop_ids=(), seed=3)
    check_scores(model, prompts, groups, 0.9)
    greedy = generate(model, prompts, max_new_tokens=12, temperature=0, stop_ids=())
    for p, (s,) in zip(prompts, greedy):
        assert s.tokens == generate(model, [p], max_new_tokens=12, temperature=0, stop_ids=())[0][0].tokens


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3"])
@pytest.mark.parametrize("owner", [[0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 2, 0, 1, 2]])  # 2nd: a prompt's rows apart
def test_shared_prompt_cache_equals_repeated_rows(tiny, kind, owner):
    """KVCache.share (each prompt's keys and values stored once, read by all its rows) computes what the plain
    cache with the prompt repeated per row does: left-padded prompts, a padded 3-token segment per row, then
    decode steps with finished rows dropped (rows reordered) in between. Its rows hold only the new columns."""
    model, _ = tiny[kind]
    prompts = rand_prompts([7, 3, 5], seed=21)
    owner = torch.tensor(owner)
    W, T, steps = 7, 3, 4
    ids, pmask = sampler._left_pad(prompts, W, "cpu")
    seg, smask = sampler._left_pad(rand_prompts([3, 2, 3, 1, 3, 3, 2], seed=22), T, "cpu")
    mask = torch.cat((pmask[owner], smask, torch.ones(len(owner), steps, dtype=torch.bool)), 1)
    with torch.no_grad():
        plain, shared = model.new_cache(3, W + T + steps), model.new_cache(3, W)
        sampler.prefill(model, ids, pmask, plain)
        sampler.prefill(model, ids, pmask, shared)
        plain, shared = plain.select(owner), shared.share(owner, W + T + steps)
        assert shared.k.shape[3] == T + steps and shared.pk.shape[1] == 3
        outs = [model(seg, attention_mask=mask[:, :W + T], cache=c, start=W, return_hidden=True) for c in (plain, shared)]
        torch.testing.assert_close(outs[1][smask], outs[0][smask], atol=1e-5, rtol=1e-5)
        rows = torch.arange(len(owner))
        for t, done in enumerate([[0, 1, 0, 0, 0, 0, 1], [0] * 5, [1, 0, 0, 1, 0]]):
            col = W + T + t
            tok = torch.randint(0, 256, (len(rows),), generator=torch.Generator().manual_seed(t))
            pos = mask[rows, :col + 1].sum(1) - 1
            hs = [sampler.decode_step(model, tok, pos, c, col, mask[rows]) for c in (plain, shared)]
            torch.testing.assert_close(hs[1], hs[0], atol=1e-5, rtol=1e-5)
            done = torch.tensor(done, dtype=torch.bool)
            keep = [sampler.drop_rows(c, done, col + 1) for c in (plain, shared)]
            assert torch.equal(keep[0], keep[1])
            rows = rows[keep[0]]
        assert torch.equal(torch.div(shared.grid, shared.slots, rounding_mode="floor"), owner[rows])


def test_duplicate_prompts_and_max_new_tokens_0(tiny, monkeypatch):
    model, _ = tiny["llama-gqa"]
    p, q = rand_prompts([6, 9], seed=11)
    shared, real_share = [], KVCache.share  # a prompt drawn twice (its samples apart) still shares its cache

    def spy(self, owner, max_len):
        shared.append(owner.tolist())
        return real_share(self, owner, max_len)

    monkeypatch.setattr(KVCache, "share", spy)
    groups = generate(model, [p, q, p], n=[1, 1, 2], max_new_tokens=10, temperature=0, stop_ids=())
    assert shared == [[0, 1, 0, 0]]
    alone = generate(model, [p], max_new_tokens=10, temperature=0, stop_ids=())[0][0].tokens
    assert groups[0][0].tokens == groups[2][0].tokens == groups[2][1].tokens == alone
    # nothing generated: only the prefix, scored
    (s,), = generate(model, [p], max_new_tokens=0, prefixes=[[4, 5]], stop_ids=())
    assert s.tokens == [4, 5] and not s.finished and len(s.logprobs) == 2


def test_stop_tokens_and_truncation(tiny):
    model, _ = tiny["llama-gqa"]
    prompts = rand_prompts([6, 3], seed=3)
    stops = list(range(0, 256, 4))
    for s in (s for g in generate(model, prompts, n=4, max_new_tokens=40, stop_ids=stops, seed=1) for s in g):
        assert s.finished and s.tokens[-1] in stops and not set(s.tokens[:-1]) & set(stops)
        assert len(s.logprobs) == len(s.entropies) == len(s.tokens)
    for s in (s for g in generate(model, prompts, n=2, max_new_tokens=5, stop_ids=(), seed=1) for s in g):
        assert not s.finished and len(s.tokens) == 5
    # stop_ids=None means the config's eos_token_id
    eos = model.cfg.extra.get("eos_token_id")
    for s in generate(model, prompts, n=8, max_new_tokens=30, seed=2)[0]:
        assert s.finished == (eos in s.tokens) and (not s.finished or s.tokens.index(eos) == len(s.tokens) - 1)


def test_hidden_states_equal_model_forward(tiny):
    model, _ = tiny["qwen2"]
    prompts = rand_prompts([4, 8], seed=4)
    groups = generate(model, prompts, n=2, max_new_tokens=10, stop_ids=list(range(0, 256, 16)), seed=3,
                      return_hidden=True, check_every=1)
    for p, g in zip(prompts, groups):
        for s in g:
            h = full_forward(model, p, s)[2]
            torch.testing.assert_close(s.hidden, h, atol=1e-4, rtol=1e-4)
    pooled = generate(model, prompts, n=2, max_new_tokens=10, stop_ids=list(range(0, 256, 16)), seed=3,
                      return_hidden="mean", check_every=1)
    torch.testing.assert_close(pooled[1][0].hidden, groups[1][0].hidden.mean(0))


# --------------------------------------------------------------------------------------- sampling

def test_top_k_1_is_greedy_and_samples_lie_in_top_k_top_p(tiny):
    model, _ = tiny["llama-tied"]
    prompts = rand_prompts([5, 7], seed=5)
    greedy = generate(model, prompts, max_new_tokens=12, temperature=0, stop_ids=())
    top1 = generate(model, prompts, max_new_tokens=12, temperature=1.5, top_k=1, stop_ids=(), seed=4)
    assert [g[0].tokens for g in greedy] == [g[0].tokens for g in top1]
    k, top_p, T = 20, 0.5, 1.3
    groups = generate(model, prompts, n=4, max_new_tokens=12, temperature=T, top_k=k, top_p=top_p, stop_ids=(), seed=5)
    for p, g in zip(prompts, groups):
        for s in g:
            with torch.no_grad():
                logits = model(torch.tensor([p + s.tokens]))[0, len(p) - 1:-1] / T
            kth = logits.topk(k, -1).values[:, -1:]
            probs = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
            chosen = probs.gather(-1, torch.tensor(s.tokens)[:, None])
            assert (logits.gather(-1, torch.tensor(s.tokens)[:, None]) >= kth).all()
            # in the nucleus: the mass strictly above the chosen token is below top_p
            assert (torch.where(probs > chosen, probs, 0).sum(-1) < top_p).all()


def chi2_stat(counts, probs):
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token outside the allowed set"
    expected = counts.sum() * probs[keep]
    return ((counts[keep] - expected) ** 2 / expected).sum().item(), int(keep.sum()) - 1


# 0.999 quantiles of chi-square by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59, 11: 31.26,
            12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (1.0, 8, 0.8)])
def test_first_token_frequencies_match_softmax(temperature, top_k, top_p):
    """Chi-square goodness of fit of many one-token samples of a vocab-16 model (fixed seed), against the
    softmax at that temperature, restricted to the top-k / top-p set and renormalised."""
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # a peaked distribution, so that top-p cuts something
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1].double()
    probs = (logits / temperature).softmax(-1)
    allowed = probs.clone()
    order = allowed.argsort(descending=True)
    if top_k:
        allowed[order[top_k:]] = 0
    if top_p < 1:
        head = allowed[order]
        cut = order[(head.cumsum(0) - head) >= top_p * head.sum()]
        allowed[cut] = 0
    N = 20000
    (group,) = generate(model, [prompt], n=N, max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p,
                        stop_ids=(), seed=0)
    counts = torch.bincount(torch.tensor([s.tokens[0] for s in group]), minlength=16).double()
    chi2, dof = chi2_stat(counts, allowed / allowed.sum())
    assert dof >= 1 and chi2 < CHI2_999[dof], (chi2, dof)
    # the reported log-prob is of the untruncated softmax
    torch.testing.assert_close(group[0].logprobs[0].double(), probs[group[0].tokens[0]].log(), atol=1e-5, rtol=1e-5)


def test_seed_reproducible(tiny):
    model, _ = tiny["qwen3"]
    prompts = rand_prompts([5, 6], seed=6)
    run = lambda seed: [s.tokens for g in generate(model, prompts, n=3, max_new_tokens=16, stop_ids=(), seed=seed) for s in g]
    assert run(7) == run(7)
    assert run(7) != run(8)
    torch.manual_seed(0)
    a = generate(model, prompts, max_new_tokens=16, stop_ids=())
    torch.manual_seed(0)
    assert [g[0].tokens for g in a] == [g[0].tokens for g in generate(model, prompts, max_new_tokens=16, stop_ids=())]


# ------------------------------------------------------------------- what the algorithms build on

def test_prefixes_belong_to_the_completion(tiny):
    model, _ = tiny["llama-gqa"]
    prompts = rand_prompts([6, 3, 5], seed=7)
    shared, per_sample = [11, 12, 13], [[21], [], [22, 23, 24, 25]]
    groups = generate(model, prompts, n=[2, 3, 1], max_new_tokens=8, temperature=0, stop_ids=(),
                      prefixes=[shared, per_sample, []])
    for s in groups[0]:
        assert s.tokens[:3] == shared and s.prefix_len == 3 and len(s.tokens) == 11
    for s, q in zip(groups[1], per_sample):
        assert s.tokens[:len(q)] == q and s.prefix_len == len(q)
    assert groups[2][0].prefix_len == 0
    check_scores(model, prompts, groups, 1.0)
    # greedy continuation of a prefix = greedy continuation of the prompt that ends with it
    alone = generate(model, [prompts[1] + per_sample[2]], max_new_tokens=8, temperature=0, stop_ids=())
    assert alone[0][0].tokens == groups[1][2].tokens[4:]


def test_companion_follows_its_rows_with_its_own_cache(tiny):
    """A second model follows 3 of 6 samples through ragged prompts, a prefix and row drops (stops, checked
    every 2 steps). Its logits at every position equal its no-cache forward over prompt + completion; emitting
    its greedy token reproduces its own greedy completion, which the policy still scores; extras line up."""
    policy, _ = tiny["qwen2"]
    prior, _ = tiny["llama-tied"]
    prompts = rand_prompts([4, 7, 5], seed=8)
    ns, follow, prefixes = [2, 1, 3], [1, 2, 4], [[], [9, 10], []]
    stops = list(range(0, 256, 7))
    seen = {}  # (sample, position) -> the companion's logits

    def mix(t, tokens, logits, companion_logits, rows):
        assert set(rows.tolist()) <= set(follow)
        assert logits.shape == companion_logits.shape == (len(rows), 256) and tokens.shape == rows.shape
        seen.update({(r, t): x for r, x in zip(rows.tolist(), companion_logits)})
        greedy = companion_logits.argmax(-1)
        return greedy, {"prior_logp": torch.log_softmax(companion_logits, -1).gather(-1, greedy[:, None])[:, 0],
                        "draft": tokens}

    groups = generate(policy, prompts, n=ns, max_new_tokens=12, temperature=0.8, stop_ids=stops, seed=0,
                      prefixes=prefixes, check_every=2, companion=sampler.Companion(prior, mix, rows=follow))
    samples = [s for g in groups for s in g]
    owner = [i for i, k in enumerate(ns) for _ in range(k)]
    assert len({len(s.tokens) for s in samples}) > 1  # rows finished at different steps: the batch was compacted
    for i, s in enumerate(samples):
        p, k = prompts[owner[i]] + prefixes[owner[i]], s.prefix_len
        assert set(s.extras) == {"prior_logp", "draft"} and len(s.extras["prior_logp"]) == len(s.tokens)
        if i not in follow:
            assert (s.extras["prior_logp"] == 0).all()
            continue
        with torch.no_grad():
            ref = prior(torch.tensor([p + s.tokens[k:]]))[0, len(p) - 1:-1]  # [new tokens, V]
        torch.testing.assert_close(torch.stack([seen[i, t] for t in range(len(s.tokens) - k)]), ref, atol=1e-4, rtol=1e-4)
        alone = generate(prior, [p], max_new_tokens=12, temperature=0, stop_ids=stops)[0][0].tokens
        assert s.tokens[k:] == alone
        chosen = torch.log_softmax(ref, -1).gather(-1, torch.tensor(alone)[:, None])[:, 0]
        torch.testing.assert_close(s.extras["prior_logp"], torch.cat((torch.zeros(k), chosen)), atol=1e-4, rtol=1e-4)
    check_scores(policy, prompts, groups, 0.8)


@pytest.mark.parametrize("static", [False, True])
def test_companion_with_identity_mix_changes_nothing(tiny, monkeypatch, static):
    """Same seed, same tokens and scores as without a companion (also on the fixed-shape compile path)."""
    monkeypatch.setattr(sampler, "_compile", lambda fn, **kw: fn)
    model, prior = tiny["llama-gqa"][0], tiny["qwen3"][0]
    prompts = rand_prompts([6, 3], seed=12)
    kw = dict(n=[3, 2], max_new_tokens=16, stop_ids=list(range(0, 256, 11)), seed=3, check_every=2, compile=static)
    identity = sampler.Companion(prior, lambda t, tokens, logits, prior_logits, rows: (tokens, {}), rows=[0, 3])
    a, b = generate(model, prompts, **kw), generate(model, prompts, companion=identity, **kw)
    for sa, sb in zip((s for g in a for s in g), (s for g in b for s in g)):
        assert sa.tokens == sb.tokens and sa.finished == sb.finished
        assert torch.equal(sa.logprobs, sb.logprobs) and torch.equal(sa.entropies, sb.entropies)


def test_static_decode_step_equals_eager(tiny, monkeypatch):
    """The fixed-shape step that compile=True uses (run eagerly here) decodes what the default path does."""
    monkeypatch.setattr(sampler, "_compile", lambda fn, **kw: fn)
    model, _ = tiny["qwen3"]
    prompts = rand_prompts([3, 10, 6], seed=9)
    kw = dict(n=[2, 1, 2], max_new_tokens=12, stop_ids=list(range(0, 256, 10)), seed=1,
              prefixes=[[5, 6], [], [[7], [8, 9, 10]]], check_every=4)
    a, b = generate(model, prompts, temperature=0, **kw), generate(model, prompts, temperature=0, compile=True, **kw)
    assert [s.tokens for g in a for s in g] == [s.tokens for g in b for s in g]
    # sampled: other draws than the default path (which drops finished rows), but the same scores
    check_scores(model, prompts, generate(model, prompts, temperature=0.9, compile=True, **kw), 0.9)


def test_compile_cache_is_keyed_on_the_options(monkeypatch):
    """One compiled function per (function, options): a call with CUDA graphs after one without gets its own."""
    monkeypatch.setattr(sampler, "_compiled", {})
    made = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: made.append(kw) or (lambda *a: (fn, kw)))
    plain = sampler._compile(sampler.decode_step_static, mode=None, fullgraph=True)
    graphs = sampler._compile(sampler.decode_step_static, mode="reduce-overhead", fullgraph=True)
    assert plain() == (sampler.decode_step_static, {"mode": None, "fullgraph": True})
    assert graphs() == (sampler.decode_step_static, {"mode": "reduce-overhead", "fullgraph": True})
    assert sampler._compile(sampler.decode_step_static, fullgraph=True, mode=None) is plain and len(made) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled CUDA-graph decode step only runs on a GPU; CI has none")
def test_compiled_bf16_cuda_runs(tiny):
    model = tiny["llama-gqa"][0]
    model = Transformer(model.cfg).to("cuda", torch.bfloat16).eval()
    model.load_state_dict(tiny["llama-gqa"][0].state_dict())
    prompts = rand_prompts([5, 9], seed=10)
    a = generate(model, prompts, max_new_tokens=16, temperature=0, stop_ids=())
    b = generate(model, prompts, max_new_tokens=16, temperature=0, stop_ids=(), compile=True)
    assert [len(g[0].tokens) for g in b] == [16, 16]
    assert sum(x == y for ga, gb in zip(a, b) for x, y in zip(ga[0].tokens, gb[0].tokens)) >= 24  # bf16 may drift


# ------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kw,words", [
    (dict(prompts=[[1, 2], []]), ["prompts[1]", "non-empty"]),
    (dict(prompts=[[1, 2]], n=[1, 2]), ["n must be"]),
    (dict(prompts=[[1, 999]]), ["prompts[0]", "token ids in [0, 256)"]),
    (dict(prompts=[[1, 2]], n=2, prefixes=[[[1], [2], [3]]]), ["prefixes[0]", "n[0] is 2"]),
    (dict(prompts=[[1, 2]], top_p=0.0), ["top_p"]),
    (dict(prompts=[[1, 2]], check_every=0), ["check_every >= 1"]),
])
def test_bad_input_names_the_argument(tiny, kw, words):
    with pytest.raises(ValueError) as e:
        generate(tiny["qwen2"][0], max_new_tokens=2, **kw)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_numpy_counts_are_counts(tiny):
    """n as a NumPy integer (as a count computed with NumPy arrives) samples like the same Python int."""
    np = pytest.importorskip("numpy")
    model = tiny["qwen2"][0]
    a = generate(model, [[1, 2], [3]], n=np.int64(2), max_new_tokens=3, temperature=0, stop_ids=())
    b = generate(model, [[1, 2], [3]], n=[np.int64(2), 2], max_new_tokens=3, temperature=0, stop_ids=())
    assert [[s.tokens for s in g] for g in a] == [[s.tokens for s in g] for g in b] and [len(g) for g in a] == [2, 2]


@pytest.mark.parametrize("compile_path", [False, True])
def test_prompt_kv_reuse_equals_a_fresh_prefill(tiny, monkeypatch, compile_path):
    """prompt_kv: prompts seen in an earlier call are copied, not prefilled (only the new one goes through the model),
    and every sample decodes and scores as with a fresh prefill; prompts of different lengths and a shared start, so
    the copied columns sit at other paddings than where they were computed."""
    model, _ = tiny["llama-gqa"]
    head = rand_prompts([6], seed=7)[0]
    prompts = [head + rest for rest in rand_prompts([3, 9, 7, 1], seed=8)]
    kv = {}
    generate(model, prompts[:2], n=2, max_new_tokens=4, temperature=0.9, stop_ids=(), seed=1, prompt_kv=kv)
    assert set(kv) == {tuple(p) for p in prompts[:2]}
    prefilled = []
    real_prefill = sampler.prefill
    monkeypatch.setattr(sampler, "prefill", lambda m, ids, *a, **kw: prefilled.append(len(ids)) or real_prefill(m, ids, *a, **kw))
    if compile_path:  # the layout of a compiled step (one row per sample), run eagerly here
        monkeypatch.setattr(sampler, "_compile", lambda fn, **kw: fn)
    kw = dict(n=[1, 2, 0, 3], max_new_tokens=10, temperature=0.9, stop_ids=(), seed=4, compile=compile_path)
    again = generate(model, prompts, prompt_kv=kv, **kw)
    assert prefilled == [1]  # prompt 3 only (prompt 2 has no samples)
    fresh = generate(model, prompts, **kw)
    assert [[s.tokens for s in g] for g in again] == [[s.tokens for s in g] for g in fresh]
    check_scores(model, prompts, again, 0.9)
    assert len(kv) == 3


def test_prompt_kv_new_prompts_share_their_own_common_start(tiny, monkeypatch):
    """With prompt_kv, the prompts not seen before are prefilled in a layout of their own: the start they share
    (longer than the one all prompts share, as XRPO's in-context prompts beside plain ones) goes through the model
    once, and every sample still decodes and scores as with a fresh prefill of all the prompts."""
    model, _ = tiny["qwen2"]
    head, task = rand_prompts([4, 7], seed=21)
    prompts = [head + rest for rest in rand_prompts([5, 3], seed=22)]
    prompts += [head + task + rest for rest in rand_prompts([6, 2], seed=23)]  # new ones: head + task in common
    kv = {}
    generate(model, prompts[:2], n=2, max_new_tokens=3, temperature=0.9, stop_ids=(), seed=1, prompt_kv=kv)
    calls = []
    real_prefill = sampler.prefill
    monkeypatch.setattr(sampler, "prefill", lambda m, ids, mask, cache, shared=0: calls.append((len(ids), shared))
                        or real_prefill(m, ids, mask, cache, shared))
    kw = dict(n=[2, 1, 3, 2], max_new_tokens=8, temperature=0.9, stop_ids=(), seed=5)
    again = generate(model, prompts, prompt_kv=kv, **kw)
    assert calls == [(2, len(head) + len(task))]  # the two new prompts, their common start once
    fresh = generate(model, prompts, **kw)
    assert [[s.tokens for s in g] for g in again] == [[s.tokens for s in g] for g in fresh]
    check_scores(model, prompts, again, 0.9)


def test_length_groups_bound_the_padding():
    """Rows of similar length share a group; a group pads no row below half its width."""
    assert sampler._length_groups([60, 64, 33]) == [([0, 1, 2], 64)]
    assert sampler._length_groups([60, 64, 31]) == [([0, 1], 64), ([2], 31)]
    assert sampler._length_groups([70, 260, 64, 200, 0]) == [([1, 3], 260), ([0, 2], 70)]


def test_prompts_of_very_different_lengths_are_not_padded_to_the_longest(tiny, monkeypatch):
    """A long prompt beside short ones (XRPO's in-context prompts): the short ones go through the prefill at their
    own width, not the long one's, and every sample still decodes and scores as alone."""
    model, _ = tiny["qwen3"]
    head = rand_prompts([5], seed=11)[0]
    prompts = [head + rest for rest in rand_prompts([40, 5, 6, 36], seed=12)]
    widths = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: widths.append(tuple(args[0].shape)), with_kwargs=True)
    groups = generate(model, prompts, n=2, max_new_tokens=8, temperature=0.9, stop_ids=(), seed=5)
    hook.remove()
    prefill_calls = [w for w in widths if w[1] > 2]  # the decode steps feed one token, the extend stage two
    assert sorted(prefill_calls) == [(1, 5), (2, 5), (2, 39)], widths  # shared start; the short pair; the long pair
    check_scores(model, prompts, groups, 0.9)
    for p, g in zip(prompts, generate(model, prompts, max_new_tokens=8, temperature=0, stop_ids=())):
        assert g[0].tokens == generate(model, [p], max_new_tokens=8, temperature=0, stop_ids=())[0][0].tokens


def test_sampling_attention_leaves_out_cudnn_on_cuda_only():
    """On CUDA generate keeps cuDNN's fused attention out (its per-shape host cost at every decode step,
    bench/decode_attention.py); elsewhere it leaves PyTorch's choice alone."""
    import contextlib
    from torch.nn.attention import SDPBackend
    assert SDPBackend.CUDNN_ATTENTION not in sampler.SAMPLING_ATTENTION
    assert SDPBackend.FLASH_ATTENTION in sampler.SAMPLING_ATTENTION and SDPBackend.MATH in sampler.SAMPLING_ATTENTION
    assert isinstance(sampler._attention_kernels(torch.device("cpu")), contextlib.nullcontext)
    assert not isinstance(sampler._attention_kernels(torch.device("cuda")), contextlib.nullcontext)


def test_a_cpu_sampling_call_takes_its_temporaries_from_the_heap_and_sets_the_threshold_back(tiny, monkeypatch):
    """Fails when generate() on a CPU does not raise glibc's mmap threshold around its decode loop (every decode
    step would page-fault its [rows, vocabulary] temporaries in again: bench/sampler_heap.py), leaves it raised for
    the trainer, does not hand the freed pages back after, raises it beside a companion, or when the call's samples
    depend on where their memory came from."""
    from common import memory
    from conftest import RecordingLibc

    model = tiny["llama-gqa"][0]
    prompts = rand_prompts([5, 9, 3], seed=3)
    # with glibc itself the call's blocks come from the heap; under the stand-in below glibc's threshold stays at
    # its fixed 1 MB, so they come from mmap: the same samples either way
    from_heap = generate(model, prompts, n=2, max_new_tokens=12, temperature=1.0, seed=7, stop_ids=())
    libc = RecordingLibc()
    monkeypatch.setattr(memory, "_LIBC", libc)
    monkeypatch.setattr(memory, "_MALLOPT", True)
    seen = []
    real_stats = sampler.softmax_stats
    monkeypatch.setattr(sampler, "softmax_stats", lambda *a: seen.append(list(libc.calls)) or real_stats(*a))
    recorded = generate(model, prompts, n=2, max_new_tokens=12, temperature=1.0, seed=7, stop_ids=())
    raised, fixed = ("mallopt", memory.M_MMAP_THRESHOLD, 64 << 20), ("mallopt", memory.M_MMAP_THRESHOLD, 1 << 20)
    assert len(seen) == 12 and all([c for c in calls if c[0] == "mallopt"] == [raised] for calls in seen)
    assert [c for c in libc.calls if c[0] == "mallopt"] == [raised, fixed]
    assert libc.calls[-1] == ("trim",)  # the pages handed back after the threshold is set back
    for a, b in zip(sum(from_heap, []), sum(recorded, [])):
        assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropies, b.entropies)
    # beside a companion (EAPO's prior), whose call is a run's peak, the threshold stays fixed
    libc.calls.clear()
    identity = sampler.Companion(tiny["qwen3"][0], lambda t, tokens, logits, prior_logits, rows: (tokens, {}))
    generate(model, prompts, n=2, max_new_tokens=12, temperature=1.0, seed=7, stop_ids=(), companion=identity)
    assert libc.calls and all(c[0] == "trim" for c in libc.calls)
