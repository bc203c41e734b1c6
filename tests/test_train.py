"""train.py: config errors, tensor layout and masks, gradients under 1 and 2 processes (DDP, FSDP2), the whole loop
for two steps (1 and 2 processes), checkpoint/resume exactness. A tiny random Llama over the real SmolLM2 tokenizer
stands in for the model; the search is a replay table written by the test (no index needed)."""
import contextlib
import datetime
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import tools
from harness.run import coldstart
from harness import cli
from harness import config
from harness.run import policy as policy_mod
import train
from tests.conftest import (QA, flags, free_port, hand_made_trajectories, make_tiny_model, peaked_tiny_model,
                            weights)
from tests.fakes import fake_score

# ---------------------------------------------------------------------------------------------------------------------
# Config and bad input


def test_config_defaults_and_flags():
    cfg = config.parse_config(["--k", "8", "--sg_clip", "false", "--search_kw", "{topk: 5}"])
    assert cfg.k == 8 and cfg.sg_clip is False and cfg.search_kw == {"topk": 5}
    assert cfg.eps_low == cfg.eps_high == 0.2 and cfg.clip_c == 3.0 and cfg.alpha == 0.2   # the paper's defaults (algorithm.md §4)
    assert (cfg.beta, cfg.gamma, cfg.lam, cfg.tau) == (0.5, 0.2, 0.05, 0.5)


def test_yaml_configs_parse():
    configs = Path(__file__).resolve().parents[1] / "configs"
    assert config.parse_config([f"--config={configs / 'embedded.yaml'}"]) == config.Config()   # documents the default
    for path in sorted(configs.glob("*.yaml")):
        assert isinstance(config.parse_config([f"--config={path}"]), config.Config), path
    big = config.parse_config([f"--config={configs / 'aepo_qwen3_14b.yaml'}"])
    assert (big.k, big.questions_per_step, big.mini_batch_size, big.lr) == (12, 64, 8, 1e-6)
    grpo = config.parse_config([f"--config={configs / 'aepo_qwen3_14b.yaml'}", f"--config={configs / 'grpo.yaml'}"])
    assert not (grpo.entropy_branching or grpo.sg_clip or grpo.entropy_advantage) and grpo.k == 12   # an overlay


def test_unknown_flag_and_key_error(tmp_path):
    with pytest.raises(cli.UserError, match="unrecognized arguments: --no_such_flag 1 .*--help"):
        config.parse_config(["--no_such_flag", "1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("k: 4\nlearning_rate: 0.1\n")
    with pytest.raises(cli.UserError, match="learning_rate"):
        config.parse_config([f"--config={bad}"])


def test_bad_sizes():
    with pytest.raises(cli.UserError, match="--questions_per_step .6. must be a multiple of --mini_batch_size"):
        config.parse_config(["--questions_per_step", "6", "--mini_batch_size", "4"])


def test_missing_data_file(setup, tmp_path):
    with pytest.raises(cli.UserError, match="--train_data .*nope.jsonl: file not found"):
        train.main(flags(setup, "missing", train_data=str(tmp_path / "nope.jsonl")))
    assert not (setup / "runs" / "missing").exists()


def test_missing_model(setup, tmp_path):
    with pytest.raises(cli.UserError, match="not a local model directory"):
        train.main(flags(setup, "nomodel", model=str(tmp_path / "no_model")))


def test_dataset_without_answer(setup, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Q?", "answer": ["A"]}) + "\n" + json.dumps({"question": "Q2?"}) + "\n")
    with pytest.raises(cli.UserError, match="line 2.*'answer'.*--skip_bad"):
        train.main(flags(setup, "badrows", train_data=str(bad)))
    assert not (setup / "runs" / "badrows").exists()


def test_cold_start_needs_query(setup, tmp_path):
    rows = tmp_path / "noquery.jsonl"
    rows.write_text("".join(json.dumps({"question": q, "answer": [a]}) + "\n" for q, a in QA))
    with pytest.raises(cli.UserError, match="'query' field"):
        train.main(flags(setup, "noquery", train_data=str(rows), cold_start="true"))


# ---------------------------------------------------------------------------------------------------------------------
# Layout: which positions are scored


def test_tensorize_scores_policy_tokens_only():
    batch = policy_mod.tensorize([([5, 6, 7], [10, 11, 12, 13], [1, 0, 0, 1]), ([5], [20, 21], [1, 1])], pad_id=0,
                            device="cpu")
    ids, mask = batch.input_ids, batch.mask
    assert ids.tolist() == [[5, 6, 7, 10, 11, 12, 13], [5, 20, 21, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    # mask[i, t] = 1  <=>  token ids[i, t+1] was sampled by the policy
    assert mask.tolist() == [[0, 0, 1, 0, 0, 1], [1, 1, 0, 0, 0, 0]]


def test_demonstration_tokens_like_rollout(tokenizer):
    demo = {"messages": [{"role": "user", "content": "Who wrote Hamlet?"},
                         {"role": "assistant", "content": "<think> x </think>\n<search> Hamlet author </search>"},
                         {"role": "tool", "content": "Page 1: Hamlet is a play by William Shakespeare."},
                         {"role": "assistant", "content": "<answer> \\boxed{William Shakespeare} </answer>"}]}
    prompt, response, mask = coldstart.demo_tokens(demo, tokenizer)
    assert prompt == tools.build_prompt(tokenizer, "Who wrote Hamlet?")    # system prompt added
    seg1 = tokenizer.encode(demo["messages"][1]["content"], add_special_tokens=False)
    result = tokenizer.encode(tools.format_result(demo["messages"][2]["content"]), add_special_tokens=False)
    seg2 = tokenizer.encode(demo["messages"][3]["content"], add_special_tokens=False)
    assert response == seg1 + result + seg2
    assert mask == [1] * len(seg1) + [0] * len(result) + [1] * len(seg2)


def test_build_demonstrations_uses_real_results():
    rows = [{"question": q, "golds": [a], "meta": {"query": q}} for q, a in QA[:2]]

    class Search:
        def search(self, queries):
            return ["Page 1: Paris is the capital.", "Page 1: nothing useful"]
    demos = coldstart.build_demonstrations(rows, Search())
    assert len(demos) == 1                                       # the second result lacks the gold answer
    msgs = demos[0]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[3]["content"] == "Page 1: Paris is the capital." and "\\boxed{Paris}" in msgs[4]["content"]


def test_policy_logp_matches_full_softmax(tokenizer):
    torch.manual_seed(0)
    lm = make_tiny_model(tokenizer)
    policy = policy_mod.Policy(lm)
    batch = policy_mod.tensorize([([5, 6, 7], [10, 11, 12, 13], [1, 0, 0, 1]), ([5, 9], [20, 21], [1, 1])], 0, "cpu")
    logp, entropy = policy(batch.input_ids, batch.attention_mask, batch.mask, temperature=0.7)
    logits = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float() / 0.7
    ref = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ref_h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    m = batch.mask.bool()
    torch.testing.assert_close(logp[m], ref[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[m], ref_h[m], atol=1e-4, rtol=1e-5)
    assert (logp[~m] == 0).all() and (entropy[~m] == 0).all()
    g1 = torch.autograd.grad(logp.sum(), lm.model.layers[0].mlp.up_proj.weight)[0]
    g2 = torch.autograd.grad(ref[m].sum(), lm.model.layers[0].mlp.up_proj.weight)[0]
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# Gradients: micro-batching and world size never change them


def gradients(policy, trajectories, rewards, cfg, world, n_minibatches=1):
    """What the loop does for one mini-batch: advantages, old pass, perturbed old log-probs (so ratios leave 1 and
    clipping happens), accumulate_gradients. Returns {name: full gradient}."""
    adv = train.outcome_advantages(trajectories, rewards, cfg, 0)
    batches = train.micro_batches(trajectories, adv, rewards, n_minibatches, cfg, 0, "cpu")
    olds, _, _ = train.old_policy_pass(policy, None, batches, cfg, contextlib.nullcontext)
    for mb, old in zip(batches[0], olds[0]):                      # a deterministic function of the token
        old.old_logp = old.old_logp + 0.4 * torch.sin(mb.input_ids[:, 1:].float()) * mb.mask
    metrics = train.accumulate_gradients(policy, batches[0], olds[0], cfg, world, contextlib.nullcontext, "test")
    grads = {}
    for name, p in policy_mod.unwrap(policy).named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    return grads, metrics


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def gradient_bytes(module) -> int:
    """Bytes of gradient this rank holds: every parameter's .grad (its local shard under FSDP2) plus the unsharded
    gradients FSDP2 keeps while gradient sync is off (internal attributes of torch's FSDPParam)."""
    total = sum(local(p.grad).numel() * local(p.grad).element_size() for p in module.parameters() if p.grad is not None)
    for m in module.modules():
        group = m._get_fsdp_state()._fsdp_param_group if hasattr(m, "_get_fsdp_state") else None
        for fsdp_param in group.fsdp_params if group is not None else []:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            for g in (fsdp_param.unsharded_accumulated_grad, getattr(unsharded, "grad", None)):
                total += g.numel() * g.element_size() if g is not None else 0
    return total


def _grad_worker(rank, world, port, parallel, tok_dir, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))   # a hang fails, not waits
    try:
        from transformers import AutoTokenizer
        lm = peaked_tiny_model(AutoTokenizer.from_pretrained(tok_dir))
        budget = 40 if parallel.endswith("-budget") else 0                # token-budget micro-batches
        parallel = parallel.removesuffix("-budget")
        cfg = config.Config(parallel=parallel, micro_batch_size=3, max_tokens_per_micro_batch=budget)
        policy = policy_mod.Policy(lm)
        if parallel == "fsdp":
            policy = policy_mod.shard(policy, bf16=False)
        else:
            policy = torch.nn.parallel.DistributedDataParallel(policy)
        trajectories, rewards = hand_made_trajectories()
        per = len(trajectories) // world
        mine = slice(rank * per, (rank + 1) * per)                # whole questions per rank
        seen = []                                                 # gradient bytes before each micro-batch
        policy.register_forward_pre_hook(lambda module, args: seen.append(gradient_bytes(policy)))
        natural = len(policy_mod.split_micro_batches(list(range(per)), [len(t.prompt_ids) + len(t.response_ids)
                                                                        for t in trajectories[mine]], 3, budget))
        grads, metrics = gradients(policy, trajectories[mine], rewards[mine], cfg, world)
        seen.append(gradient_bytes(policy))
        shard_bytes = sum(local(p).numel() * local(p).element_size() for p in policy.parameters())
        counts = [None, None]
        torch.distributed.all_gather_object(counts, natural)
        if rank == 0:
            torch.save({"grads": grads, "metrics": metrics, "grad_bytes": seen, "shard_bytes": shard_bytes,
                        "natural_counts": counts}, out)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def single_process_gradient(tokenizer):
    cfg = config.Config(micro_batch_size=8)
    policy = policy_mod.Policy(peaked_tiny_model(tokenizer))
    trajectories, rewards = hand_made_trajectories()
    grads, metrics = gradients(policy, trajectories, rewards, cfg, world=1)
    assert metrics["n_tokens"] > 0
    assert metrics["clip_hi"] + metrics["clip_lo"] > 0       # the perturbation does make clipping happen
    return grads


def test_micro_batching_does_not_change_gradient(tokenizer, single_process_gradient):
    policy = policy_mod.Policy(peaked_tiny_model(tokenizer))
    trajectories, rewards = hand_made_trajectories()
    grads, _ = gradients(policy, trajectories, rewards, config.Config(micro_batch_size=3), world=1)
    for name, g in single_process_gradient.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("parallel", ["fsdp", "fsdp-budget"])   # DDP: tests/test_combinations.py
def test_two_rank_gradient_equals_single_process(parallel, tokenizer, single_process_gradient, tmp_path):
    """Each rank's half of the questions gives one process's gradient. With a token budget the ranks' own packing
    gives them different numbers of micro-batches (2 and 1 here); FSDP2 runs collectives in every pass, so the
    ranks must still run as many passes each (micro_batches evens them out; before, this hung)."""
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    out = tmp_path / "grads.pt"
    mp.start_processes(_grad_worker, args=(2, free_port(), parallel, str(tok_dir), str(out)), nprocs=2,
                       start_method="spawn")
    saved = torch.load(out)
    grads = saved["grads"]
    if parallel.endswith("budget"):
        assert saved["natural_counts"] == [2, 1]                 # the ranks' own packing differs
    if parallel == "fsdp":            # accumulation over 2 micro-batches never holds more than this rank's shard
        assert len(saved["grad_bytes"]) == 2 + 2 + 1 and saved["grad_bytes"][-1] > 0   # 2 old, 2 update passes, end
        assert max(saved["grad_bytes"]) <= 1.1 * saved["shard_bytes"], (saved["grad_bytes"], saved["shard_bytes"])
    names = {n.removeprefix("module.") for n in grads}
    assert names == set(single_process_gradient)
    for name, g in grads.items():
        torch.testing.assert_close(g, single_process_gradient[name.removeprefix("module.")], atol=1e-5, rtol=1e-4,
                                   msg=name)


def test_bf16_and_gradient_checkpointing_update(tokenizer, single_process_gradient):
    """The GPU options on CPU: bf16 autocast (LM head stays float32) and activation recomputation (the update runs
    in train mode, as in the loop, so the layers are recomputed; tests/test_loop.py counts the recomputations)."""
    lm = peaked_tiny_model(tokenizer)
    (getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable)()
    policy = policy_mod.Policy(lm)
    trajectories, rewards = hand_made_trajectories()
    cfg = config.Config(micro_batch_size=3)
    batches = train.micro_batches(trajectories, train.outcome_advantages(trajectories, rewards, cfg, 0), rewards, 1,
                                  cfg, 0, "cpu")
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)        # noqa: E731
    olds, _, _ = train.old_policy_pass(policy, None, batches, config.Config(), bf16)
    assert all(old.old_logp.dtype == torch.float32 for old in olds[0])
    lm.train()
    train.accumulate_gradients(policy, batches[0], olds[0], config.Config(), 1, bf16, "test")
    grads = dict(policy.named_parameters())
    for name, g in single_process_gradient.items():
        assert torch.isfinite(grads[name].grad).all(), name
    cos = torch.nn.functional.cosine_similarity(grads["lm.model.norm.weight"].grad.flatten(),
                                                single_process_gradient["lm.model.norm.weight"].flatten(), dim=0)
    assert cos > 0.5                  # bf16 changes the numbers (and the clipped set), not the direction


def test_non_finite_loss_raises(tokenizer):
    policy = policy_mod.Policy(make_tiny_model(tokenizer))
    trajectories, rewards = hand_made_trajectories()
    cfg = config.Config(micro_batch_size=8)
    adv = train.outcome_advantages(trajectories, rewards, cfg, 0)
    batches = train.micro_batches(trajectories, adv, rewards, 1, cfg, 0, "cpu")
    olds, _, _ = train.old_policy_pass(policy, None, batches, cfg, contextlib.nullcontext)
    olds[0][0].adv_tilde[0, 3] = float("nan")
    with pytest.raises(ValueError, match="step 7, mini-batch 0, micro-batch 0: advantages.*non-finite"):
        train.accumulate_gradients(policy, batches[0], olds[0], cfg, 1, contextlib.nullcontext,
                                   "step 7, mini-batch 0")


# ---------------------------------------------------------------------------------------------------------------------
# The whole loop: two steps, resume exactness, two processes


def test_two_steps_then_resume_is_exact(setup, monkeypatch, tokenizer):
    initial = {k: v.clone() for k, v in make_tiny_model(tokenizer).state_dict().items()}
    # interrupted: 2 steps (with a cold start and a 1-question eval), then resume for a third
    common = dict(cold_start="true", cold_start_kw=json.dumps({"questions": 2, "steps": 2, "batch": 2}), kl_coef=0.05)
    out = train.main(flags(setup, "interrupted", eval_data=str(setup / "qa.jsonl"), eval_limit=1, **common), score=fake_score)
    run = Path(out["run_dir"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(v == v and abs(v) != float("inf") for v in r.values() if isinstance(v, float))
    assert any(r["adv_nonzero"] > 0 for r in rows) and all(r["n_valid_tokens"] > 0 for r in rows)
    after = weights(run / "checkpoints" / "step_000002")
    assert any(not torch.equal(after[k], initial[k]) for k in after if k in initial)   # parameters changed
    for name in ("config.yaml", "run_info.json", "samples.jsonl", "curves.png", "eval/before_summary.json",
                 "eval/after_summary.json", "trees.jsonl", "trees.png", "eval/after_trees.jsonl"):
        assert (run / name).exists(), name
    cs = list((setup / "cache" / "cold_start").iterdir())
    assert len(cs) == 1 and (cs[0] / "config.json").exists()      # cold start cached for the next run
    train.main(flags(setup, "interrupted", steps=3, resume="true", eval_data=str(setup / "qa.jsonl"), eval_limit=1,
                     **common), score=fake_score)
    # uninterrupted: 3 steps (reuses the cached cold start)
    train.main(flags(setup, "straight", steps=3, eval_data=str(setup / "qa.jsonl"), eval_limit=1, **common),
               score=fake_score)
    a = [json.loads(line) for line in (setup / "runs" / "interrupted" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (setup / "runs" / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in a] == [1, 2, 3]
    assert a[2]["kl_ref"] > 0                                     # the reference is the cold-started policy
    for key in ("reward", "pg_loss", "grad_norm", "entropy", "clip_hi", "resp_len", "kl_ref", "probe_entropy"):
        assert a[2][key] == pytest.approx(b[2][key], rel=1e-6, abs=1e-9), key
    # the probe: sampled once (the resume read it back), and its entropy is the step's policy's, teacher-forced
    probe = json.loads((setup / "runs" / "interrupted" / "probe.json").read_text())
    assert len(probe) == 1 and probe == json.loads((setup / "runs" / "straight" / "probe.json").read_text())
    lm = policy_mod.load_policy(str(setup / "runs" / "straight" / "checkpoints" / "step_000003"), 1, torch.device("cpu"))
    batch = policy_mod.tensorize([tuple(p) for p in probe], tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logits = lm.lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    h = -(torch.log_softmax(logits.float(), -1).exp() * torch.log_softmax(logits.float(), -1)).sum(-1)
    assert b[2]["probe_entropy"] == pytest.approx(float((h * batch.mask).sum() / batch.mask.sum()), rel=1e-4)
    wa = weights(setup / "runs" / "interrupted" / "checkpoints" / "step_000003")
    wb = weights(setup / "runs" / "straight" / "checkpoints" / "step_000003")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-7, rtol=0, msg=k)


def test_vllm_backend_loop(setup, monkeypatch):
    """The loop with the vLLM backend (the stand-in of tests/fake_vllm.py): per step rollout at the rollout
    temperature -> sleep -> update -> wake weights -> every weight written -> wake KV cache -> reset; evaluation at
    its own temperature and back; the engine ends with the checkpoint's (bf16) weights and is shut down."""
    from tests import fake_vllm
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    run = Path(train.main(flags(setup, "vllm", backend="vllm", eval_data=str(setup / "qa.jsonl"), eval_limit=1,
                                eval_n=1, temperature=0.9, bf16="true"), score=fake_score)["run_dir"])
    llm = fake_vllm.LLM.instances[-1]
    kinds = []                                   # the engine's calls, repeats collapsed, batch sizes dropped
    for event in llm.events:
        kind = event.split(":")[0] + (":" + event.split(":")[-1] if event.startswith(("generate", "wake")) else "")
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    step = ["generate:T=0.9", "sleep2", "wake_up:weights", "load_weights", "reload_weights", "wake_up:kv_cache",
            "reset_prefix_cache"]
    assert kinds == ["generate:T=0.6"] + step + step + ["generate:T=0.6", "shutdown"]
    assert llm.asleep == set()
    exported = weights(run / "checkpoints" / "step_000002")
    for name, p in llm.model.named_parameters():
        assert exported[name].dtype == torch.bfloat16
        torch.testing.assert_close(p.detach(), exported[name].float(), atol=0, rtol=0, msg=name)


def test_existing_run_needs_resume(setup, monkeypatch):
    run = Path(train.main(flags(setup, "twice", steps=1, eval_data=str(setup / "qa.jsonl"), eval_limit=1,
                                eval_before="false"), score=fake_score)["run_dir"])
    assert not (run / "eval" / "before_summary.json").exists() and (run / "eval" / "after_summary.json").exists()
    row = json.loads((run / "metrics.jsonl").read_text())
    assert 0.0 <= row["branch_top_chain"] <= 1.0 and (row["branch_top_chain"] > 0) == (row["branches"] > 0)
    with pytest.raises(cli.UserError, match="--resume"):
        train.main(flags(setup, "twice", steps=1), score=fake_score)


def test_split_micro_batches_by_token_budget():
    """Fixed size: micro_batch_size trajectories in order. Token budget: sorted by length, rows × the longest row
    within the budget; one trajectory over the budget is a micro-batch of its own; nothing is lost or repeated."""
    indices, lengths = list(range(6)), [50, 400, 60, 120, 55, 900]
    assert policy_mod.split_micro_batches(indices, lengths, 4, 0) == [[0, 1, 2, 3], [4, 5]]
    groups = policy_mod.split_micro_batches(indices, lengths, 4, 500)
    assert groups == [[0, 4, 2, 3], [1], [5]]                        # 4 × 120 = 480; then 400; then 900 alone
    assert sorted(i for g in groups for i in g) == indices
    assert all(len(g) * max(lengths[i] for i in g) <= 500 or len(g) == 1 for g in groups)
    assert policy_mod.split_micro_batches(indices, lengths, 4, 700) == groups          # 5 × 400 = 2,000 padded: no
    packed = policy_mod.split_micro_batches(indices, lengths, 4, 700, packed=True)   # padding-free: real tokens
    assert packed == [[0, 4, 2, 3, 1], [5]]                          # 50 + 55 + 60 + 120 + 400 = 685 ≤ 700
    # another rank packed 5: the largest micro-batch is halved until there are 5, nothing lost or repeated
    five = policy_mod.even_out(groups, 5)
    assert five == [[0], [4], [2, 3], [1], [5]] and sorted(i for g in five for i in g) == indices
    assert policy_mod.even_out(groups, 3) == groups
    with pytest.raises(ValueError, match="6 trajectories cannot fill the 7 micro-batches"):
        policy_mod.even_out(groups, 7)


def test_each_rank_takes_its_share_of_the_step_and_its_own_rollout_seed():
    """Run.step_questions: the ranks' shares of a step are disjoint and make up the step's questions (the whole
    sequence over steps as one process takes it); with --set dynamic_sampling (DAPO) each rank rolls out as many again.
    Run.rollout_seed differs for every step and rank."""
    import dataclasses as dc
    from harness import dataset
    from harness.run.startup import Run
    rows = [{"question": f"q{i}"} for i in range(12)]

    def run(rank, world, **over):
        cfg = config.Config(questions_per_step=4, seed=5, **over)
        return Run(**{**{f.name: None for f in dc.fields(Run)}, "cfg": cfg, "rank": rank, "world": world,
                      "train_rows": rows})
    for step in range(4):
        whole = dataset.step_questions(rows, step, 4, 5)
        assert run(0, 1).step_questions(step) == whole
        assert run(0, 2).step_questions(step) + run(1, 2).step_questions(step) == whole
        dapo = run(1, 2, dynamic_sampling=True).step_questions(step)
        assert len(dapo) == 4 and dapo[:2] == whole[2:]
    seeds = {run(rank, 2).rollout_seed(step) for rank in range(2) for step in range(50)}
    assert len(seeds) == 100


def test_token_budget_micro_batches_give_the_same_gradient(tokenizer, single_process_gradient):
    """--max_tokens_per_micro_batch: length-sorted micro-batches of at most that many padded tokens give the gradient
    of the fixed-size split (the loss divides by the mini-batch's global token count), with less padding."""
    policy = policy_mod.Policy(peaked_tiny_model(tokenizer))
    trajectories, rewards = hand_made_trajectories()
    cfg = config.Config(micro_batch_size=8, max_tokens_per_micro_batch=40)
    grads, _ = gradients(policy, trajectories, rewards, cfg, world=1)
    for name, g in single_process_gradient.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)
    fixed = train.micro_batches(trajectories, train.outcome_advantages(trajectories, rewards, cfg, 0), rewards, 1,
                                config.Config(micro_batch_size=3), 0, "cpu")
    budget = train.micro_batches(trajectories, train.outcome_advantages(trajectories, rewards, cfg, 0), rewards, 1,
                                 cfg, 0, "cpu")
    assert len(budget[0]) > 1 and all(mb.input_ids.numel() <= 40 or len(mb.input_ids) == 1 for mb in budget[0])
    assert policy_mod.pad_share(budget) < policy_mod.pad_share(fixed)


# ---------------------------------------------------------------------------------------------------------------------
# Every paper hyperparameter and switch, set on the command line, arrives where it acts


def spied_run(setup, monkeypatch, name, **over) -> dict:
    """One training step on the tiny set-up with `over` on the command line, recording what the functions where the
    settings act receive: the tree rollout (TreeSettings, Sampling), the dataset filter (max_prompt_tokens), the
    mini-batch split, the entropy-aware advantage (α), the loss (LossSettings) and the optimiser step (clip, AdamW)."""
    import advantage
    from harness import dataset
    seen = {"alpha": []}

    def spy(module, attr, record):
        real = getattr(module, attr)

        def wrapper(*args, **kwargs):
            record(*args, **kwargs)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, attr, wrapper)
    spy(train.rollout, "tree_rollout", lambda prompts, gen, tl, tok, tree, **kw: seen.update(tree=tree,
                                                                                           sampling=kw["sampling"]))
    spy(dataset, "load_questions", lambda path, tok, max_prompt, what, *a, **kw: seen.setdefault("max_prompt", max_prompt))
    spy(train, "micro_batches", lambda trajs, adv, rewards, n_mini, *a: seen.setdefault("n_minibatches", n_mini))
    spy(advantage, "entropy_weighted_advantages", lambda *a: seen["alpha"].append(a[5]))
    spy(train.loss, "policy_loss", lambda *a, **kw: seen.setdefault("loss", a[5]))
    spy(train, "optimizer_step", lambda policy, opt, clip: seen.setdefault("optimizer", (clip, opt.param_groups[0])))
    train.main(flags(setup, name, steps=1, save_every=0, **over), score=fake_score)
    return seen


def test_every_paper_setting_reaches_where_it_acts(setup, monkeypatch):
    """Each of the paper's hyperparameters and switches (the README's table, config.py's first group), given a value
    other than its default on the command line, is the value the code that uses it receives: dropping one from the
    settings a builder makes (e.g. lam from the rollout's) fails here."""
    import dataclasses as dc
    from harness import config as config_mod
    values = dict(k=3, beta=0.7, gamma=0.35, lam=0.11, tau=0.65, alpha=0.37, eps_low=0.15, eps_high=0.27, clip_c=2.5,
                  max_tool_calls=4, questions_per_step=4, mini_batch_size=2, max_prompt_tokens=1900,
                  max_response_tokens=14, lr=3e-4, weight_decay=0.02, grad_clip=0.7, temperature=0.9, top_p=0.95)
    switches = dict(dynamic_budget="false", entropy_branching="false", entropy_advantage="false", sg_clip="false")
    fields = [f.name for f in dc.fields(config_mod.Config)]
    first_group = fields[:fields.index("top_p") + 1]
    assert sorted(first_group) == sorted({**values, **switches})     # every flag of the paper's group is here
    defaults = config_mod.Config()
    assert all(getattr(defaults, key) != value for key, value in values.items())
    seen = spied_run(setup, monkeypatch, "paper_values", **values)
    tree, sampling = seen["tree"], seen["sampling"]
    for key in ("k", "beta", "gamma", "lam", "tau", "max_tool_calls", "max_response_tokens"):
        assert getattr(tree, key) == values[key], key
    assert tree.dynamic_budget and tree.entropy_branching
    assert (sampling.temperature, sampling.top_p) == (0.9, 0.95)
    assert seen["max_prompt"] == 1900 and seen["n_minibatches"] == 2
    assert seen["alpha"] and set(seen["alpha"]) == {0.37}
    objective = seen["loss"]
    assert (objective.eps_low, objective.eps_high, objective.clip_c, objective.surrogate) == (0.15, 0.27, 2.5, "aepo")
    assert objective.sg_clip is True
    clip, group = seen["optimizer"]
    assert (clip, group["lr"], group["weight_decay"]) == (0.7, 3e-4, 0.02)
    off = spied_run(setup, monkeypatch, "paper_switches", **switches)
    assert not off["tree"].dynamic_budget and not off["tree"].entropy_branching
    assert off["alpha"] == [] and off["loss"].sg_clip is False       # no Ã reweighting; no stop-gradient clip
