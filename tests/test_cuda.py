"""The CUDA paths on a GPU: the chunked log-prob/entropy function (values and gradients against the direct
reference, float32 and bfloat16), the policy under bf16 autocast, the collectives on an nccl process group, a
checkpoint round trip of a GPU policy, its AdamW state and the RNG states, and transformers generation on the GPU.

No weights and no downloaded tokenizer: tiny Llama / Qwen3 models with random weights and a byte-level BPE trained
offline on the project's text (bench/gpu_check.py:build_tokenizer). Skipped without CUDA, except the checkpoint
round trip's CPU case, which runs in the default suite; `AEPO_TEST_DEVICE=cpu python -m pytest tests/test_cuda.py`
runs them all on the CPU (gloo instead of nccl) to check the tests themselves.
"""
import math
import os
import random
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from harness.run import checkpoint
from harness import generation
import loss
from harness.run import parallel
from harness.run import policy as policy_mod
import tools

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402

DEVICE = os.environ.get("AEPO_TEST_DEVICE", "cuda")
needs_device = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                  reason="needs a CUDA GPU (AEPO_TEST_DEVICE=cpu runs these tests on the CPU)")
QUESTIONS = ["Who wrote Hamlet?", "What is the capital of Zhejiang Province, China?", "Why?",
             "Which mountain range is in the United States, and how high is its highest peak?", "Name a river."]


@pytest.fixture(scope="module")
def small_tokenizer():
    return gpu_check.build_tokenizer(vocab_size=1024)


def tiny_lm(arch: str, vocab: int, seed: int = 0, device: str = DEVICE, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**shape, **overrides})).to(device).eval()


def batch(vocab: int, seed: int = 1, device: str = DEVICE):
    """input_ids (3, 40), attention_mask with one right-padded row (as the trainer pads), mask (3, 39)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 40), generator=gen)
    attn = torch.ones_like(ids)
    attn[1, 30:] = 0
    mask = torch.zeros(3, 39)
    mask[:, 10:] = 1
    mask[1, 29:] = 0
    return ids.to(device), attn.to(device), mask.to(device)


# ---------------------------------------------------------------------------------------------------------------------
# loss.logprobs_and_entropy


@needs_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_and_entropy_match_the_direct_reference(dtype):
    torch.manual_seed(0)
    n, d, v, temperature = 300, 64, 1000, 0.7
    hidden0 = torch.randn(n, d, device=DEVICE).to(dtype)
    weight0 = (torch.randn(v, d, device=DEVICE) * 3 * d ** -0.5).to(dtype)
    ids = torch.randint(0, v, (n,), device=DEVICE)
    g_logp, g_entropy = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)

    def run(fn):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        logp, entropy = fn(hidden, weight)
        ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
        return logp.detach(), entropy.detach(), hidden.grad, weight.grad

    def direct(hidden, weight):
        logits = hidden.float() @ weight.float().T
        return loss.token_logprobs(logits, ids, temperature), loss.token_entropy(logits, temperature)

    def chunked(hidden, weight):
        return loss.logprobs_and_entropy(hidden, weight, ids, temperature, chunk_size=128)

    reference, got = run(direct), run(chunked)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):       # must still compute in float32
        in_autocast = run(chunked)
    assert got[0].dtype == got[1].dtype == torch.float32 and got[0].device.type == DEVICE
    assert got[2].dtype == got[3].dtype == dtype
    assert ((got[1] > 0) & (got[1] < math.log(v))).all()
    for name, a, b in zip(("logp", "entropy"), got[:2], reference[:2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(("grad hidden", "grad weight"), got[2:], reference[2:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=name)
    for a, b in zip(got, in_autocast, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# policy.Policy under bf16 autocast


def _forward_backward(policy, ids, attn, mask, bf16: bool):
    policy.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
        logp, entropy = policy(ids, attn, mask, 1.0, 16)
    (-(logp * mask).sum() / mask.sum()).backward()
    return logp.detach(), entropy.detach(), torch.cat([p.grad.flatten() for p in policy.parameters()])


@needs_device
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_policy_under_bf16_autocast_is_float32_finite_and_close_to_float32(arch):
    vocab = 300
    policy = policy_mod.Policy(tiny_lm(arch, vocab, initializer_range=0.1))
    ids, attn, mask = batch(vocab)
    logp32, entropy32, grad32 = _forward_backward(policy, ids, attn, mask, bf16=False)
    logp16, entropy16, grad16 = _forward_backward(policy, ids, attn, mask, bf16=True)
    with torch.no_grad():                                     # reference: full logits of the plain model
        logits = policy.lm(input_ids=ids, attention_mask=attn).logits[:, :-1]
    torch.testing.assert_close(logp32, loss.token_logprobs(logits, ids[:, 1:]) * mask, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(entropy32, loss.token_entropy(logits) * mask, atol=1e-4, rtol=1e-4)
    assert logp16.dtype == entropy16.dtype == torch.float32
    assert torch.isfinite(logp16).all() and torch.isfinite(entropy16).all() and torch.isfinite(grad16).all()
    assert (logp16[mask == 0] == 0).all() and (logp16[mask == 1] < 0).all()
    assert (logp16 - logp32).abs().max() < 0.1 and (entropy16 - entropy32).abs().max() < 0.1
    assert torch.nn.functional.cosine_similarity(grad16, grad32, dim=0) > 0.99
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# parallel: collectives on a 1-rank nccl group, in a spawned process so this one never holds a process group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collectives_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    on_device = torch.tensor([1.5, -2.0], device=DEVICE)
    on_cpu = torch.tensor([3.0, 4.0], dtype=torch.float64)
    summed, summed_cpu = parallel.all_reduce_sum(on_device), parallel.all_reduce_sum(on_cpu)
    result = {"backend": torch.distributed.get_backend(), "summed": summed.cpu(), "summed_cpu": summed_cpu,
              "devices": (summed.device.type, summed_cpu.device.type),
              "copies": (summed.data_ptr() != on_device.data_ptr(), summed_cpu.data_ptr() != on_cpu.data_ptr()),
              "metrics": parallel.reduce_metrics({"b": 2.5, "a": 1.0}), "gathered": parallel.gather({"x": [1, 2]}),
              "broadcast": parallel.broadcast("hello")}
    parallel.close()
    result["closed"] = not torch.distributed.is_initialized()
    torch.save(result, out)


@needs_device
def test_collectives_on_a_one_rank_process_group(tmp_path):
    mp.start_processes(_collectives_worker, args=(free_port(), tmp_path / "out.pt"), nprocs=1, start_method="spawn")
    got = torch.load(tmp_path / "out.pt")
    assert got["backend"] == ("nccl" if DEVICE == "cuda" else "gloo")
    assert torch.equal(got["summed"], torch.tensor([1.5, -2.0]))
    assert torch.equal(got["summed_cpu"], torch.tensor([3.0, 4.0], dtype=torch.float64))
    assert got["devices"] == (DEVICE, "cpu") and got["copies"] == (True, True)
    assert got["metrics"] == {"a": 1.0, "b": 2.5}
    assert got["gathered"] == [{"x": [1, 2]}] and got["broadcast"] == "hello" and got["closed"]


# ---------------------------------------------------------------------------------------------------------------------
# checkpoint: save + load of a device policy and its AdamW state


def _adamw_step(policy, optimizer, vocab, device):
    ids, attn, mask = batch(vocab, device=device)
    logp, _ = policy(ids, attn, mask)
    (-(logp * mask).sum() / mask.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def rng_states(device: str) -> dict:
    """The python, numpy and torch RNG states (and the GPU's), read with their own libraries' getters."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device == "cuda":
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def assert_same_rng_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert a["python"] == b["python"], "python"
    assert a["numpy"][0] == b["numpy"][0] and all(np.array_equal(x, y) for x, y in zip(a["numpy"][1:], b["numpy"][1:]))
    for key in ("torch", "cuda"):
        assert key not in a or torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("device", ["cpu"] + ([pytest.param(DEVICE, marks=needs_device)] if DEVICE != "cpu" else []))
def test_checkpoint_round_trip_restores_weights_adamw_state_and_rng(tmp_path, small_tokenizer, device):
    """Save a policy after one AdamW step, move every RNG on, load into a fresh policy: the weights, the AdamW state
    and the python / numpy / torch RNG states are those saved, on the device; the export equals the weights."""
    from transformers import AutoModelForCausalLM
    vocab = len(small_tokenizer)
    policy = policy_mod.Policy(tiny_lm("qwen3", vocab, seed=0, device=device))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    _adamw_step(policy, optimizer, vocab, device)
    saved_rngs = rng_states(device)
    ckpt = checkpoint.save(tmp_path / "run", 1, policy, optimizer, small_tokenizer, rank=0, keep=1,
                           config_yaml="k: 8\n", info="{}")
    expected_draw = torch.rand(4, device=device)               # the first draw after the saved RNG state
    random.random()                                             # every RNG moves on before the load
    np.random.rand()

    fresh = policy_mod.Policy(tiny_lm("qwen3", vocab, seed=1, device=device))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert not torch.equal(fresh.lm.model.norm.weight, policy.lm.model.norm.weight)
    assert checkpoint.load(ckpt, fresh, fresh_optimizer, rank=0) == 1
    assert_same_rng_states(rng_states(device), saved_rngs)
    assert torch.equal(torch.rand(4, device=device), expected_draw)
    for (name, a), (_, b) in zip(policy.named_parameters(), fresh.named_parameters(), strict=True):
        assert b.device.type == device and torch.equal(a, b), name
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["state"].keys() == loaded["state"].keys() and len(saved["state"]) == len(list(policy.parameters()))
    for index, state in saved["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key].cpu(), loaded["state"][index][key].cpu()), (index, key)
        assert loaded["state"][index]["exp_avg"].device.type == device
    exported = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for name, p in exported.named_parameters():
        assert torch.equal(p, dict(policy.lm.named_parameters())[name].cpu()), name


# ---------------------------------------------------------------------------------------------------------------------
# generation.TransformersGenerator on the device


def generator_for(tokenizer, bias_to: list[int] | None = None):
    """A generator over a tiny random Llama; with bias_to, an LM head that samples only those ids (uniformly)."""
    lm = tiny_lm("llama", len(tokenizer), tie_word_embeddings=bias_to is None, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    if bias_to is not None:
        lm.lm_head = torch.nn.Linear(lm.config.hidden_size, len(tokenizer), bias=True, device=DEVICE)
        with torch.no_grad():
            lm.lm_head.weight.zero_()
            lm.lm_head.bias.zero_()
            lm.lm_head.bias[bias_to] = 30.0
    return generation.TransformersGenerator(lm, tokenizer, batch_size=3)    # 5 contexts: two generate calls


@needs_device
@pytest.mark.parametrize("bf16", [False, True])
def test_transformers_generator_budgets_finish_reasons_and_seeds(small_tokenizer, bf16):
    generator = generator_for(small_tokenizer)
    contexts = [tools.build_prompt(small_tokenizer, q) for q in QUESTIONS]
    budgets = [1, 7, 20, 33, 12]
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
        first, again, other = (generator.generate(contexts, budgets, seed) for seed in (5, 5, 6))
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert [s.token_ids for s in first] != [s.token_ids for s in other]
    for segment, budget in zip(first, budgets, strict=True):
        assert 1 <= len(segment.token_ids) <= budget
        assert all(0 <= t < len(small_tokenizer) for t in segment.token_ids)
        assert segment.finish_reason in ("tool", "answer", "eos", "length")
        assert segment.finish_reason != "length" or len(segment.token_ids) == budget
        assert segment.finish_reason != "eos" or segment.token_ids[-1] == small_tokenizer.eos_token_id
        assert math.isfinite(segment.h_seg) and segment.h_seg > 0


@needs_device
def test_transformers_generator_cuts_at_the_answer_tag_and_at_eos(small_tokenizer):
    contexts = [tools.build_prompt(small_tokenizer, q) for q in QUESTIONS]
    answer_ids = small_tokenizer.encode("</answer>", add_special_tokens=False)
    n = len(answer_ids)                                        # 3 or 4 ("</" merged or not), by the BPE's corpus
    assert n in (3, 4)
    budget = 3 * n ** n                                        # a uniform draw spells it ~3 times per segment
    segments = generator_for(small_tokenizer, answer_ids).generate(contexts, [budget] * 5, seed=0)
    assert {s.finish_reason for s in segments} <= {"answer", "length"}
    assert any(s.finish_reason == "answer" for s in segments)
    for s in segments:
        decoded = small_tokenizer.decode(s.token_ids)
        if s.finish_reason == "answer":                       # cut right after the first "</answer>"
            assert decoded.endswith("</answer>") and decoded.count("</answer>") == 1 and s.text == decoded
        else:
            assert len(s.token_ids) == budget and "</answer>" not in decoded
    segments = generator_for(small_tokenizer, [small_tokenizer.eos_token_id]).generate(contexts, [9] * 5, seed=0)
    assert all(s.token_ids == [small_tokenizer.eos_token_id] and s.finish_reason == "eos" for s in segments)
