"""vllm_generation.VLLMGenerator against tests/fake_vllm.py, a stand-in that behaves like vLLM 0.32 where it matters (the
executor modes, where each engine lands, platforms with and without sleep mode, the in-place reload and its name
checks, the CPU build's packed LM head, int64 seeds, sleep levels): the same ids and H_seg as the transformers
backend, one engine per rank on its own GPU index, the weight-sync cycle, and clear errors. The real engine:
tests/test_vllm_engine.py."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from harness.run import policy as policy_mod
from harness.generation import TransformersGenerator
from harness.generation.vllm import VLLMGenerator
from rollout import Sampling
from tests import fake_vllm
from tests.conftest import as_ids, chat_prompt, free_port, make_tiny_model

GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(tokenizer, seed=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def one_process(monkeypatch):
    """A process without torchrun, whose environment the stand-in may change; the stand-in plays a GPU."""
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    fake_vllm.use_platform("cuda")


def test_vllm_adapter_matches_transformers_backend(tokenizer, tiny_model_dir, one_process):
    """Greedy decoding: both backends sample the same ids and compute the same H_seg (algorithm.md §1)."""
    from transformers import AutoModelForCausalLM
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    tgen = TransformersGenerator(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer)
    assert vgen.vocab_size == tgen.vocab_size
    ctx = [as_ids(chat_prompt(tokenizer, q)) for q in ("first?", "second question?")]
    a = vgen.generate(ctx, [25, 8], seed=0, sampling=GREEDY)
    b = tgen.generate(ctx, [25, 8], seed=0, sampling=GREEDY)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert x.h_seg == pytest.approx(y.h_seg, abs=1e-4)
        assert x.h_seg > 0


def test_one_process_engine_settings(tiny_model_dir, one_process):
    """Without torchrun: the default executor, kept in this process (else model_executor does not exist), bf16,
    the context length the trainer asks for, raw log-probs, sleep mode."""
    vgen = VLLMGenerator(str(tiny_model_dir), max_model_len=321, vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    assert llm.kwargs["max_model_len"] == 321 and llm.kwargs["dtype"] == "bfloat16"
    assert llm.kwargs["logprobs_mode"] == "raw_logprobs" and llm.kwargs["enable_sleep_mode"] is True
    assert llm.kwargs["enable_prefix_caching"] is True and "distributed_executor_backend" not in llm.kwargs
    assert llm.device == "cuda:0" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "enforce_eager" not in llm.kwargs and "kv_cache_memory_bytes" not in llm.kwargs
    assert vgen.model() is not None


def test_cpu_build_engine_settings(tiny_model_dir, one_process):
    """vLLM's CPU build has no sleep mode (vLLM rejects enable_sleep_mode=True there): the engine stays awake, eager,
    with an explicit KV cache; sleep() does nothing."""
    fake_vllm.use_platform("cpu")
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    assert llm.kwargs["enable_sleep_mode"] is False and llm.kwargs["enforce_eager"] is True
    assert llm.kwargs["kv_cache_memory_bytes"] == VLLMGenerator.CPU_KV_CACHE_BYTES and llm.device == "cpu"
    # chunked prefill off: a seeded request whose prompt is split over engine steps crashes the CPU runner
    assert llm.kwargs["enable_chunked_prefill"] is False
    assert llm.kwargs["max_num_batched_tokens"] >= max(llm.kwargs.get("max_model_len") or 0, 8192)
    vgen.sleep()
    assert not vgen.asleep and not any(e.startswith("sleep") for e in llm.events)
    with pytest.raises(ValueError, match="Sleep mode is not supported"):
        VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm, enable_sleep_mode=True)


def test_multiprocess_engine_is_out_of_reach(tiny_model_dir, one_process):
    """vLLM's default (multiprocessing on) keeps the model in another process: a clear error, not AttributeError."""
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    vgen.llm = fake_vllm.LLM(str(tiny_model_dir), seed=0)
    assert not hasattr(vgen.llm.llm_engine, "model_executor")
    with pytest.raises(RuntimeError, match="another process"):
        vgen.update_weights([])


def test_unknown_engine_argument_is_rejected(tiny_model_dir, one_process):
    with pytest.raises(TypeError, match="unexpected keyword argument 'swap_space_gb'"):
        VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm, swap_space_gb=4)


def test_weight_sync_cycle(tokenizer, tiny_model_dir, one_process, tmp_path):
    """sleep (level 2 drops the weights) -> wake weights -> every parameter written -> wake KV -> prefix cache reset;
    afterwards the engine samples exactly what an engine built from the new weights samples."""
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    ctx = [as_ids(chat_prompt(tokenizer, "q?"))]
    before = vgen.generate(ctx, [6], seed=4)[0]
    assert vgen.generate(ctx, [6], seed=4)[0].token_ids == before.token_ids     # per-request seeds
    vgen.sleep()
    with pytest.raises(RuntimeError, match="sleep"):
        vgen.generate(ctx, [6], seed=4)
    new = make_tiny_model(tokenizer, seed=99)
    n_params = len(list(new.named_parameters()))
    vgen.update_weights(policy_mod.full_named_parameters(policy_mod.Policy(new)))
    assert llm.events[-6:] == ["sleep2", "wake_up:weights", f"load_weights:{n_params}", "reload_weights",
                               "wake_up:kv_cache", "reset_prefix_cache"]
    new.save_pretrained(tmp_path / "new")
    tokenizer.save_pretrained(tmp_path / "new")
    fresh = VLLMGenerator(str(tmp_path / "new"), vllm_module=fake_vllm)
    with torch.no_grad():                                  # the engine holds bf16-rounded weights, like vLLM
        for p in fake_vllm.LLM.instances[-1].model.parameters():
            p.copy_(p.to(torch.bfloat16))
    after = vgen.generate(ctx, [6], seed=4)[0]
    assert after.token_ids == fresh.generate(ctx, [6], seed=4)[0].token_ids
    assert after.h_seg == pytest.approx(fresh.generate(ctx, [6], seed=4)[0].h_seg, rel=1e-6)


def test_the_sync_is_gathered_in_the_engines_dtype(tokenizer, tiny_model_dir, one_process):
    """The engine holds bfloat16 weights: the run gathers them in bfloat16 (Run.generator_weights passes the
    generator's weight_dtype to policy.generator_weights; under FSDP2 each shard is cast before its all-gather, whose
    peak tests/test_bench.py counts), the values a float32 gather cast afterwards gives. The transformers
    generator's weight dtype is its model's: the policy's own LM goes by reference, nothing copied or cast."""
    from harness.run.watchdog import WatchedGenerator
    vgen = WatchedGenerator(VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm))
    lm = make_tiny_model(tokenizer, seed=4)
    params = dict(lm.named_parameters())
    sent = list(policy_mod.generator_weights(policy_mod.Policy(lm), dtype=vgen.weight_dtype))
    assert vgen.weight_dtype == torch.bfloat16 and {t.dtype for _, t in sent} == {torch.bfloat16}
    assert all(torch.equal(t, params[name].detach().to(torch.bfloat16)) for name, t in sent)
    vgen.update_weights(sent)
    tgen = WatchedGenerator(TransformersGenerator(lm, tokenizer))
    own = list(policy_mod.generator_weights(policy_mod.Policy(lm), dtype=tgen.weight_dtype))
    assert tgen.weight_dtype == torch.float32 and all(t.data_ptr() == params[name].data_ptr() for name, t in own)


def test_each_request_samples_with_its_own_seed(tokenizer, tiny_model_dir, one_process):
    """A branch and its parent share their context: with one seed for every request of a call they would sample the
    same tokens. Two identical contexts in one call sample differently, and the same call again samples the same."""
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    ctx = as_ids(chat_prompt(tokenizer, "q?"))
    first = [s.token_ids for s in vgen.generate([ctx, ctx], [6, 6], seed=3)]
    assert first[0] != first[1]
    assert [s.token_ids for s in vgen.generate([ctx, ctx], [6, 6], seed=3)] == first


def test_weight_sync_errors(tokenizer, tiny_model_dir, one_process):
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    params = list(make_tiny_model(tokenizer, seed=5).named_parameters())
    with pytest.raises(ValueError, match="rejected a trainer parameter: .*'lm.model.norm.weight'"):
        vgen.update_weights([("lm." + params[-1][0], params[-1][1])])          # a wrapper's prefix left on
    with pytest.raises(RuntimeError, match=r"did not write 1 engine parameter"):
        vgen.update_weights(params[:-1])
    with pytest.raises(ValueError, match="tied"):                            # a tied LM head without the embedding
        vgen.update_weights(params[1:] + [("lm_head.weight", params[0][1])])
    vgen.update_weights(params + [("lm_head.weight", params[0][1])])          # with it: skipped, as vLLM does


def _engine_worker(rank, world, port, model_dir, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    torch.distributed.init_process_group("gloo")
    try:
        vgen = VLLMGenerator(model_dir, seed=10 + rank, vllm_module=fake_vllm)
        llm = fake_vllm.LLM.instances[-1]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"device": llm.device, "kwargs": {k: str(v) for k, v in llm.kwargs.items()},
                       "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
                       "reachable": vgen.model() is not None}, f)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_each_rank_builds_its_engine_on_its_own_gpu(tiny_model_dir, tmp_path):
    """Under torchrun (2 gloo ranks): external_launcher, tensor parallel 1, rank r's engine on cuda:r, in-process."""
    mp.start_processes(_engine_worker, args=(2, free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert torch.device(got["device"]).index == rank
        assert got["kwargs"]["distributed_executor_backend"] == "external_launcher"
        assert got["kwargs"]["tensor_parallel_size"] == "1" and got["kwargs"]["seed"] == str(10 + rank)
        assert got["multiprocessing"] == "0" and got["reachable"]


def test_vllm_stop_reason_mapping(tiny_model_dir, one_process, monkeypatch):
    from types import SimpleNamespace
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)

    def fake_generate(prompts, params, use_tqdm=False):
        cases = [("stop", "</search>"), ("stop", "</answer>"), ("stop", None), ("length", None), ("stop", 7)]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=None, finish_reason=f,
                                                         stop_reason=r, text="x")]) for f, r in cases]
    monkeypatch.setattr(vgen.llm, "generate", fake_generate)
    reasons = [s.finish_reason for s in vgen.generate([[1]] * 5, [1] * 5, seed=0)]
    assert reasons == ["tool", "answer", "eos", "length", "eos"]


def test_vllm_backend_missing_is_a_clear_error():
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ValueError, match="--backend vllm needs vllm: pip install -r requirements-vllm.txt"):
        VLLMGenerator("any")


def test_cpu_build_tied_head_is_refreshed_after_a_sync(tokenizer, tiny_model_dir, one_process, tmp_path):
    """On vLLM's CPU build the LM head computes with a packed copy of its weight; a head tied to the embedding is not
    reloaded as a layer of its own, so the sync re-runs its process_weights_after_loading. After new weights the
    engine samples what an engine built from them samples (the stand-in keeps the stale copy otherwise)."""
    fake_vllm.use_platform("cpu")
    vgen = VLLMGenerator(str(tiny_model_dir), dtype="float32", vllm_module=fake_vllm)
    new = make_tiny_model(tokenizer, seed=7)
    vgen.update_weights(policy_mod.full_named_parameters(policy_mod.Policy(new)))
    new.save_pretrained(tmp_path / "new")
    tokenizer.save_pretrained(tmp_path / "new")
    fresh = VLLMGenerator(str(tmp_path / "new"), dtype="float32", vllm_module=fake_vllm)
    ctx = [as_ids(chat_prompt(tokenizer, "q?"))]
    a, b = vgen.generate(ctx, [8], seed=0, sampling=GREEDY)[0], fresh.generate(ctx, [8], seed=0, sampling=GREEDY)[0]
    assert a.token_ids == b.token_ids and a.h_seg == pytest.approx(b.h_seg, rel=1e-6)


def test_request_seeds_fit_int64(tokenizer, tiny_model_dir, one_process):
    """vLLM's GPU runner keeps per-request seeds in an int64 array: a call's seed far past 2^63 (the stand-in raises
    OverflowError on a seed outside int64) still gives seeds that fit (sampler.request_seed), distinct per request."""
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    ctx = as_ids(chat_prompt(tokenizer, "q?"))
    out = vgen.generate([ctx, ctx], [4, 4], seed=2**80 + 7)
    assert out[0].token_ids != out[1].token_ids


def test_log_probs_only_where_h_seg_reads_them(tokenizer, tiny_model_dir, one_process):
    """vLLM detokenises every log-prob position it returns; H_seg reads the first n_entropy: no segment may ask for
    more (40-token segments, n_entropy 20 -> at most 20 positions each), and the tokens still run to the budget."""
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    ctx = as_ids(chat_prompt(tokenizer, "q?"))
    out = vgen.generate([ctx, ctx], [40, 40], seed=1)
    assert [s.finish_reason for s in out] == ["length", "length"] and [len(s.token_ids) for s in out] == [40, 40]
    assert llm.stats["logprob_positions"] == 2 * 20


class ScriptedEngine:
    """Continues every prompt with the tokens of `script` (after `context`), stopping as vLLM 0.32 does: after
    max_tokens, or after the token that completes the first stop string of its own output text."""

    def __init__(self, tokenizer, context, script):
        self.tokenizer, self.context, self.script = tokenizer, context, script

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace
        outs = []
        for prompt, sp in zip(prompts, params):
            done = prompt["prompt_token_ids"][len(self.context):]
            assert self.script[:len(done)] == done
            ids, text, finish, reason = [], "", "length", None
            for tok in self.script[len(done):len(done) + sp.max_tokens]:
                ids.append(tok)
                text = self.tokenizer.decode(done + ids)[len(self.tokenizer.decode(done)):]
                reason = next((s for s in sp.stop if s in text), None)
                if reason is not None:
                    finish = "stop"
                    break
            logprobs = [{t: fake_vllm.Logprob(-0.5, 1)} for t in ids] if sp.logprobs else None
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, text=text, logprobs=logprobs,
                                                                 finish_reason=finish, stop_reason=reason)]))
        return outs


def test_stop_string_across_the_two_requests(tokenizer, tiny_model_dir, one_process, monkeypatch):
    """A segment is sampled in two requests (the first n_entropy tokens with log-probs, then the rest): wherever the
    boundary falls, also inside `</search>`, the segment ends right after the tool tag, as one request would."""
    context = as_ids(chat_prompt(tokenizer, "q?"))
    text = "<think> look </think> <search> capital of France </search> then more words <answer> x </answer>"
    script = tokenizer.encode(text, add_special_tokens=False)
    want = tokenizer.encode("<think> look </think> <search> capital of France </search>", add_special_tokens=False)
    assert script[:len(want)] == want
    for n_entropy in range(1, len(want) + 2):
        vgen = VLLMGenerator(str(tiny_model_dir), n_entropy=n_entropy, vllm_module=fake_vllm)
        monkeypatch.setattr(vgen.llm, "generate", ScriptedEngine(tokenizer, context, script).generate)
        seg = vgen.generate([context], [len(script)], seed=0)[0]
        assert (seg.token_ids, seg.finish_reason) == (want, "tool"), n_entropy
        assert seg.text.endswith("</search>") and seg.h_seg > 0


def test_the_run_formats_stop_strings_reach_the_engine(tokenizer, tiny_model_dir, one_process, monkeypatch):
    """--tool_format hermes: the engine stops at `</tool_call>` (not at a `</search>` written before it), wherever
    the segment's two requests split, and the segment is a tool call."""
    context = as_ids(chat_prompt(tokenizer, "q?"))
    head = '<think> no </search> here </think>\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
    script = tokenizer.encode(head + " then more <answer> x </answer>", add_special_tokens=False)
    want = tokenizer.encode(head, add_special_tokens=False)
    assert script[:len(want)] == want
    for n_entropy in (1, 5, len(want) - 1, len(want) + 1):
        vgen = VLLMGenerator(str(tiny_model_dir), n_entropy=n_entropy, vllm_module=fake_vllm,
                             stop_strings=("</tool_call>", "</answer>"))
        monkeypatch.setattr(vgen.llm, "generate", ScriptedEngine(tokenizer, context, script).generate)
        seg = vgen.generate([context], [len(script)], seed=0)[0]
        assert (seg.token_ids, seg.finish_reason) == (want, "tool"), n_entropy


def _close_worker(rank, world, port, model_dir, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from harness.run import parallel
    torch.distributed.init_process_group("gloo")
    VLLMGenerator(model_dir, vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    parallel.on_close(llm.llm_engine.engine_core.shutdown)
    parallel.close()
    with open(os.path.join(out_dir, f"close{rank}.json"), "w") as f:
        json.dump({"events": llm.events[-1:], "initialized": torch.distributed.is_initialized()}, f)


def test_engine_shuts_down_before_the_process_group(tiny_model_dir, tmp_path):
    """vLLM's engine shutdown destroys the default process group and fails if the trainer destroyed it first:
    parallel.close() runs the engine's shutdown (registered by train.py) after its barrier, then leaves the group."""
    mp.start_processes(_close_worker, args=(2, free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"close{rank}.json").read_text())
        assert got == {"events": ["shutdown"], "initialized": False}


def test_a_temperature_vllm_refuses_is_refused_before_any_work(tokenizer, tiny_model_dir, one_process):
    """vLLM 0.32's SamplingParams refuses a temperature above 2 (the stand-in too), which would end a run at its
    first generation, after the model and the engine were built: the config refuses it at parse time, naming the
    flag; 2 is accepted, and the transformers backend samples at any positive temperature."""
    from harness import config
    from harness.cli import UserError
    with pytest.raises(UserError, match=r"^--temperature 2.5: vLLM samples at temperatures up to 2"):
        config.parse_config(["--backend", "vllm", "--temperature", "2.5"])
    assert config.parse_config(["--backend", "vllm", "--temperature", "2"]).temperature == 2.0
    assert config.parse_config(["--temperature", "2.5"]).temperature == 2.5
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    ctx = as_ids(chat_prompt(tokenizer, "q?"))
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        vgen.generate([ctx], [4], seed=0, sampling=Sampling(temperature=2.5))
    assert len(vgen.generate([ctx], [4], seed=0, sampling=Sampling(temperature=2.0))[0].token_ids) == 4


def test_a_failed_rollouts_requests_are_aborted(tokenizer, tiny_model_dir, one_process):
    """A rollout that raises mid-way (a tool failing) leaves its decoding's requests in the engine: a segment's tail
    and a head not yet run. The next decoding (and a sleep, a sync, close) aborts them first (LLMEngine.abort_request),
    so the engine holds none and the next call gets its own segments; without it they finished into the next
    decoding's step, which knew no such request."""
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    ctx = as_ids(chat_prompt(tokenizer, "q?"))
    want = [s.token_ids for s in vgen.generate([ctx, ctx], [6, 30], seed=1)]
    failed = vgen.start(Sampling())
    failed.add(ctx, 6, seed=5)
    failed.add(ctx, 30, seed=6)
    assert len(failed.step()) == 1                    # the first ends; the second's tail is now in the engine
    failed.add(ctx, 8, seed=7)                        # and a head that never ran
    assert len(llm.queued) == 2
    assert [s.token_ids for s in vgen.generate([ctx, ctx], [6, 30], seed=1)] == want
    assert len(llm.aborted) == 2 and not llm.queued
    failed = vgen.start(Sampling())
    failed.add(ctx, 8, seed=7)
    vgen.sleep()                                      # the engine sleeps with no request of a failed rollout
    assert len(llm.aborted) == 3 and not llm.queued and llm.events[-1] == "sleep2"
