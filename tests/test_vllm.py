"""generation.VLLMGenerator against tests/fake_vllm.py, a stand-in that behaves like vLLM 0.32 where it matters (the
executor modes, where each engine lands, name checks in load_weights, sleep levels): the same ids and H_seg as the
transformers backend, one engine per rank on its own GPU index, the weight-sync cycle, and clear errors."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

import policy as policy_mod
from generation import TransformersGenerator, VLLMGenerator
from tests import fake_vllm
from tests.conftest import make_tiny_model
from tests.test_rollout_models import as_ids, chat_prompt
from tests.test_train import free_port


@pytest.fixture(scope="module")
def tiny_model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(tokenizer, seed=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def one_process(monkeypatch):
    """A process without torchrun, whose environment the stand-in may change."""
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


def test_vllm_adapter_matches_transformers_backend(tokenizer, tiny_model_dir, one_process):
    """Greedy decoding: both backends sample the same ids and compute the same H_seg (SPEC §1)."""
    from transformers import AutoModelForCausalLM
    vgen = VLLMGenerator(str(tiny_model_dir), temperature=0.0, vllm_module=fake_vllm)
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


def test_one_process_engine_settings(tiny_model_dir, one_process):
    """Without torchrun: the default executor, kept in this process (else model_executor does not exist), bf16,
    the context length the trainer asks for, raw log-probs, sleep mode."""
    vgen = VLLMGenerator(str(tiny_model_dir), max_model_len=321, vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    assert llm.kwargs["max_model_len"] == 321 and llm.kwargs["dtype"] == "bfloat16"
    assert llm.kwargs["logprobs_mode"] == "raw_logprobs" and llm.kwargs["enable_sleep_mode"] is True
    assert llm.kwargs["enable_prefix_caching"] is True and "distributed_executor_backend" not in llm.kwargs
    assert llm.device == "cuda:0" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert vgen.model() is not None


def test_multiprocess_engine_is_out_of_reach(tiny_model_dir, one_process):
    """vLLM's default (multiprocessing on) keeps the model in another process: a clear error, not AttributeError."""
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    vgen.llm = fake_vllm.LLM(str(tiny_model_dir), seed=0)
    assert not hasattr(vgen.llm.llm_engine, "model_executor")
    with pytest.raises(RuntimeError, match="another process"):
        vgen.load_weights([])


def test_unknown_engine_argument_is_rejected(tiny_model_dir, one_process):
    with pytest.raises(TypeError, match="unexpected keyword argument 'swap_space_gb'"):
        VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm, swap_space_gb=4)


def test_weight_sync_cycle(tokenizer, tiny_model_dir, one_process, tmp_path):
    """sleep (level 2 drops the weights) -> wake weights -> every parameter written -> wake KV -> prefix cache reset;
    afterwards the engine samples exactly what an engine built from the new weights samples."""
    vgen = VLLMGenerator(str(tiny_model_dir), temperature=1.0, vllm_module=fake_vllm)
    llm = fake_vllm.LLM.instances[-1]
    ctx = [as_ids(chat_prompt(tokenizer, "q?"))]
    before = vgen.generate(ctx, [6], seed=4)[0]
    assert vgen.generate(ctx, [6], seed=4)[0].token_ids == before.token_ids     # per-request seeds
    vgen.sleep()
    with pytest.raises(RuntimeError, match="sleep"):
        vgen.generate(ctx, [6], seed=4)
    new = make_tiny_model(tokenizer, seed=99)
    n_params = len(list(new.named_parameters()))
    vgen.wake_up(policy_mod.full_named_parameters(policy_mod.Policy(new), torch.bfloat16))
    assert llm.events[-(n_params + 4):] == ["sleep2", "wake_up:weights"] + ["load_weights:1"] * n_params + \
        ["wake_up:kv_cache", "reset_prefix_cache"]
    new.save_pretrained(tmp_path / "new")
    tokenizer.save_pretrained(tmp_path / "new")
    fresh = VLLMGenerator(str(tmp_path / "new"), temperature=1.0, vllm_module=fake_vllm)
    with torch.no_grad():                                  # the engine holds bf16-rounded weights, like vLLM
        for p in fake_vllm.LLM.instances[-1].model.parameters():
            p.copy_(p.to(torch.bfloat16))
    after = vgen.generate(ctx, [6], seed=4)[0]
    assert after.token_ids == fresh.generate(ctx, [6], seed=4)[0].token_ids
    assert after.h_seg == pytest.approx(fresh.generate(ctx, [6], seed=4)[0].h_seg, rel=1e-6)


def test_each_request_samples_with_its_own_seed(tokenizer, tiny_model_dir, one_process):
    """A branch and its parent share their context: with one seed for every request of a call they would sample the
    same tokens. Two identical contexts in one call sample differently, and the same call again samples the same."""
    vgen = VLLMGenerator(str(tiny_model_dir), temperature=1.0, vllm_module=fake_vllm)
    ctx = as_ids(chat_prompt(tokenizer, "q?"))
    first = [s.token_ids for s in vgen.generate([ctx, ctx], [6, 6], seed=3)]
    assert first[0] != first[1]
    assert [s.token_ids for s in vgen.generate([ctx, ctx], [6, 6], seed=3)] == first


def test_weight_sync_errors(tokenizer, tiny_model_dir, one_process):
    vgen = VLLMGenerator(str(tiny_model_dir), vllm_module=fake_vllm)
    params = list(make_tiny_model(tokenizer, seed=5).named_parameters())
    with pytest.raises(ValueError, match="rejected trainer parameter 'lm.model.norm.weight'"):
        vgen.load_weights([("lm." + params[-1][0], params[-1][1])])          # a wrapper's prefix left on
    with pytest.raises(RuntimeError, match=r"did not write 1 engine parameter"):
        vgen.load_weights(params[:-1])
    with pytest.raises(ValueError, match="tied"):                            # a tied LM head sent on its own
        vgen.load_weights(params + [("lm_head.weight", params[0][1])])
    vgen.load_weights(params)


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
    reasons = [s.finish_reason for s in vgen.generate([[1]] * 5, [4] * 5, seed=0)]
    assert reasons == ["tool", "answer", "eos", "length", "eos"]


def test_vllm_backend_missing_is_a_clear_error():
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ValueError, match="--backend vllm needs vllm: pip install -r requirements-vllm.txt"):
        VLLMGenerator("any")
