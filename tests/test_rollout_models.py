"""The rollout on real token ids: a tiny random transformers model with the real tokenizer and the
real local tools, and the vLLM adapter against the stand-in module (tests/fake_vllm.py)."""
import pytest
import torch

import rollout
import tools
from rollout import Segment, TransformersGenerator, VLLMGenerator, tree_rollout
from tests import fake_vllm
from tests.conftest import make_tiny_model


def chat_prompt(tokenizer, question):
    return tokenizer.apply_chat_template(
        [{"role": "system", "content": tools.SYSTEM_PROMPT}, {"role": "user", "content": question}],
        add_generation_prompt=True, tokenize=True, return_dict=False)


def as_ids(x):
    return list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x)


class ForcedFirstCall:
    """Wraps a generator: the first segment of each trajectory is a scripted search call (a random
    model never writes one), later segments come from the real model. Records every segment."""

    def __init__(self, inner, tokenizer, prompt_len):
        self.inner, self.tok, self.prompt_len = inner, tokenizer, prompt_len
        self.vocab_size = inner.vocab_size
        self.log = []  # (context, segment)

    def generate(self, contexts, max_new_tokens, seed):
        real = [i for i, c in enumerate(contexts) if len(c) > self.prompt_len]
        out = [None] * len(contexts)
        if real:
            segs = self.inner.generate([contexts[i] for i in real], [max_new_tokens[i] for i in real], seed)
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
    t = tools.Tools(tools.make_search("bm25", topk=1))   # short results keep the random model's turns short
    yield t
    t.close()


def test_transformers_generator_segments(tokenizer, tiny_model):
    gen = TransformersGenerator(tiny_model, tokenizer, temperature=1.0, top_p=0.9, batch_size=3)
    ctx = [as_ids(chat_prompt(tokenizer, q)) for q in ("a?", "a longer question here?", "b?", "c?")]
    segs = gen.generate(ctx, [5, 12, 7, 1], seed=3)
    assert [len(s.token_ids) <= n for s, n in zip(segs, [5, 12, 7, 1])] == [True] * 4
    for s in segs:
        assert s.finish_reason in ("tool", "answer", "eos", "length")
        n = min(len(s.token_ids), 20)
        assert 0 <= s.h_seg <= n * 1.0 + 1e-6          # each position contributes ≤ log(10)/log|V| < 1
        assert s.text == tokenizer.decode(s.token_ids)
    again = gen.generate(ctx, [5, 12, 7, 1], seed=3)
    assert [s.token_ids for s in segs] == [s.token_ids for s in again]


def test_transformers_generator_cuts_at_stop_strings(tokenizer):
    """A model that always emits the tokens of a closing tag: the segment ends right after it."""
    model = make_tiny_model(tokenizer)
    target = tokenizer.encode("x </search> tail", add_special_tokens=False)

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
    gen = TransformersGenerator(model, tokenizer, temperature=1.0)
    seg = gen.generate([as_ids(chat_prompt(tokenizer, "q"))], [20], seed=0)[0]
    assert seg.finish_reason == "tool"
    assert seg.text.endswith("</search>")
    assert seg.token_ids == target[:len(seg.token_ids)] and "tail" not in seg.text


def test_full_tree_with_tiny_model_and_real_tools(tokenizer, tiny_model, real_tools):
    prompts = [as_ids(chat_prompt(tokenizer, "Where is the Eiffel Tower?"))]
    inner = TransformersGenerator(tiny_model, tokenizer, temperature=1.0)
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


# ---------------------------------------------------------------------------------------------- vLLM

@pytest.fixture(scope="module")
def tiny_model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(tokenizer, seed=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_vllm_adapter_matches_transformers_backend(tokenizer, tiny_model_dir):
    """Greedy decoding: both backends sample the same ids and compute the same H_seg (SPEC §1)."""
    from transformers import AutoModelForCausalLM
    vgen = VLLMGenerator(str(tiny_model_dir), temperature=0.0, vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    assert llm.kwargs["enable_prefix_caching"] is True
    tgen = TransformersGenerator(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer,
                                 temperature=0.0)
    assert vgen.vocab_size == tgen.vocab_size
    ctx = [as_ids(chat_prompt(tokenizer, q)) for q in ("first?", "second question?")]
    a = vgen.generate(ctx, [25, 8], seed=0)
    b = tgen.generate(ctx, [25, 8], seed=0)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert x.h_seg == pytest.approx(y.h_seg, abs=1e-4)
        assert x.h_seg > 0


def test_vllm_adapter_reasons_weights_and_sleep(tokenizer, tiny_model_dir):
    vgen = VLLMGenerator(str(tiny_model_dir), temperature=1.0, vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    ctx = [as_ids(chat_prompt(tokenizer, "q?"))]
    seg = vgen.generate(ctx, [6], seed=4)[0]
    assert seg.finish_reason in ("length", "eos") and len(seg.token_ids) <= 6
    assert vgen.generate(ctx, [6], seed=4)[0].token_ids == seg.token_ids     # per-request seeds
    # weight sync: new weights change the output, and cached prefixes are dropped
    new = make_tiny_model(tokenizer, seed=99)
    vgen.load_weights(new.state_dict().items())
    assert "reset_prefix_cache" in llm.events
    assert torch.equal(llm.model.model.embed_tokens.weight, new.model.embed_tokens.weight)
    vgen.sleep()
    vgen.wake_up()
    assert llm.events[-2:] == ["sleep1", "wake_up"]


def test_vllm_stop_reason_mapping(tokenizer, tiny_model_dir, monkeypatch):
    from types import SimpleNamespace
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)

    def fake_generate(prompts, params, use_tqdm=False):
        cases = [("stop", "</search>"), ("stop", "</answer>"), ("stop", None), ("length", None), ("stop", 7)]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=None, finish_reason=f,
                                                         stop_reason=r, text="x")]) for f, r in cases]
    monkeypatch.setattr(vgen.llm, "generate", fake_generate)
    reasons = [s.finish_reason for s in vgen.generate([[1]] * 5, [4] * 5, seed=0)]
    assert reasons == ["tool", "answer", "eos", "length", "eos"]


def test_vllm_backend_missing_is_a_clear_error():
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ImportError, match="requirements-vllm.txt"):
        VLLMGenerator("any")


def test_segment_entropy_is_from_the_raw_distribution(tokenizer, tiny_model):
    """With temperature and top-p on, H_seg still uses the model's own (T = 1) top-10 log-probs,
    recomputed here by a plain forward pass over the sampled tokens."""
    gen = TransformersGenerator(tiny_model, tokenizer, temperature=0.5, top_p=0.9)
    ctx = as_ids(chat_prompt(tokenizer, "entropy?"))
    seg = gen.generate([ctx], [30], seed=11)[0]
    with torch.no_grad():
        logits = tiny_model(torch.tensor([ctx + seg.token_ids])).logits[0].float()
    first = logits[len(ctx) - 1: len(ctx) - 1 + min(20, len(seg.token_ids))]
    top = torch.log_softmax(first, -1).topk(10, -1).values.tolist()
    assert seg.h_seg == pytest.approx(rollout.segment_entropy(top, tiny_model.config.vocab_size), rel=1e-4)
