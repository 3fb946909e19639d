"""The small GPT, its tokenizer and the bundled corpus (minioffload.model.gpt, minioffload/data)."""

from __future__ import annotations

import pytest
import torch

from minioffload.model.gpt import (
    GPT,
    SEPARATOR,
    TEXTS,
    CharTokenizer,
    GPTConfig,
    PaddedStack,
    batches,
    load_text,
    train_val_split,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are too small for intra-op threads to help; on a busy 2-core machine, spinning threads made
    the training test 10x slower. One thread here; the previous setting is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus() -> str:
    return load_text()


@pytest.fixture(scope="module")
def tok(corpus) -> CharTokenizer:
    return CharTokenizer(corpus)


def tiny_model(vocab_size: int = 32, seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", vocab_size, **overrides))


# ---------------------------------------------------------------------------------------------
# configuration


@pytest.mark.parametrize(
    "name, low, high",
    [("tiny", 0.08e6, 0.15e6), ("small", 1e6, 2e6), ("medium", 8e6, 12e6), ("gpt2-small-ish", 85e6, 100e6)],
)
def test_presets_have_the_documented_sizes(name, low, high, tok):
    n = GPT(GPTConfig.preset(name, tok.vocab_size)).num_params()
    assert low <= n <= high, f"{name}: {n:,} parameters"


def test_preset_overrides_and_unknown_preset():
    cfg = GPTConfig.preset("tiny", 50, block_size=16, tie_weights=False)
    assert (cfg.block_size, cfg.tie_weights, cfg.n_layer) == (16, False, 2)
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPTConfig.preset("huge", 50)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(n_embd=66), "n_embd"),  # 66 % 4 != 0
        (dict(n_head=0), "n_head"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(block_size=-1), "block_size"),
        (dict(n_layer=0), "n_layer"),
        (dict(n_embd=0), "n_embd"),
        (dict(n_layer=2.0), "n_layer"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_bad_configs_raise_naming_the_field(changes, field):
    base = dict(vocab_size=10, block_size=8, n_layer=1, n_head=4, n_embd=64)
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{**base, **changes})


# ---------------------------------------------------------------------------------------------
# the model


def test_lm_head_is_tied_to_the_token_embedding_and_counted_once():
    tied, untied = tiny_model(), tiny_model(tie_weights=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    head = untied.lm_head.weight.numel()
    assert tied.num_params() == sum(p.numel() for p in set(tied.parameters()))
    assert untied.num_params() == tied.num_params() + head
    # by name, the shared tensor shows up once unless asked for duplicates
    names = [n for n, _ in tied.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    assert len(list(tied.named_parameters(remove_duplicate=False))) == len(names) + 1
    emb = tied.tok_emb.weight.numel() + tied.pos_emb.weight.numel()
    assert tied.num_params(exclude_embeddings=True) == tied.num_params() - emb
    assert untied.num_params(exclude_embeddings=True) == untied.num_params() - emb  # the untied head stays


def test_tied_weight_gets_gradient_from_both_uses():
    model = tiny_model()
    idx = torch.randint(32, (2, 10), generator=torch.Generator().manual_seed(1))
    _, loss = model(idx, idx)
    loss.backward()
    g = model.tok_emb.weight.grad
    assert g is not None and model.lm_head.weight.grad is g
    unused = sorted(set(range(32)) - set(idx.flatten().tolist()))
    assert g[unused].abs().sum() > 0  # rows of tokens never fed in still get the head's gradient


def test_forward_shapes_and_loss():
    model = tiny_model()
    idx = torch.randint(32, (3, 17), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 32) and loss is None
    targets = torch.randint(32, (3, 17), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, targets)
    assert loss.shape == () and torch.isfinite(loss)
    # freshly initialised, the model is close to uniform over the vocabulary
    assert abs(loss.item() - torch.log(torch.tensor(32.0)).item()) < 0.3
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(65, dtype=torch.long))


def test_attention_is_causal():
    model = tiny_model(n_layer=2).eval()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(32, (2, 40), generator=gen)
    changed = idx.clone()
    changed[:, 25:] = (changed[:, 25:] + 1 + torch.randint(30, (2, 15), generator=gen)) % 32
    with torch.no_grad():
        before, _ = model(idx)
        after, _ = model(changed)
    torch.testing.assert_close(before[:, :25], after[:, :25], rtol=0, atol=1e-5)
    assert (before[:, 25:] - after[:, 25:]).abs().max() > 1e-3  # and later positions do see the change


def test_tiny_model_overfits_a_repeated_string():
    text = "the quick brown fox jumps over the lazy dog. " * 40
    tok = CharTokenizer(text)
    data = torch.tensor(tok.encode(text))
    model = tiny_model(tok.vocab_size, block_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    first = None
    for _ in range(100):
        x, y = batches(data, 32, 8, gen)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    assert first > 2.5 and loss.item() < 0.3, (first, loss.item())


def test_generate_is_deterministic_with_a_seeded_generator():
    model = tiny_model()
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def sample(seed, **kw):
        return model.generate(prompt, 80, generator=torch.Generator().manual_seed(seed), **kw)

    a = sample(0)
    assert a.shape == (2, 83) and torch.equal(a[:, :3], prompt)  # longer than block_size 64: context cropped
    assert torch.equal(a, sample(0))
    assert not torch.equal(a, sample(1))
    assert torch.equal(sample(3, top_k=1), sample(4, top_k=1))  # top_k=1 is greedy: the seed does not matter
    assert model.training  # generate ran in eval mode and restored the mode
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 1, temperature=0.0)


# ---------------------------------------------------------------------------------------------
# tokenizer, corpus, batches


def test_tokenizer_round_trips_the_corpus(corpus, tok):
    ids = tok.encode(corpus)
    assert len(ids) == len(corpus) and max(ids) == tok.vocab_size - 1
    assert tok.decode(ids) == corpus
    assert tok.chars == sorted(set(corpus))


def test_tokenizer_refuses_unknown_characters(tok):
    with pytest.raises(ValueError, match=r"'~'.*position 5"):
        tok.encode("Hello~")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError):
        CharTokenizer("")


def test_corpus_is_large_and_printable(corpus):
    assert len(corpus.encode("utf-8")) >= 40_000
    assert all(ch.isprintable() or ch == "\n" for ch in corpus)
    assert corpus.count(SEPARATOR) == len(TEXTS) - 1
    for name in TEXTS:
        assert load_text(name).strip("\n") in corpus
    assert "We the People of the United States" in corpus and "Four score and seven years ago" in corpus
    with pytest.raises(ValueError, match="unknown text"):
        load_text("hamlet")


def test_batches_are_deterministic_and_shifted_by_one():
    data = torch.arange(1000)
    x, y = batches(data, 16, 8, torch.Generator().manual_seed(0))
    x2, y2 = batches(data, 16, 8, torch.Generator().manual_seed(0))
    x3, _ = batches(data, 16, 8, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, x3)
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y, x + 1)  # contiguous windows of arange
    assert int(y.max()) <= 999
    with pytest.raises(ValueError, match="block_size"):
        batches(torch.arange(16), 16, 2, None)


def test_train_val_split():
    train, val = train_val_split(list(range(100)), val_fraction=0.1)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(list(range(100)), val_fraction=0.0)


def test_a_padded_stack_computes_as_its_layers_do_and_refuses_negative_times():
    import time

    torch.manual_seed(0)
    padded = PaddedStack(width=8, layers=3, forward_s=0.0, backward_s=0.0)
    x = torch.randn(2, 8)
    expected = x
    for layer in padded.layers:
        expected = torch.tanh(layer(expected))
    assert torch.equal(padded(x), expected)
    padded.forward_s, padded.backward_s = 0.03, 0.06
    start = time.perf_counter()
    loss = padded(x).square().sum()
    forwarded = time.perf_counter()
    loss.backward()
    backwarded = time.perf_counter()
    assert forwarded - start >= 0.03 and backwarded - forwarded >= 0.06  # sleeps last at least as asked
    assert all(layer.weight.grad is not None for layer in padded.layers)
    with pytest.raises(ValueError, match="seconds >= 0"):
        PaddedStack(width=8, layers=1, backward_s=-1.0)
