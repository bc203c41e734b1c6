"""LoRA (harness/lora.py, algorithm.md §9): the adapted model starts as the base model and trains only A and B; the
gradients of A and B are the chain rule of W' = W + (α/r)·B·A through the full weight's gradient; the merged weights
are peft's merge; the KL reference is the base model with the adapters off; a LoRA run trains, checkpoints (adapters
and their AdamW state only), exports a merged model and a peft adapter that load, resumes exactly, and its bad inputs
are one line; an engine that serves no adapter gets the merged weights; a resume finds its own base. 2-rank
gradients: tests/test_combinations.py (its lora factor); the real vLLM engine:
tests/test_vllm_engine.py; the GPU's sleep order: test_the_vllm_cycle_with_lora_sleeps_at_level_1
(tests/fake_vllm.py)."""
import json
import sys
from pathlib import Path

import pytest
import torch

import train
from harness import cli, config, lora
from harness.run import policy as policy_mod
from tests.conftest import flags, make_tiny_model, weights, with_adapters
from tests.fakes import fake_score

SETTINGS = lora.LoraSettings(rank=4, alpha=8.0)


def adapted(tokenizer, seed=0, b_scale=0.0):
    """The tiny model with rank-4 adapters (α = 8) on every linear layer; B drawn at b_scale (0: peft's zero)."""
    return with_adapters(make_tiny_model(tokenizer), SETTINGS.rank, SETTINGS.alpha, b_scale, seed)


def batch_of(tokenizer):
    ids = [tokenizer.encode(t) for t in ("What is the capital of France? Paris.", "Who wrote Hamlet? Shakespeare")]
    return policy_mod.tensorize([(p[:4], p[4:], [1] * len(p[4:])) for p in ids], tokenizer.pad_token_id, "cpu")


def test_adapters_start_as_the_base_model_and_only_they_train(tokenizer):
    base = make_tiny_model(tokenizer)
    lm = adapted(tokenizer)
    batch = batch_of(tokenizer)
    with torch.no_grad():
        want, _ = policy_mod.Policy(base)(batch.input_ids, batch.attention_mask, batch.mask)
        got, _ = policy_mod.Policy(lm)(batch.input_ids, batch.attention_mask, batch.mask)
    torch.testing.assert_close(got, want, atol=0, rtol=0)               # B = 0: W' = W exactly
    trainable = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2                                 # 7 projections × 2 layers, A and B each
    torch.manual_seed(123)                                             # A does not depend on the global RNG
    again = adapted(tokenizer)
    other = adapted(tokenizer, seed=1)
    a = dict(lm.named_parameters())
    for name, p in again.named_parameters():
        assert torch.equal(p, a[name]), name
    assert any(not torch.equal(p, a[n]) for n, p in other.named_parameters() if ".lora_A." in n)
    bound = max(float(p.detach().abs().max() * p.shape[1] ** 0.5) for n, p in lm.named_parameters() if ".lora_A." in n)
    assert 0.5 < bound <= 1.0                                          # uniform in ±1/sqrt(d_in)


def test_adapter_gradients_are_the_chain_rule_of_the_merged_weight(tokenizer):
    """∂L/∂B = s·G·Aᵀ and ∂L/∂A = s·Bᵀ·G, with G = ∂L/∂W' the gradient of the same loss at the merged weight
    W' = W + s·B·A (s = α/r) in a plain model: the LoRA equation, forward and backward."""
    lm = adapted(tokenizer, b_scale=0.05)
    batch = batch_of(tokenizer)
    policy = policy_mod.Policy(lm)
    logp, _ = policy(batch.input_ids, batch.attention_mask, batch.mask)
    (-(logp * batch.mask).sum()).backward()
    merged = make_tiny_model(tokenizer)
    missing, unexpected = merged.load_state_dict(dict(lora.merged_weights(
        ((n, p.detach()) for n, p in lm.named_parameters()), SETTINGS.scaling)), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected              # the head is tied to the embedding
    logp_m, _ = policy_mod.Policy(merged)(batch.input_ids, batch.attention_mask, batch.mask)
    torch.testing.assert_close(logp_m, logp, atol=1e-5, rtol=1e-5)    # the forward
    (-(logp_m * batch.mask).sum()).backward()
    params, checked = dict(lm.named_parameters()), 0
    for name, p in merged.named_parameters():
        layer = "base_model.model." + name.removesuffix(".weight")
        if f"{layer}.lora_A.default.weight" not in params:
            continue
        a, b = params[f"{layer}.lora_A.default.weight"], params[f"{layer}.lora_B.default.weight"]
        g, s = p.grad, SETTINGS.scaling
        torch.testing.assert_close(b.grad, s * g @ a.detach().T, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.grad, s * b.detach().T @ g, atol=1e-5, rtol=1e-4)
        assert params[f"{layer}.base_layer.weight"].grad is None          # the base weight is frozen
        checked += 1
    assert checked == 14


def test_merged_weights_are_pefts_merge(tokenizer):
    import copy
    lm = adapted(tokenizer, b_scale=0.1)
    want = copy.deepcopy(lm).merge_and_unload().state_dict()
    got = dict(lora.merged_weights(lm.named_parameters(), SETTINGS.scaling))
    assert set(got) == {n for n, _ in make_tiny_model(tokenizer).named_parameters()}
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-6, rtol=1e-6, msg=name)
    with pytest.raises(ValueError, match="without their base weight"):
        list(lora.merged_weights([("x.q_proj.lora_A.default.weight", torch.zeros(2, 2))], 1.0))


def test_the_reference_is_the_base_model_with_the_adapters_off(tokenizer):
    base = make_tiny_model(tokenizer)
    policy = policy_mod.Policy(adapted(tokenizer, b_scale=0.1))
    batch = batch_of(tokenizer)
    with torch.no_grad():
        want, want_h = policy_mod.Policy(base)(batch.input_ids, batch.attention_mask, batch.mask)
        ref, ref_h = lora.AdaptersOff(policy)(batch.input_ids, batch.attention_mask, batch.mask)
        now, _ = policy(batch.input_ids, batch.attention_mask, batch.mask)
    torch.testing.assert_close(ref, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(ref_h, want_h, atol=1e-6, rtol=0)
    assert (now - want).abs().max() > 1e-3                              # with the adapters on: another policy
    with torch.no_grad():
        again, _ = policy(batch.input_ids, batch.attention_mask, batch.mask)
    torch.testing.assert_close(again, now, atol=0, rtol=0)             # switched back on after the call


@pytest.mark.parametrize("targets, message", [
    (["qkv_proj"], "has no module 'qkv_proj'; its linear layers are down_proj, gate_proj, k_proj, o_proj, q_proj"),
    (["lm_head"], "is the LM head or an embedding"),
    (["embed_tokens"], "is the LM head or an embedding"),
    (["input_layernorm"], "is not a linear layer (LlamaRMSNorm)"),
    ([], "--lora_target_modules is empty"),
    (["all-linear", "q_proj"], "all-linear already names every linear layer")])
def test_a_target_the_model_cannot_adapt_is_one_line(targets, message, tokenizer):
    with pytest.raises(cli.UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lora.check_targets(make_tiny_model(tokenizer), targets)


def test_a_bad_target_stops_the_run_before_any_work(setup, capsys):
    """The targets are checked on the model's skeleton before the run folder, the cold start or the model's weights."""
    with pytest.raises(cli.UserError, match="has no module 'qkv_proj'"):
        train.main(flags(setup, "lora_bad", lora_rank=4, lora_target_modules="[qkv_proj]", cold_start="true"),
                   score=fake_score)
    assert not (setup / "runs" / "lora_bad").exists()
    assert "cold start" not in capsys.readouterr().out


def test_lora_settings_out_of_range_are_one_line():
    for flag, value, message in [("lora_rank", "-1", "--lora_rank -1 is out of range: it must be in \\[0, 512\\]"),
                                 ("lora_rank", "1024", "--lora_rank 1024 is out of range"),
                                 ("lora_alpha", "0", "--lora_alpha 0.0 is out of range"),
                                 ("lora_dropout", "1", "--lora_dropout 1.0 is out of range")]:
        with pytest.raises(cli.UserError, match=message):
            config.parse_config([f"--{flag}={value}"])


# ---------------------------------------------------------------------------------------------------------------------
# A LoRA run: trains, checkpoints, exports, resumes


LORA = dict(lora_rank=4, lora_alpha=16, lr=5e-2, kl_coef=0.05, save_every=1, keep_checkpoints=5)


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_runs(setup):
    """A LoRA run of 3 steps, and the same run cut after 2 and resumed for the third (real gradients: the tests' reward
    varies, lr 5e-2, a KL to the base; 2 optimiser steps per rollout)."""
    common = dict(eval_data=str(setup / "qa.jsonl"), eval_limit=1, **LORA)
    train.main(flags(setup, "lora_cut", steps=2, **common), score=fake_score)
    train.main(flags(setup, "lora_cut", steps=3, resume="true", **common), score=fake_score)
    train.main(flags(setup, "lora_straight", steps=3, **common), score=fake_score)
    return setup / "runs" / "lora_cut", setup / "runs" / "lora_straight"


def test_a_lora_run_trains_the_adapters_and_exports_a_model_and_an_adapter_that_load(setup, lora_runs, tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    run = lora_runs[1]
    rows = rows_of(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in rows)
    assert rows[1]["kl_ref"] > 0                                       # the adapters moved the policy off its base
    ckpt = run / "checkpoints" / "step_000003"
    base = weights(setup / "tiny")
    merged = weights(ckpt)
    assert set(merged) == set(base)
    changed = [k for k in base if not torch.equal(merged[k], base[k])]
    assert changed and all(k.endswith("_proj.weight") for k in changed)   # only the adapted layers, merged
    assert sorted(p.name for p in (ckpt / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    from torch.distributed.checkpoint import FileSystemReader
    stored = FileSystemReader(str(ckpt / "trainer")).read_metadata().state_dict_metadata
    tensors = [k for k in stored if k.startswith(("model.", "optim.state."))]     # (and the optimiser's settings)
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors)        # adapters and their AdamW moments only
    assert len([k for k in tensors if k.endswith("exp_avg_sq")]) == len([k for k in tensors if k.startswith("model.")])
    batch = batch_of(tokenizer)
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(ckpt).eval()
        via_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(setup / "tiny"), ckpt / "adapter")
        a = plain(input_ids=batch.input_ids).logits
        b = via_peft.eval()(input_ids=batch.input_ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_lora_runs_optimiser_holds_the_adapters_and_its_reference_is_the_base(setup, tokenizer, capsys):
    """The run as set up (harness/run/startup.py): AdamW holds the adapters and nothing else; the KL reference is the
    base model (setup's tiny model) however far the adapters have moved; the policy is not; the start-up line says
    so."""
    from harness import generation
    from harness.models import load_lm
    from harness.run import rundir, startup
    cfg = config.parse_config(flags(setup, "lora_setup", **LORA))
    run = startup.set_up(cfg, 0, 1, torch.device("cpu"), rundir.RunState(), fake_score, generation.make_generator)
    held = [p for group in run.optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in run.policy.named_parameters()}
    assert held and all(".lora_A." in names[id(p)] or ".lora_B." in names[id(p)] for p in held)
    assert len(held) == sum(1 for n in names.values() if ".lora_" in n)
    with torch.no_grad():
        for p in held:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        batch = batch_of(tokenizer)
        ref, _ = run.ref(batch.input_ids, batch.attention_mask, batch.mask)
        now, _ = run.policy(batch.input_ids, batch.attention_mask, batch.mask)
        base, _ = policy_mod.Policy(load_lm(str(setup / "tiny"), "cpu"))(batch.input_ids, batch.attention_mask,
                                                                          batch.mask)
    torch.testing.assert_close(ref, base, atol=1e-5, rtol=0)
    assert (now - base).abs().max() > 1e-3
    out = capsys.readouterr().out
    assert "LoRA: rank 4, alpha 16 on 14 layers" in out and "the KL reference is the model with its adapters off" in out
    assert "the generator (transformers) receives the adapter's tensors" in out


def test_a_lora_run_resumes_exactly(setup, lora_runs):
    """3 steps straight against 2 + a resume for the third: the same metrics and merged weights (the third step's
    update needs the restored AdamW moments: a fresh optimiser gives another pg_loss already in its second
    mini-batch); a resume with another rank is refused."""
    a, b = rows_of(setup / "runs" / "lora_cut"), rows_of(setup / "runs" / "lora_straight")
    assert [r["step"] for r in a] == [1, 2, 3]
    assert a[2]["grad_norm"] > 0
    for key in ("reward", "pg_loss", "grad_norm", "entropy", "kl_ref", "probe_entropy"):
        assert a[2][key] == pytest.approx(b[2][key], rel=1e-6, abs=1e-9), key
    wa = weights(setup / "runs" / "lora_cut" / "checkpoints" / "step_000003")
    wb = weights(setup / "runs" / "lora_straight" / "checkpoints" / "step_000003")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-7, rtol=0, msg=k)
    with pytest.raises(cli.UserError, match="lora_rank: 4 -> 8"):
        train.main(flags(setup, "lora_cut", steps=4, resume="true", **{**LORA, "lora_rank": 8}), score=fake_score)


def test_the_vllm_cycle_with_lora_sleeps_at_level_1(setup, monkeypatch):
    """With LoRA on a GPU engine (the stand-in of tests/fake_vllm.py): the engine is built with LoRA on the base
    model, sleeps at level 1 (level 2 would drop base weights no sync resends), wakes its weights before the adapter
    is loaded (level 1 unmaps the LoRA buffers), then its KV cache; only the adapter is sent, and the engine's
    adapted model generates what the trainer's policy is."""
    from tests import fake_vllm
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    run = Path(train.main(flags(setup, "vllm_lora", backend="vllm", **LORA), score=fake_score)["run_dir"])
    llm = fake_vllm.LLM.instances[-1]
    assert llm.kwargs["enable_lora"] and llm.kwargs["max_lora_rank"] == 8 and llm.kwargs["max_loras"] == 1
    kinds = []
    for event in llm.events:
        kind = event.split(":")[0] + (":" + event.split(":")[-1] if event.startswith("wake") else "")
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    step = ["generate", "sleep1", "wake_up:weights", "add_lora", "wake_up:kv_cache", "reset_prefix_cache"]
    assert kinds == ["add_lora", "reset_prefix_cache"] + step + step + ["shutdown"]
    assert "reload_weights" not in llm.events                          # the base weights never travel
    assert llm.adapters_used and set(llm.adapters_used) == {1}          # every rollout sampled with the adapter
    exported = weights(run / "checkpoints" / "step_000002")
    for name, p in llm.adapted.named_parameters():                     # the engine's adapted model = the export's
        torch.testing.assert_close(p.detach(), exported[name].float(), atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_rank_lora_runs_resume_exactly(parallel, setup):
    """On 2 gloo ranks (DDP: each rank holds the adapters; FSDP2: they are sharded with the frozen base): 2 steps and
    a resume for a third equal 3 straight steps (metrics, merged export, adapter); the checkpoints hold only the
    adapters and their AdamW moments (a file from every rank)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from tests.conftest import spawn, train_worker
    common = dict(parallel=parallel, mini_batch_size=2, **LORA)
    cut, straight = f"lora2_{parallel}_cut", f"lora2_{parallel}_straight"
    spawn(train_worker, flags(setup, cut, **common))
    spawn(train_worker, flags(setup, cut, steps=3, resume="true", **common))
    spawn(train_worker, flags(setup, straight, steps=3, **common))
    a, b = rows_of(setup / "runs" / cut), rows_of(setup / "runs" / straight)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert all(r["trajectories"] == 4 and r["grad_norm"] > 0 for r in a)
    # the generator kept up: the policy's own module (DDP), the unsharded copy fed the merged weights (FSDP2)
    assert all(r["mismatch/k3"] < 1e-6 for r in a + b), [r["mismatch/k3"] for r in a + b]
    for key in ("reward", "pg_loss", "grad_norm", "entropy", "kl_ref", "resp_len"):
        assert a[2][key] == pytest.approx(b[2][key], rel=1e-6, abs=1e-9), key
    step3 = setup / "runs" / cut / "checkpoints" / "step_000003"
    other = setup / "runs" / straight / "checkpoints" / "step_000003"
    for wa, wb in ((weights(step3), weights(other)),
                   (load_file(step3 / "adapter" / "adapter_model.safetensors"),
                    load_file(other / "adapter" / "adapter_model.safetensors"))):
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], atol=1e-7, rtol=0, msg=k)
    stored = FileSystemReader(str(step3 / "trainer")).read_metadata().state_dict_metadata
    assert all(".lora_" in k for k in stored if k.startswith(("model.", "optim.state.")))
    shards = sorted(p.name for p in (step3 / "trainer").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]


def test_an_engine_that_cannot_take_an_adapter_gets_the_merged_weights(setup, monkeypatch, capsys):
    """A model class vLLM serves no adapter on (the registry lists it without SupportsLoRA): the engine is built
    without LoRA, the start-up line says so, every sync reloads the merged weights W + (α/r)·B·A in place, and the
    engine ends with the checkpoint's merged model."""
    from types import SimpleNamespace
    from tests import fake_vllm
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(fake_vllm.models.ModelRegistry, "models",
                        {"LlamaForCausalLM": SimpleNamespace(load_model_cls=lambda: object)})
    run = Path(train.main(flags(setup, "vllm_merged", backend="vllm", **{**LORA, "bf16": "true"}),   # vLLM's dtype
                          score=fake_score)["run_dir"])
    llm = fake_vllm.LLM.instances[-1]
    assert "enable_lora" not in llm.kwargs and "add_lora" not in llm.events
    assert llm.events.count("reload_weights") == 3                     # at set-up and after each of the 2 steps
    assert "receives the merged weights W + (α/r)·B·A (it cannot take an adapter)" in capsys.readouterr().out
    exported = weights(run / "checkpoints" / "step_000002")
    for name, p in llm.model.named_parameters():
        torch.testing.assert_close(p.detach(), exported[name].float(), atol=1e-6, rtol=0, msg=name)


def test_a_resume_puts_the_adapters_back_on_their_own_base_or_says_why_not(setup, tmp_path, capsys):
    """A checkpoint records the base its adapters were trained on (run_info.json: path and fingerprint). A resume
    loads that base; one whose base changed or is gone stops in one line. Without its AdamW state the resume leaves
    the optimiser untouched (no step of zero gradients: its first update is a first step)."""
    import shutil
    from harness import generation
    from harness.run import rundir, startup
    base = tmp_path / "base"
    shutil.copytree(setup / "tiny", base)
    lean = dict(LORA, model=str(base), save_trainer_state="false", lora_dropout=0.1)
    run = Path(train.main(flags(setup, "lora_base", steps=1, **lean), score=fake_score)["run_dir"])
    info = json.loads((run / "checkpoints" / "step_000001" / "run_info.json").read_text())
    assert info["lora_base"]["path"] == str(base) and len(info["lora_base"]["fingerprint"]) == 16
    cfg = config.parse_config(flags(setup, "lora_base", steps=2, resume="true", **lean))
    resumed = startup.set_up(cfg, 0, 1, torch.device("cpu"), rundir.RunState(), fake_score, generation.make_generator)
    assert not resumed.optimizer.state                                  # no moments, no step count
    assert not any(m.training for m in resumed.policy.modules())        # adapter dropout off until the update
    assert "AdamW moments restart from zero" in capsys.readouterr().err
    config_json = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config_json, "rms_norm_eps": 1e-3}))
    with pytest.raises(cli.UserError, match="is not the one its adapters were trained on"):
        train.main(flags(setup, "lora_base", steps=2, resume="true", **lean), score=fake_score)
    moved = tmp_path / "moved"                                          # the base gone from where it was recorded
    base.rename(moved)
    with pytest.raises(cli.UserError, match=f"base model {base} is gone"):
        train.main(flags(setup, "lora_base", steps=2, resume="true", allow_config_change="true",
                         **{**lean, "model": str(moved)}), score=fake_score)


def test_gpt2_style_conv1d_layers_are_one_line():
    """peft's all-linear takes transformers' Conv1D layers, whose adapters are transposed (fan_in_fan_out), which the
    merge here does not do: refused in one line."""
    from transformers import GPT2Config, GPT2LMHeadModel
    with torch.device("meta"):
        lm = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(cli.UserError, match="Conv1D layers \\(c_attn, c_fc, c_proj\\)"):
        lora.check_targets(lm, ["all-linear"])
