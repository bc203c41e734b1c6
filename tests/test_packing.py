"""harness/packing.py and Policy(lm, packed=True): the padding-free forward gives the padded forward's log-probs,
entropies and gradients (float32 to rounding, bfloat16 as close to float32 as the padded one) on tiny random Llama,
Qwen2 and Qwen3 models and the embedded SmolLM2-135M, also where trajectories share prefixes (computed once); the
decoder sees the real tokens only, each shared prefix once; models it does not support
run padded; the decision and the attention's registration happen once, when the Policy is built; generation on the
same model object is unchanged; and a train.py step is the same either way."""
import json
from pathlib import Path

import pytest
import torch

import train
from harness import packing
from harness.run.policy import Policy, enable_gradient_checkpointing, pad_share, tensorize
from rollout import Sampling
from tests.conftest import as_ids, chat_prompt, flags, make_tiny_model, with_adapters
from tests.fakes import SearchFirst, fake_score

VOCAB = 512
SHAPES = [(7, 30), (1, 1), (12, 8), (7, 30), (3, 14)]     # (prompt, response) lengths: 37, 2, 20, 37, 17 tokens


def tiny(arch: str, **overrides):
    """2 layers, 4 query heads over 2 key/value heads (GQA), weights drawn wide enough for a spread of entropies."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, initializer_range=0.1, tie_word_embeddings=True)
    return model_cls(config_cls(**{**shape, **overrides})).eval()


def micro_batch(vocab: int, shapes=SHAPES):
    """Right-padded rows of random tokens (tensorize), every response token scored, and a random advantage."""
    gen = torch.Generator().manual_seed(1)
    items = []
    for p, r in shapes:
        ids = torch.randint(0, vocab, (p + r,), generator=gen).tolist()
        items.append((ids[:p], ids[p:], [1] * r))
    mb = tensorize(items, 0, "cpu")
    return mb, torch.randn(mb.mask.shape, generator=gen)


def shared_micro_batch(vocab: int):
    """Trajectories that share prefixes the ways a rollout's do: a prompt (P) shared by most, a tree's branch (P + A)
    shared by three that then part, one that is a prefix of another (P + A[:4]), one the same as another, one sharing
    only P's first 5 tokens (a system prompt), one sharing nothing; every response token scored, a random advantage."""
    gen = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()       # noqa: E731
    P, A = draw(12), draw(9)
    tail = draw(5)
    shapes = [(P, A + tail), (P, A + draw(8)), (P[:5], draw(4)), (P, draw(6)), (P, A[:4]), (draw(3), draw(6)),
              (P, A + tail)]
    mb = tensorize([(p, r, [1] * len(r)) for p, r in shapes], 0, "cpu")
    return mb, torch.randn(mb.mask.shape, generator=gen)


def forward_backward(lm, mb, adv, packed: bool, bf16: bool = False, share: bool = True):
    """logp, entropy (B, L-1) and every parameter's gradient of Σ logp·mask·adv + 0.1·Σ H·mask."""
    lm.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logp, entropy = Policy(lm, packed, share)(mb.input_ids, mb.attention_mask, mb.mask, 0.7)
    ((logp * mb.mask * adv).sum() + 0.1 * (entropy * mb.mask).sum()).backward()
    return logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


def worst_relative(grads, reference) -> float:
    """max over parameters of max |g − g_ref| / max |g_ref|."""
    assert grads.keys() == reference.keys() and reference
    return max(float((grads[n] - reference[n]).abs().max() / reference[n].abs().max()) for n in reference)


# ---------------------------------------------------------------------------------------------------------------------
# The pieces


def test_pack_and_unpack_layout():
    """share=False: every real token, positions restarting per trajectory, the boundaries flash-attention reads."""
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    attn = (ids != 0).long()
    attn[2] = 1
    packed, positions, layout = packing.pack_shared(ids, attn, share=False)
    cu_seqlens, lengths = layout.kwargs()["cu_seq_lens_q"], torch.tensor(layout.lengths)
    assert packed.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]] and positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert cu_seqlens.tolist() == [0, 3, 5, 9] and cu_seqlens.dtype == torch.int32 and lengths.tolist() == [3, 2, 4]
    mask = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 1, 1]])            # scores 7 | 9 | 3, 4
    hidden = torch.arange(9.0)[None, :, None]                           # (1, N, 1): a position's own index
    assert layout.unpack(hidden, mask)[:, 0].tolist() == [1, 3, 6, 7]   # the token before each target
    with pytest.raises(ValueError, match="next token is not in its trajectory"):
        layout.unpack(hidden, torch.tensor([[0, 0, 1], [0, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="right-padded"):
        packing.pack_shared(ids, attn.flip(1))


def test_pack_shared_layout():
    """Each trajectory's longest common prefix with an earlier one is computed once: the row holds the rest."""
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0], [5, 6, 7, 8, 1], [3, 0, 0, 0, 0], [5, 6, 9, 0, 0]])
    attn = (ids != 0).long()
    attn[2] = 1
    packed, positions, layout = packing.pack_shared(ids, attn)
    assert packed.tolist() == [[5, 6, 7, 8, 9, 1, 3]] and positions.tolist() == [[0, 1, 2, 3, 2, 4, 0]]
    assert layout.first == [0, 2, 4, 0, 3] and layout.starts == [0, 4, 5, 6, 7] and layout.lengths == [4, 3, 5, 1, 3]
    assert layout.path.tolist() == [[0, 1, 2, 3, 0], [0, 1, 4, 0, 0], [0, 1, 2, 3, 5], [6, 0, 0, 0, 0],
                                    [0, 1, 4, 0, 0]]
    assert layout.shares and "shared_prefixes" in layout.kwargs()
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]])
    hidden = torch.arange(7.0)[None, :, None]                           # (1, N, 1): a position's own row index
    assert layout.unpack(hidden, mask)[:, 0].tolist() == [1, 2, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="next token is not in its trajectory"):
        layout.unpack(hidden, torch.tensor([[0, 0, 0, 1], [0] * 4, [0] * 4, [0] * 4, [0] * 4]))
    plain, plain_positions, unshared = packing.pack_shared(ids, attn, share=False)   # every real token, boundaries
    assert torch.equal(plain[0], ids[attn.bool()]) and not any(unshared.first) and not unshared.shares
    assert plain_positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1, 2]]
    assert unshared.kwargs()["cu_seq_lens_q"].tolist() == [0, 4, 7, 12, 13, 16]


# ---------------------------------------------------------------------------------------------------------------------
# Values and gradients against the padded forward


@pytest.mark.parametrize("batch", ["apart", "shared prefixes"])
@pytest.mark.parametrize("arch, variant", [("llama", ""), ("qwen2", ""), ("qwen3", ""),
                                           ("llama", "gradient checkpointing"), ("llama", "lora")])
def test_packed_equals_padded_float32(arch, variant, batch):
    """The padded forward's log-probs, entropies and gradients to rounding, for trajectories apart and for ones that
    share prefixes (a prompt, a branch, a duplicate, a prefix of another: computed once, their gradients summed over
    the trajectories through a shared token)."""
    lm = tiny(arch)
    if variant == "gradient checkpointing":                            # backward recomputes the attention
        enable_gradient_checkpointing(lm)
        lm.train()
    if variant == "lora":
        lm = with_adapters(lm, b_scale=0.05)
    mb, adv = micro_batch(VOCAB) if batch == "apart" else shared_micro_batch(VOCAB)
    padded, packed = forward_backward(lm, mb, adv, packed=False), forward_backward(lm, mb, adv, packed=True)
    assert Policy(lm, packed=True).packed and lm.config._attn_implementation == packing.ATTENTION
    for want, got in zip(padded[:2], packed[:2]):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert bool((got[mb.mask == 0] == 0).all())                   # unscored positions stay 0
    assert worst_relative(packed[2], padded[2]) < 1e-5


def test_shared_prefixes_bf16_as_close_to_float32_as_unshared():
    lm = tiny("llama")
    mb, adv = shared_micro_batch(VOCAB)
    exact = forward_backward(lm, mb, adv, packed=False)
    unshared, shared = (forward_backward(lm, mb, adv, packed=True, bf16=True, share=s) for s in (False, True))
    for want, got in zip(unshared[:2], shared[:2]):
        assert torch.allclose(got, want, atol=1e-2)
    assert worst_relative(shared[2], exact[2]) <= 1.25 * worst_relative(unshared[2], exact[2]) + 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_bf16_is_as_close_to_float32_as_padded(arch):
    lm = tiny(arch)
    mb, adv = micro_batch(VOCAB)
    exact = forward_backward(lm, mb, adv, packed=False)
    padded, packed = (forward_backward(lm, mb, adv, packed=p, bf16=True) for p in (False, True))
    for want, got in zip(padded[:2], packed[:2]):
        assert torch.allclose(got, want, atol=1e-2)
    assert worst_relative(packed[2], padded[2]) < 3e-2
    assert worst_relative(packed[2], exact[2]) <= 1.25 * worst_relative(padded[2], exact[2]) + 1e-3


def test_packed_equals_padded_on_the_embedded_model():
    """SmolLM2-135M (30 layers, 9 query heads over 3 key/value heads), float32."""
    from tests.conftest import embedded_gguf_dir
    from harness import config, models
    embedded_gguf_dir()                                                 # skips where the wheel is not installed
    lm = models.load_lm(str(models.embedded_model_dir(config.cache_dir())), "cpu")
    for mb, adv in (micro_batch(lm.config.vocab_size, [(20, 30), (1, 1), (15, 20)]),
                    shared_micro_batch(lm.config.vocab_size)):
        padded, packed = forward_backward(lm, mb, adv, packed=False), forward_backward(lm, mb, adv, packed=True)
        for want, got in zip(padded[:2], packed[:2]):
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
        assert worst_relative(packed[2], padded[2]) < 1e-4


# ---------------------------------------------------------------------------------------------------------------------
# What the decoder computes; models that run padded


def decoder_inputs(lm, mb, packed: bool) -> list[tuple]:
    """The shapes of input_ids the decoder got in one forward."""
    seen = []
    hook = lm.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    with torch.no_grad():
        Policy(lm, packed)(mb.input_ids, mb.attention_mask, mb.mask)
    hook.remove()
    return seen


def test_the_packed_decoder_computes_the_real_tokens_only():
    lm = tiny("llama")
    mb, _ = micro_batch(VOCAB)
    n_real = int(mb.attention_mask.sum())
    assert n_real < mb.attention_mask.numel()                          # the padded rows do hold padding
    assert decoder_inputs(lm, mb, packed=True) == [(1, n_real)]
    assert decoder_inputs(lm, mb, packed=False) == [tuple(mb.input_ids.shape)]
    shared, _ = shared_micro_batch(VOCAB)                              # 53 tokens: the rest is shared
    assert decoder_inputs(lm, shared, packed=True) == [(1, 12 + 9 + 5 + 8 + 4 + 6 + 9)]
    assert pad_share([[mb]], packed=True) == 0.0
    assert pad_share([[mb]]) == pytest.approx(1 - n_real / mb.attention_mask.numel())


def test_packing_is_decided_and_registered_once_when_the_policy_is_built(monkeypatch):
    """Policy(lm, packed=True) decides whether it packs (packing.supported) and switches the model to the packed
    attention once, when built: its forwards register nothing again; packed=False leaves the model as it was."""
    registered = []
    real = packing.use_packed_attention
    monkeypatch.setattr(packing, "use_packed_attention", lambda decoder: (registered.append(decoder), real(decoder)))
    mb, _ = micro_batch(VOCAB)
    plain, packed = tiny("llama"), tiny("llama")
    assert not Policy(plain).packed and plain.config._attn_implementation == "sdpa" and registered == []
    policy = Policy(packed, packed=True)
    assert policy.packed and registered == [packed.get_decoder()]
    with torch.no_grad():
        for _ in range(3):
            policy(mb.input_ids, mb.attention_mask, mb.mask)
    assert len(registered) == 1 and packed.config._attn_implementation == packing.ATTENTION


@pytest.mark.parametrize("model", ["sliding window", "eager attention"])
def test_unsupported_models_run_padded(model):
    lm = tiny("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1) if model == "sliding window" \
        else tiny("llama", attn_implementation="eager")
    mb, adv = micro_batch(VOCAB)
    assert not Policy(lm, packed=True).packed and lm.config._attn_implementation != packing.ATTENTION
    assert decoder_inputs(lm, mb, packed=True) == [tuple(mb.input_ids.shape)]
    padded, packed = forward_backward(lm, mb, adv, packed=False), forward_backward(lm, mb, adv, packed=True)
    assert torch.equal(padded[0], packed[0])


# ---------------------------------------------------------------------------------------------------------------------
# Generation on the same model object, and a train.py step


def test_generation_is_unchanged_after_a_packed_forward(tokenizer):
    """The transformers generator (KV cache, left-padded prompts of different lengths) decodes greedily the same
    tokens with the same log-probs from a model switched to packing.ATTENTION as from one never switched."""
    from harness.generation import TransformersGenerator
    contexts = [as_ids(chat_prompt(tokenizer, q)) for q in ("a?", "a much longer question than the others?", "b?")]
    never, switched = make_tiny_model(tokenizer), make_tiny_model(tokenizer)
    mb, _ = micro_batch(len(tokenizer))
    with torch.no_grad():
        Policy(switched, packed=True)(mb.input_ids, mb.attention_mask, mb.mask)
    assert switched.config._attn_implementation == packing.ATTENTION and never.config._attn_implementation == "sdpa"
    want, got = (TransformersGenerator(lm, tokenizer, batch_size=2).generate(contexts, [12, 12, 12], seed=0,
                                                                             sampling=Sampling(temperature=0.0))
                 for lm in (never, switched))
    assert [s.token_ids for s in got] == [s.token_ids for s in want] and all(len(s.token_ids) for s in got)
    assert [s.logprobs for s in got] == [s.logprobs for s in want]


def test_a_train_step_is_the_same_packed_or_padded(setup):
    """One train.main step from the same seed, --set packed=false and true: the same rollout, so the same metrics up to
    rounding (the entropy z-score of the tiny model magnifies it: 1e-3), and no padding computed when packed."""
    rows = {}
    for packed in ("false", "true"):
        argv = flags(setup, f"packed_{packed}", steps=1, k=4, mini_batch_size=2, max_response_tokens=40, kl_coef=0.05,
                     set=f"packed={packed}")
        run = Path(train.main(argv, score=fake_score, make_generator=SearchFirst.factory())["run_dir"])
        rows[packed] = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    padded, packed = rows["false"], rows["true"]
    assert padded["pad_share"] > 0 and packed["pad_share"] == 0
    for key, value in padded.items():
        if not key.startswith(("time/", "memory/", "update_tokens_per_s", "pad_share")):
            assert packed[key] == pytest.approx(value, rel=1e-3, abs=1e-6), key
