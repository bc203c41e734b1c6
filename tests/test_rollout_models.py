"""The rollout on real token ids: a tiny random transformers model with the real tokenizer and the
real local tools (the vLLM backend: tests/test_vllm.py)."""
import dataclasses

import pytest
import torch

import rollout
import sampler
from harness import search as search_mod
import tools
from harness.generation import TransformersGenerator
from rollout import Sampling, Segment, tree_rollout
from tests.conftest import as_ids, chat_prompt, make_tiny_model
from tests.fakes import Delayed, FirstCall


class ForcedFirstCall:
    """Wraps a generator: the first segment of each trajectory is a scripted search call (a random
    model never writes one), later segments come from the real model. Records every segment."""

    def __init__(self, inner, tokenizer, prompt_len):
        self.inner, self.tok, self.prompt_len = inner, tokenizer, prompt_len
        self.vocab_size = inner.vocab_size
        self.log = []  # (context, segment)

    def generate(self, contexts, max_new_tokens, seed, sampling=None, on_step=None):
        real = [i for i, c in enumerate(contexts) if len(c) > self.prompt_len]
        out = [None] * len(contexts)
        if real:
            segs = self.inner.generate([contexts[i] for i in real], [max_new_tokens[i] for i in real], seed, sampling)
            for i, s in zip(real, segs):
                out[i] = s
        for i, c in enumerate(contexts):
            if out[i] is None:
                text = "<think> look it up </think> <search> Eiffel Tower Paris </search>"
                out[i] = Segment(self.tok.encode(text, add_special_tokens=False), "tool", 0.5 + 0.01 * i, text)
            self.log.append((list(c), out[i]))
        return out


@pytest.fixture(scope="module")
def real_tools(tmp_path_factory):
    t = tools.Tools(search_mod.make_search("bm25", topk=1))   # short results keep the random model's turns short
    yield t
    t.close()


def test_transformers_generator_segments(tokenizer, tiny_model):
    gen = TransformersGenerator(tiny_model, tokenizer, batch_size=3)
    ctx = [as_ids(chat_prompt(tokenizer, q)) for q in ("a?", "a longer question here?", "b?", "c?")]
    segs = gen.generate(ctx, [5, 12, 7, 1], seed=3, sampling=Sampling(top_p=0.9))
    assert [len(s.token_ids) <= n for s, n in zip(segs, [5, 12, 7, 1])] == [True] * 4
    for s in segs:
        assert s.finish_reason in ("tool", "answer", "eos", "length")
        n = min(len(s.token_ids), 20)
        assert 0 <= s.h_seg <= n * 1.0 + 1e-6          # each position contributes ≤ log(10)/log|V| < 1
        assert s.text == tokenizer.decode(s.token_ids)
    again = gen.generate(ctx, [5, 12, 7, 1], seed=3, sampling=Sampling(top_p=0.9))
    assert [s.token_ids for s in segs] == [s.token_ids for s in again]


@pytest.mark.parametrize("text, stops, ends", [("x </search> tail", None, "</search>"),
                                               ("x </search> y </tool_call> tail", ("</tool_call>", "</answer>"),
                                                "</tool_call>")], ids=["tags", "hermes"])
def test_transformers_generator_cuts_at_stop_strings(tokenizer, text, stops, ends):
    """A model that always emits the tokens of a closing tag: the segment ends right after it (the run's format's
    stop strings: in hermes `</search>` is text)."""
    model = make_tiny_model(tokenizer)
    target = tokenizer.encode(text, add_special_tokens=False)

    def forward_hook(module, args, kwargs, output):
        logits = torch.full_like(output.logits, -1e4)
        # emit target tokens in order, based on how many were already generated
        n_gen = ForcedCounter.count
        logits[:, -1, target[min(n_gen, len(target) - 1)]] = 0
        ForcedCounter.count += 1
        output.logits = logits
        return output

    class ForcedCounter:
        count = 0

    model.register_forward_hook(forward_hook, with_kwargs=True)
    gen = TransformersGenerator(model, tokenizer, **({"stop_strings": stops} if stops else {}))
    seg = gen.generate([as_ids(chat_prompt(tokenizer, "q"))], [20], seed=0)[0]
    assert seg.finish_reason == "tool"
    assert seg.text.endswith(ends)
    assert seg.token_ids == target[:len(seg.token_ids)] and "tail" not in seg.text


def test_full_tree_with_tiny_model_and_real_tools(tokenizer, tiny_model, real_tools):
    prompts = [as_ids(chat_prompt(tokenizer, "Where is the Eiffel Tower?"))]
    inner = TransformersGenerator(tiny_model, tokenizer)
    gen = ForcedFirstCall(inner, tokenizer, len(prompts[0]))
    trajs, stats = tree_rollout(prompts, gen, real_tools, tokenizer, k=4, gamma=5.0,
                                max_response_tokens=420, seed=1)
    assert len(trajs) == 4 and all(t.finished for t in trajs)
    assert stats["tools/search/calls"] >= 1
    first = trajs[0]
    assert "Eiffel" in first.text.split("<result>")[1]                                # the real BM25 result came back
    # ids round-trip: response = sampled segments + tokenised results, nothing re-encoded
    segs = {}                                  # context -> segments sampled from it (branches share one)
    for c, seg in gen.log:
        segs.setdefault(tuple(c), []).append(seg)
    for t in trajs:
        pos = 0
        while pos < len(t.response_ids):
            options = [s for s in segs[tuple(t.prompt_ids + t.response_ids[:pos])]
                       if t.response_ids[pos:pos + len(s.token_ids)] == s.token_ids]
            assert options, f"trajectory {t.traj_id}: tokens at {pos} are not a sampled segment"
            seg = options[0]
            assert all(t.loss_mask[pos:pos + len(seg.token_ids)])
            pos += len(seg.token_ids)
            if seg.finish_reason == "tool" and pos < len(t.response_ids):
                end = pos + t.loss_mask[pos:].index(1) if 1 in t.loss_mask[pos:] else len(t.loss_mask)
                result_ids = t.response_ids[pos:end]
                assert not any(t.loss_mask[pos:end])
                text = tokenizer.decode(result_ids)
                assert text.startswith("\n<result>\n") and text.endswith("\n</result>\n")
                assert result_ids == tokenizer.encode(text, add_special_tokens=False)  # tokenised once
                pos = end
    branches = [t for t in trajs if t.parent is not None]
    for b in branches:
        parent = trajs[b.parent]
        assert b.response_ids[:b.fork_offset] == parent.response_ids[:b.fork_offset]


def test_segment_entropy_is_from_the_raw_distribution(tokenizer, tiny_model):
    """With temperature and top-p on, H_seg still uses the model's own (T = 1) top-10 log-probs,
    recomputed here by a plain forward pass over the sampled tokens."""
    gen = TransformersGenerator(tiny_model, tokenizer)
    ctx = as_ids(chat_prompt(tokenizer, "entropy?"))
    seg = gen.generate([ctx], [30], seed=11, sampling=Sampling(temperature=0.5, top_p=0.9))[0]
    with torch.no_grad():
        logits = tiny_model(torch.tensor([ctx + seg.token_ids])).logits[0].float()
    first = logits[len(ctx) - 1: len(ctx) - 1 + min(20, len(seg.token_ids))]
    top = torch.log_softmax(first, -1).topk(10, -1).values.tolist()
    assert seg.h_seg == pytest.approx(rollout.segment_entropy(top, tiny_model.config.vocab_size), rel=1e-4)


def peaked(tokenizer, seed=5):
    """The tiny model with 40x larger (tied) embeddings: peaked next-token distributions that repeat tokens."""
    lm = make_tiny_model(tokenizer, seed=seed)
    with torch.no_grad():
        lm.model.embed_tokens.weight.mul_(40.0)
    return lm


def raw_h_seg(model, context, token_ids):
    """H_seg of a segment from the model's own logits, teacher-forced over its tokens (no penalty, T = 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([context + token_ids])).logits[0].float()
    first = logits[len(context) - 1: len(context) - 1 + min(20, len(token_ids))]
    return rollout.segment_entropy(torch.log_softmax(first, -1).topk(10, -1).values.tolist(), model.config.vocab_size)


def test_a_checkpoints_generation_config_does_not_shape_the_samples(tokenizer):
    """algorithm.md §1: the generator samples the raw policy. A checkpoint whose generation_config sets a repetition
    penalty, no_repeat_ngram_size, min_p and suppressed tokens (instruct checkpoints ship such settings) samples exactly
    the tokens of the same weights without them, with the raw H_seg, and its generation_config is left as it was. A
    repetition penalty given per call (an evaluation protocol's) does change the samples, and not H_seg."""
    context = as_ids(chat_prompt(tokenizer, "What is the capital of France?"))
    plain, shaped = peaked(tokenizer), peaked(tokenizer)
    shaped.generation_config.update(repetition_penalty=2.0, no_repeat_ngram_size=2, min_p=0.3, suppress_tokens=[198])
    a = TransformersGenerator(plain, tokenizer).generate([context], [30], seed=3)[0]
    b = TransformersGenerator(shaped, tokenizer).generate([context], [30], seed=3)[0]
    assert len(a.token_ids) > 5 and len(set(a.token_ids)) < len(a.token_ids)          # it repeats itself
    assert b.token_ids == a.token_ids and b.h_seg == pytest.approx(a.h_seg, rel=1e-6)
    assert a.h_seg == pytest.approx(raw_h_seg(plain, context, a.token_ids), rel=1e-4)
    assert shaped.generation_config.repetition_penalty == 2.0 and shaped.generation_config.min_p == 0.3
    c = TransformersGenerator(plain, tokenizer).generate([context], [30], seed=3,
                                                         sampling=Sampling(repetition_penalty=2.0))[0]
    assert c.token_ids != a.token_ids
    assert c.h_seg == pytest.approx(raw_h_seg(plain, context, c.token_ids), rel=1e-4)
    d = TransformersGenerator(plain, tokenizer).generate([context], [30], seed=3, sampling=Sampling(top_k=1))[0]
    greedy = TransformersGenerator(plain, tokenizer).generate([context], [30], seed=4,
                                                              sampling=Sampling(temperature=0.0))[0]
    assert d.token_ids == greedy.token_ids                                            # top-k 1 is greedy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generator_log_probs_equal_the_trainers(tokenizer, temperature):
    """Every sampled token carries the generator's log-prob at the sampling temperature over the whole vocabulary:
    what the trainer's old-policy pass computes for it (harness.run.policy.Policy, teacher-forced, in float32). Both run
    the same float32 model here, so the mismatch is rounding: |Δ| < 1e-4; top-p below 1 changes what is sampled,
    not what is compared."""
    from harness.run import policy as policy_mod
    model = peaked(tokenizer, seed=8)
    context = as_ids(chat_prompt(tokenizer, "Who wrote Hamlet?"))
    seg = TransformersGenerator(model, tokenizer).generate(
        [context, context[:-3]], [24, 24], seed=1, sampling=Sampling(temperature=temperature, top_p=0.9))[0]
    assert seg.logprobs is not None and len(seg.logprobs) == len(seg.token_ids) > 3
    batch = policy_mod.tensorize([(context, seg.token_ids, [1] * len(seg.token_ids))], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        old, _ = policy_mod.Policy(model)(batch.input_ids, batch.attention_mask, batch.mask, temperature)
    torch.testing.assert_close(torch.tensor(seg.logprobs), old[0][batch.mask[0].bool()], atol=1e-4, rtol=0)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, top_p=0.9, top_k=50),
                                      Sampling(repetition_penalty=1.3), Sampling(temperature=0.0)],
                         ids=["plain", "warped", "penalty", "greedy"])
def test_a_single_context_samples_what_model_generate_does(tokenizer, sampling):
    """The generator decodes by itself (rows leave the batch as they end); with one row nothing leaves early, so its
    draws are model.generate's with the same seed and processors: the same tokens."""
    model = peaked(tokenizer, seed=2)
    context = as_ids(chat_prompt(tokenizer, "Name a planet."))
    seg = TransformersGenerator(model, tokenizer, stop_strings=("</nothing>",)).generate(
        [context], [24], seed=5, sampling=sampling)[0]
    torch.manual_seed(sampler.request_seed(5, 0))                    # the seed of context 0 of a call with seed 5
    sample = sampling.temperature > 0
    with torch.no_grad():
        ref = model.generate(torch.tensor([context]), attention_mask=torch.ones(1, len(context), dtype=torch.long),
                             max_new_tokens=24, do_sample=sample, temperature=sampling.temperature if sample else None,
                             top_p=sampling.top_p if sample else None, top_k=sampling.top_k,
                             repetition_penalty=sampling.repetition_penalty, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)[0, len(context):].tolist()
    assert seg.token_ids == ref[:len(seg.token_ids)] and len(seg.token_ids) >= min(len(ref), 24) - 1


def test_the_repetition_penalty_reads_each_rows_own_tokens(tokenizer):
    """eval.py --protocol official's sampling (penalty 1.1) on rows of different lengths decoded together
    (left-padded): each row samples what it samples alone, so another row's padding is none of its tokens, and the
    penalty changed the samples. On transformers < 5.20 (vLLM 0.32's environment) transformers' processor refused the
    per-row padding, so the generator applies the penalty itself (`repetition_penalty`): transformers' rule on the
    row's own tokens."""
    from transformers import RepetitionPenaltyLogitsProcessor
    from harness.generation.transformers import repetition_penalty
    model = make_tiny_model(tokenizer, seed=2)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.3)           # tied head, flatter: the penalty moves the top-20
    gen = TransformersGenerator(model, tokenizer, stop_strings=("</nothing>",))
    official = Sampling(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1)
    contexts = [as_ids(chat_prompt(tokenizer, q)) for q in ("a?", "a much longer question than the other one?")]

    def sample(rows, sampling=official):                # each context with its own request seed
        decoding, done = gen.start(sampling), {}
        requests = [decoding.add(contexts[i], 16, seed=100 + i) for i in rows]
        while len(done) < len(requests):
            done.update(decoding.step())
        return [done[r].token_ids for r in requests]
    together = sample([0, 1])
    assert together == sample([0]) + sample([1])
    assert together != sample([0, 1], dataclasses.replace(official, repetition_penalty=1.0))
    scores = torch.randn(1, 12)
    padded = torch.tensor([[0, 0, 5, 9], [3, 5, 9, 5]])
    got = repetition_penalty(padded, scores.repeat(2, 1), 1.1, torch.tensor([2, 0]))
    for row, own in enumerate((padded[:1, 2:], padded[1:])):
        torch.testing.assert_close(got[row], RepetitionPenaltyLogitsProcessor(1.1)(own, scores.clone())[0], rtol=0,
                                   atol=0)


def test_rows_ending_at_once_or_never_starting(tokenizer, tiny_model):
    """Budgets of 0 give empty segments (all of them, or some beside others); rows leaving at different steps keep
    each one's tokens its own: greedy, every row decodes what it decodes alone."""
    gen = TransformersGenerator(tiny_model, tokenizer)
    contexts = [as_ids(chat_prompt(tokenizer, q)) for q in ("a?", "a longer question?", "b?", "c d e?")]
    assert [s.token_ids for s in gen.generate(contexts[:2], [0, 0], seed=0)] == [[], []]
    greedy = Sampling(temperature=0.0)
    together = gen.generate(contexts, [3, 0, 9, 5], seed=0, sampling=greedy)
    alone = [gen.generate([c], [n], seed=0, sampling=greedy)[0] for c, n in zip(contexts, [3, 0, 9, 5])]
    assert [s.token_ids for s in together] == [s.token_ids for s in alone] and together[1].finish_reason == "length"


def test_waiting_contexts_join_the_running_batch(tokenizer, tiny_model):
    """batch_size 2 over 5 contexts of different budgets: a waiting context joins as soon as a row ends (the model
    never sees more than 2 rows, and the call takes fewer forwards than batches run one after another would), and
    every row decodes what it decodes alone (greedy); with sampling, the same seed gives the same segments."""
    contexts = [as_ids(chat_prompt(tokenizer, q)) for q in ("a?", "a much longer question than the others?", "b?",
                                                          "c d e?", "f?")]
    budgets, greedy = [2, 9, 4, 7, 3], Sampling(temperature=0.0)
    rows_seen = []
    hook = tiny_model.register_forward_pre_hook(lambda m, a, kw: rows_seen.append(kw["input_ids"].shape[0]),
                                                with_kwargs=True)
    try:
        together = TransformersGenerator(tiny_model, tokenizer, batch_size=2).generate(contexts, budgets, seed=0,
                                                                                      sampling=greedy)
    finally:
        hook.remove()
    alone = [TransformersGenerator(tiny_model, tokenizer).generate([c], [n], seed=0, sampling=greedy)[0]
             for c, n in zip(contexts, budgets)]
    assert [s.token_ids for s in together] == [s.token_ids for s in alone]
    assert [len(s.token_ids) for s in together] == budgets                 # a random model: no stop before the budget
    assert max(rows_seen) == 2 and len(rows_seen) < 2 + 9 + 7           # batches in turn: max(2, 9) + max(4, 7) + 3
    for i, (a, b) in enumerate(zip(together, alone)):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
        assert abs(a.h_seg - b.h_seg) < 1e-4, i
    gen = TransformersGenerator(tiny_model, tokenizer, batch_size=2)
    sampled = [gen.generate(contexts, budgets, seed=7) for _ in range(2)]
    assert [s.token_ids for s in sampled[0]] == [s.token_ids for s in sampled[1]]


def test_trees_at_their_own_pace_on_a_real_model(tokenizer, tiny_model, real_tools):
    """The tiny model in float32 with the real tools behind random latencies: the asynchronous rollout and the
    lockstep one give the same trees (kinds, parents, forks, rounds, tokens: each request samples with its own
    generator, whoever shares the batch), and the generator's log-probs match the trainer's as closely in both
    (mean k3 of π_old/π_gen, the mismatch metric, at float rounding)."""
    from harness import mismatch
    from harness.run import policy as policy_mod
    prompt = as_ids(chat_prompt(tokenizer, "Where is the Eiffel Tower?"))
    shapes, k3 = [], []
    for lockstep in (True, False):
        gen = FirstCall(TransformersGenerator(tiny_model, tokenizer, batch_size=4), tokenizer, [prompt])
        trajs, stats = tree_rollout([prompt, prompt], gen, Delayed(real_tools, seed=3, most_s=0.05), tokenizer, k=4, gamma=5.0,
                                    max_response_tokens=160, seed=2, lockstep_rollout=lockstep)
        shapes.append([(t.group_id, t.traj_id, t.parent, t.fork_offset, t.round, t.kind, t.response_ids, t.loss_mask)
                       for t in trajs])
        assert stats["branches"] > 0 and stats["tools/search/calls"] >= 2
        batch = policy_mod.tensorize([(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajs],
                                     tokenizer.pad_token_id, "cpu", gen_logp=[t.gen_logp for t in trajs])
        with torch.no_grad():
            old_logp, _ = policy_mod.Policy(tiny_model)(batch.input_ids, batch.attention_mask, batch.mask)
        sums = mismatch.mismatch_stats(old_logp, batch.gen_logp, batch.mask)
        assert float(sums.tokens) > 100
        k3.append(float(sums.k3) / float(sums.tokens))
    assert shapes[0] == shapes[1]
    print("k3 lockstep, asynchronous:", k3)
    assert k3[1] < 1e-9 and k3[0] < 1e-9, k3
