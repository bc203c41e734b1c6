"""Several processes (2 gloo ranks on the CPU): the sharded model loads exactly the checkpoint (and recomputes its
layers in backward with gradient checkpointing), an FSDP2 run resumes exactly from its sharded checkpoint (each rank
writing its own shard), evaluation split over ranks equals one process's, and checkpoints survive a crash mid-write;
`--save_trainer_state false` keeps only the export."""
import contextlib
import json
import re
from pathlib import Path

import pytest
import torch

from harness import models

from harness.run import checkpoint
from harness import cli
from harness import config
from harness import generation
import eval as evaluation
from harness.run import policy as policy_mod
import train
from tests.conftest import QA, flags, hand_made_trajectories, make_tiny_model, spawn, train_worker, weights
from tests.fakes import EchoTools, fake_score


# ---------------------------------------------------------------------------------------------------------------------
# Loading a sharded model


def forward_backward(policy) -> dict:
    """One forward + backward in train mode on a fixed batch: the decoder-layer MLP forwards it ran (each layer once,
    twice when recomputed in backward), whether the LM reports activation checkpointing, the full gradients."""
    lm = policy.lm
    flag = lm.is_activation_checkpointing if hasattr(lm, "is_activation_checkpointing") else \
        lm.is_gradient_checkpointing                              # transformers 5 / 4.x
    calls = []
    for layer in lm.model.layers:
        layer.mlp.register_forward_pre_hook(lambda module, args: calls.append(1))
    ids = torch.randint(100, 5000, (2, 12), generator=torch.Generator().manual_seed(0))
    lm.train()
    logp, _ = policy(ids, torch.ones_like(ids), torch.ones(2, 11))
    (-logp.sum()).backward()
    grads = {name: p.grad.full_tensor().clone() for name, p in policy.named_parameters()}
    return {"checkpointing": flag, "mlp_forwards": len(calls), "grads": grads}


def _load_worker(rank, world, model_dir, out):
    torch.distributed.init_process_group("gloo")
    try:
        policy = policy_mod.load_policy(model_dir, world, torch.device("cpu"), "fsdp", rank=rank)
        local = {name: p.to_local().numel() for name, p in policy.named_parameters()}
        full = {name: t.clone() for name, t in policy_mod.full_named_parameters(policy)}
        half = {name: t.clone() for name, t in policy_mod.full_named_parameters(policy, torch.bfloat16)}   # vLLM's
        buffers = {name: b.clone() for name, b in policy.lm.named_buffers()}
        plain = forward_backward(policy)
        recomputed = forward_backward(policy_mod.load_policy(model_dir, world, torch.device("cpu"), "fsdp", rank=rank,
                                                             gradient_checkpointing=True))
        torch.save({"local": local, "full": full, "half": half, "buffers": buffers, "plain": plain,
                    "recomputed": recomputed}, f"{out}.{rank}")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_fsdp_loading_equals_the_checkpoint(tokenizer, tmp_path):
    """A bf16 checkpoint, loaded sharded on 2 ranks: float32 parameters equal to the checkpoint's, each rank holding
    half of each parameter, rotary buffers as a plain load computes them; gathered in bfloat16 (a sync to vLLM: each
    shard cast, then the bf16 all-gather over gloo), the checkpoint's values. Loaded with gradient_checkpointing=True
    the sharded model reports activation checkpointing and really recomputes both decoder layers in backward
    (4 MLP forwards instead of 2), with the same gradient."""
    from transformers import AutoModelForCausalLM
    model = make_tiny_model(tokenizer, seed=3).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    spawn(_load_worker, str(tmp_path / "m"), str(tmp_path / "out"))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    ref_params = dict(ref.named_parameters())
    for rank in (0, 1):
        got = torch.load(f"{tmp_path / 'out'}.{rank}")
        plain, recomputed = got["plain"], got["recomputed"]
        assert (plain["checkpointing"], recomputed["checkpointing"]) == (False, True)
        assert (plain["mlp_forwards"], recomputed["mlp_forwards"]) == (2, 4)
        assert any(g.abs().sum() > 0 for g in plain["grads"].values())
        for name, g in plain["grads"].items():
            torch.testing.assert_close(recomputed["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)
        assert set(got["full"]) == set(ref_params)
        for name, p in ref_params.items():
            assert got["full"][name].dtype == torch.float32 and got["half"][name].dtype == torch.bfloat16
            torch.testing.assert_close(got["full"][name], p.detach(), atol=0, rtol=0, msg=name)
            torch.testing.assert_close(got["half"][name], p.detach().to(torch.bfloat16), atol=0, rtol=0, msg=name)
            rows = -(-p.shape[0] // 2) if rank == 0 else p.shape[0] // 2           # dim 0 split, rank 0 first
            assert got["local"][f"lm.{name}"] == rows * p[0].numel(), name
        for name, b in ref.named_buffers():
            torch.testing.assert_close(got["buffers"][name], b, atol=0, rtol=0, msg=name)


def test_fsdp_on_one_process_shards_over_a_group_of_one(tokenizer, tmp_path):
    """Under torchrun with one process (a process group of one), --parallel fsdp places the model with FSDP2: every
    parameter a DTensor whose one shard is the whole parameter, equal to the checkpoint."""
    model = make_tiny_model(tokenizer, seed=3)
    model.save_pretrained(tmp_path / "m")
    spawn(_load_worker, str(tmp_path / "m"), str(tmp_path / "out"), world=1)
    got = torch.load(f"{tmp_path / 'out'}.0")
    for name, p in model.named_parameters():
        assert got["local"][f"lm.{name}"] == p.numel(), name
        torch.testing.assert_close(got["full"][name], p.detach(), atol=0, rtol=0, msg=name)


def test_export_config_says_the_export_dtype(tokenizer, tmp_path):
    """A bf16 export's config.json says bfloat16 (save_pretrained alone writes the float32 master model's dtype), so
    loaders that read the dtype from it (`dtype="auto"`: vLLM, rank 0 of an FSDP --resume) load 2 bytes per
    parameter, not 4."""
    from transformers import AutoModelForCausalLM
    checkpoint.export_model(policy_mod.Policy(make_tiny_model(tokenizer)), tokenizer, tmp_path / "m", rank=0,
                            dtype=torch.bfloat16)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype="auto").dtype == torch.bfloat16


def _export_worker(rank, world, model_dir, out):
    torch.distributed.init_process_group("gloo")
    try:
        policy = policy_mod.load_policy(model_dir, world, torch.device("cpu"), "fsdp", rank=rank)
        checkpoint.export_model(policy, models.load_tokenizer(model_dir), Path(out), rank, torch.bfloat16)
    finally:
        torch.distributed.destroy_process_group()


def test_fsdp_export_keeps_the_generation_config(tokenizer, tmp_path):
    """A model whose generation config has two EOS ids (Qwen3: [151645, 151643]) keeps both through an FSDP2 load
    and export: vLLM stops on the generation config's EOS ids, so losing one changes where a resumed run stops."""
    model = make_tiny_model(tokenizer, seed=3)
    eos = [tokenizer.eos_token_id, tokenizer.bos_token_id]
    model.generation_config.eos_token_id = eos
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    spawn(_export_worker, str(tmp_path / "m"), str(tmp_path / "export"))
    assert json.loads((tmp_path / "export" / "generation_config.json").read_text())["eos_token_id"] == eos


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2 training: exact resume from sharded checkpoints


@pytest.mark.slow
def test_fsdp_two_processes_resume_exactly(setup):
    """2 steps, then a resume for a third, equals 3 straight steps (metrics and weights); every rank wrote its own
    shard; the export loads with transformers."""
    common = dict(parallel="fsdp", mini_batch_size=2)
    spawn(train_worker, flags(setup, "fsdp_interrupted", **common))
    spawn(train_worker, flags(setup, "fsdp_interrupted", steps=3, resume="true", **common))
    spawn(train_worker, flags(setup, "fsdp_straight", steps=3, **common))
    runs = setup / "runs"
    a = [json.loads(line) for line in (runs / "fsdp_interrupted" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (runs / "fsdp_straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert all(r["trajectories"] == 2 * 2 and r["grad_norm"] > 0 for r in a)     # 2 questions x k=2, both ranks
    for key in ("reward", "pg_loss", "grad_norm", "entropy", "clip_hi", "resp_len"):
        assert a[2][key] == pytest.approx(b[2][key], rel=1e-6, abs=1e-9), key
    step3 = runs / "fsdp_interrupted" / "checkpoints" / "step_000003"
    shards = sorted(p.name for p in (step3 / "trainer").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]                           # each rank its own shard
    wa, wb = weights(step3), weights(runs / "fsdp_straight" / "checkpoints" / "step_000003")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-7, rtol=0, msg=k)
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(step3)
    for name, p in lm.named_parameters():
        torch.testing.assert_close(p.detach(), wa[name], atol=0, rtol=0, msg=name)


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation on all ranks


SPLIT = evaluation.EvalSettings(n=2, sampling=evaluation.rollout.Sampling(temperature=1.0, top_p=0.95),
                                max_response_tokens=10, batch_size=4)


def _eval_rows():
    return [{"question": q, "golds": [a], "meta": {"kind": "qa"}} for q, a in QA]


def _eval_worker(rank, world, model_dir, out_dir):
    from transformers import AutoTokenizer
    torch.distributed.init_process_group("gloo")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        generator = generation.TransformersGenerator(models.load_lm(model_dir, "cpu"), tokenizer, batch_size=4)
        summary = evaluation.evaluate(generator, tokenizer, _eval_rows(), EchoTools(), SPLIT, name="split",
                                      out_dir=out_dir, rank=rank, world=world, progress=False)
        Path(out_dir, f"summary{rank}.json").write_text(json.dumps(summary))
    finally:
        torch.distributed.destroy_process_group()


def test_evaluation_split_over_ranks_equals_one_process(tokenizer, tmp_path):
    """6 questions x 2 samples in chunks of 2 questions: rank 0 takes chunks 0 and 2, rank 1 chunk 1; rank 0 writes
    the merged results, equal to one process's, and both ranks return the same summary."""
    model = make_tiny_model(tokenizer, seed=7)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    generator = generation.TransformersGenerator(models.load_lm(str(tmp_path / "m"), "cpu"), tokenizer, batch_size=4)
    one = evaluation.evaluate(generator, tokenizer, _eval_rows(), EchoTools(), SPLIT, name="split",
                              out_dir=tmp_path / "one", progress=False)
    (tmp_path / "two").mkdir()                   # each rank writes its summary there (rank 0 its results too)
    spawn(_eval_worker, str(tmp_path / "m"), str(tmp_path / "two"))
    lines = lambda d: [json.loads(x) for x in (d / "split_results.jsonl").read_text().splitlines()]   # noqa: E731
    a, b = lines(tmp_path / "one"), lines(tmp_path / "two")
    assert [r["index"] for r in b] == list(range(len(QA)))
    assert [[s["text"] for s in r["samples"]] for r in a] == [[s["text"] for s in r["samples"]] for r in b]
    s0, s1 = (json.loads((tmp_path / "two" / f"summary{r}.json").read_text()) for r in (0, 1))
    for key in ("pass@1", "pass@2", "em", "f1", "reward", "format_valid", "tool_calls", "response_tokens"):
        assert s0[key] == s1[key] == one[key], key


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints: a crash mid-write, model-only checkpoints


def test_crash_while_saving_keeps_the_previous_checkpoint(setup, monkeypatch):
    calls = []
    real = checkpoint._write_export

    def export_then_crash(policy, tokenizer, out, rank, dtype):
        calls.append(out)
        real(policy, tokenizer, out, rank, dtype)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint, "_write_export", export_then_crash)
    with pytest.raises(cli.RunFailure) as failure:
        train.main(flags(setup, "crash"), score=fake_score)
    message = str(failure.value)                                            # one line: what, where, how much
    assert "\n" not in message and "could not write checkpoint step_000002" in message
    assert str(setup / "runs" / "crash" / "checkpoints") in message and "No space left on device" in message
    assert re.search(r"needs about \d+ MB and [\d.]+ (MB|GB) is free", message)
    assert "the previous checkpoint (step_000001) is intact: --resume continues from it" in message
    assert failure.value.exit_code == 1
    ckpts = checkpoint.checkpoint_dirs(setup / "runs" / "crash")
    assert [p.name for p in ckpts] == ["step_000001"]                       # step 2 never became a checkpoint
    leftovers = [p.name for p in (setup / "runs" / "crash" / "checkpoints").iterdir()]
    assert leftovers == ["step_000001"]                                      # the partial step 2 is gone
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(ckpts[0])                          # the previous one is intact


def test_a_full_disk_in_torchs_writer_is_reported_too(setup, monkeypatch):
    """torch's C++ writers raise RuntimeError("basic_ios::clear: iostream error") on a full disk: with too little
    space free that is a RunFailure; with plenty free the same error is a bug and keeps its traceback."""

    def full(*args, **kwargs):
        raise RuntimeError("basic_ios::clear: iostream error")
    monkeypatch.setattr(checkpoint, "_write_export", full)
    free = {"bytes": 1}
    usage = checkpoint.shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda path: usage(path)._replace(free=free["bytes"]))
    with pytest.raises(cli.RunFailure, match="basic_ios::clear.*1 MB is free|basic_ios::clear.*0 MB is free") as first:
        train.main(flags(setup, "full_disk", steps=1), score=fake_score)
    assert "there is no earlier checkpoint, so this run cannot be resumed" in str(first.value)   # its first one
    free["bytes"] = 10**15
    with pytest.raises(RuntimeError, match="basic_ios") as bug:
        train.main(flags(setup, "not_the_disk", steps=1), score=fake_score)
    assert not isinstance(bug.value, cli.UserError)


def test_model_only_checkpoints_resume(setup, monkeypatch, capsys):
    run = Path(train.main(flags(setup, "lean", steps=1, save_trainer_state="false"), score=fake_score)["run_dir"])
    step1 = run / "checkpoints" / "step_000001"
    assert not (step1 / "trainer").exists() and (step1 / "model.safetensors").exists()
    full = Path(train.main(flags(setup, "full", steps=1), score=fake_score)["run_dir"]) / "checkpoints" / "step_000001"
    size = lambda d: sum(p.stat().st_size for p in d.rglob("*") if p.is_file())       # noqa: E731
    assert size(step1) < 0.5 * size(full)                                    # 4 B vs 16 B per parameter
    train.main(flags(setup, "lean", steps=2, resume="true", save_trainer_state="false"), score=fake_score)
    assert "AdamW moments restart" in capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


# ---------------------------------------------------------------------------------------------------------------------
# Metrics whose keys differ between ranks


def _metrics_worker(rank, world, out):
    import transformers
    from harness.run import parallel
    parallel.init("cpu", timeout_min=1)        # a collective mismatch then fails within a minute instead of hanging
    try:
        local = {"reward": 1.0 + rank, "n_traj": 4.0}
        if rank == 1:                          # only rank 1 called a tool this step: only it has tool counts
            local.update({"tools/search/calls": 3.0, "tools/search/errors": 1.0})
        bars = transformers.utils.logging.is_progress_bar_enabled()
        torch.save({"metrics": parallel.reduce_metrics(local), "bars": bars}, f"{out}.{rank}")
    finally:
        parallel.close()


def test_metrics_whose_keys_only_some_ranks_have_are_summed(tmp_path):
    """A tool nobody called on rank 0 has no count there: the all-reduce must still have one length on every rank
    (the README's 2-process command aborted in gloo with `80 vs 56` bytes when it did not). Only rank 0 shows the
    libraries' progress bars (one "Loading weights" bar, not one per rank)."""
    spawn(_metrics_worker, str(tmp_path / "m"))
    for rank in (0, 1):
        got = torch.load(f"{tmp_path / 'm'}.{rank}")
        assert got["metrics"] == {"reward": 3.0, "n_traj": 8.0, "tools/search/calls": 3.0, "tools/search/errors": 1.0}
        assert got["bars"] is (rank == 0)


# ---------------------------------------------------------------------------------------------------------------------
# REINFORCE++ (algorithm.md §7): its returns are normalised over the whole batch, all ranks together


def reinforce_pp_advantages(tokenizer, rank=0, world=1):
    """The per-token advantages train.old_policy_pass gives with --set reinforce_pp for this rank's half of 4 questions ×
    k = 2 (all of them with one process): [(question, trajectory, its Ã at the mask-1 tokens)]."""
    cfg = config.Config(reinforce_pp=True, entropy_advantage=False, micro_batch_size=3)
    policy = policy_mod.Policy(make_tiny_model(tokenizer, seed=2))
    trajectories, rewards = hand_made_trajectories(n_questions=4, k=2, seed=3)
    per = len(trajectories) // world
    mine, mine_rewards = trajectories[rank * per:(rank + 1) * per], rewards[rank * per:(rank + 1) * per]
    batches = train.micro_batches(mine, train.outcome_advantages(mine, mine_rewards, cfg, 0), mine_rewards, 1, cfg, 0,
                                  "cpu")
    olds, _, _ = train.old_policy_pass(policy, None, batches, cfg, contextlib.nullcontext)
    flat = [(old.adv_tilde[i], mb.mask[i]) for mb, old in zip(batches[0], olds[0]) for i in range(len(mb.mask))]
    return [(t.group_id, t.traj_id, adv[mask.bool()].tolist()) for t, (adv, mask) in zip(mine, flat)]


def _reinforce_pp_worker(rank, world, model_dir, out):
    from transformers import AutoTokenizer
    torch.distributed.init_process_group("gloo")
    try:
        got = reinforce_pp_advantages(AutoTokenizer.from_pretrained(model_dir), rank, world)
        Path(f"{out}.{rank}").write_text(json.dumps(got))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_reinforce_pp_normalises_over_all_ranks(tokenizer, tmp_path):
    """Two ranks with two questions each give every token the advantage one process gives it: the mean and std of
    the returns are over the whole batch (an all-reduce), not over each rank's half (which shifts every value here)."""
    tokenizer.save_pretrained(tmp_path / "tok")
    one = reinforce_pp_advantages(tokenizer)
    spawn(_reinforce_pp_worker, str(tmp_path / "tok"), str(tmp_path / "adv"))
    two = [row for rank in (0, 1) for row in json.loads(Path(f"{tmp_path / 'adv'}.{rank}").read_text())]
    assert [list(row[:2]) for row in two] == [list(row[:2]) for row in one]
    for (_, _, a), (_, _, b) in zip(one, two):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    assert len({round(v, 6) for _, _, adv in one for v in adv}) > 2                # the returns do vary


class Killed(Exception):
    """Stands in for a kill between two writes of a checkpoint."""


@pytest.mark.parametrize("point", ["trainer shards", "export", "trainer_state.pt"])
def test_a_checkpoint_folder_appears_only_complete(point, setup, monkeypatch):
    """A failure between the writes of checkpoint 2 (after its trainer shards, its export or its trainer_state.pt
    began) leaves no step_000002 folder at all, complete or not: the files go into a temporary folder that is
    renamed into place last. --resume then starts from checkpoint 1 and writes checkpoint 2 whole."""
    import torch.distributed.checkpoint as dcp
    run = setup / "runs" / f"atomic_{point.split()[0].replace('.', '_')}"
    real = {"trainer shards": (dcp, "save"), "export": (checkpoint, "_write_export"),
            "trainer_state.pt": (checkpoint.torch, "save")}[point]
    original = getattr(*real)

    def killed_at_step_2(*args, **kwargs):
        writes_it = point != "trainer_state.pt" or str(args[1]).endswith("trainer_state.pt")   # not DCP's own saves
        if writes_it and (run / "checkpoints" / "step_000001" / "trainer_state.pt").exists():
            raise Killed(f"killed while writing the {point} of checkpoint 2")
        return original(*args, **kwargs)
    monkeypatch.setattr(*real, killed_at_step_2)
    with pytest.raises(Killed):
        train.main(flags(setup, run.name), score=fake_score)
    assert not (run / "checkpoints" / "step_000002").exists()
    assert [p.name for p in checkpoint.checkpoint_dirs(run)] == ["step_000001"]
    monkeypatch.setattr(*real, original)
    train.main(flags(setup, run.name, resume="true"), score=fake_score)
    final = run / "checkpoints" / "step_000002"
    assert [p.name for p in checkpoint.checkpoint_dirs(run)] == ["step_000001", "step_000002"]
    assert {"trainer_state.pt", "config.yaml", "run_info.json", "model.safetensors", "trainer"} <= \
        {p.name for p in final.iterdir()}


def _hang_worker(rank, world, argv, log_dir):
    import sys as _sys
    from tests.fakes import HangOnRank1
    _sys.stderr = open(Path(log_dir) / f"stderr{rank}.txt", "w", buffering=1)   # the watchdog writes to stderr
    train.main(argv, score=fake_score, make_generator=HangOnRank1.factory())


def test_the_watchdog_names_the_rank_that_hangs_and_the_one_that_waits(setup, tmp_path):
    """Two ranks; rank 1's python call sleeps 12 s while rank 0 has finished its rollout. With --watchdog_min 0.05
    (3 s) rank 1 says which call it has been running, and rank 0 that it has been waiting for the other ranks; the
    step then goes on (the call ends) and the step line shows the slow rank's share."""
    spawn(_hang_worker, flags(setup, "hang", steps=1, parallel="ddp", watchdog_min=0.05,
                              python_limits="{timeout_s: 20}",
                              max_response_tokens=40, k=2, eval_data=""), str(tmp_path))
    one = (tmp_path / "stderr1.txt").read_text()
    zero = (tmp_path / "stderr0.txt").read_text()
    assert "watchdog: rank 1 has been running python call 'import time; time.sleep(12)' for" in one, one[-2000:]
    assert "watchdog: rank 0 has been waiting for the other ranks" in zero, zero[-2000:]
    print(re.search(r"watchdog: rank 1 has been running python[^\r\n]*", one).group(0))
    print(re.search(r"watchdog: rank 0 has been waiting[^\r\n]*", zero).group(0))
    row = json.loads((setup / "runs" / "hang" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["time/rollout_slowest"] > 10 and row["time/rollout_imbalance"] > 1.5
