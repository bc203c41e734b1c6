"""Faults as a user meets them, on the tiny model of `setup`: a trainer killed with SIGKILL (in a subprocess) resumes
exactly, with non-zero gradients, to the same weights and AdamW moments as an uninterrupted run; two runs never share
a folder (a lock; a killed run's lock is taken over); a run stopped before its first checkpoint restarts clean (its
folder moved aside, never appended to); a run stopped during its final evaluation runs it on --resume; a failed
resume writes nothing; damaged checkpoints end in one line; U+2028, U+2029 and U+0085 in a question, a corpus row and
a tool's output are text, and a --resume keeps every row that holds them."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from harness import cli
from harness.run import checkpoint
from tests.conftest import flags, weights
from tests.fakes import PrintsSeparators, fake_score

ROOT = Path(__file__).resolve().parents[1]
REWARD = "--reward=tests/fakes.py:varied_reward"


def rows_of(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def start(argv: list[str]) -> subprocess.Popen:
    """`python train.py argv` in a process of its own (HF offline), its output in a pipe."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(condition, process: subprocess.Popen, what: str, within_s: float = 120) -> None:
    """Poll condition() until it holds; the run ending first fails, naming `what`. The deadline only bounds a wait
    that would otherwise hang (a run stuck before `what`): it is not a timing assertion."""
    deadline = time.monotonic() + within_s
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never happened")
        time.sleep(0.05)


def trainer_state(ckpt: Path) -> dict:
    """The checkpoint's trainer/ shards (model and AdamW state) as one flat dict of tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt / "trainer"), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, v in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value
    walk("", torch.load(out, weights_only=False))
    out.unlink()
    return flat


def test_kill_9_then_resume_is_exact_with_real_gradients(setup):
    """4 steps with a varied reward (advantages and gradients non-zero), killed with SIGKILL once checkpoint 2 is
    written, resumed: the metrics of steps 3-4, the weights and the AdamW moments equal an uninterrupted run's."""
    common = dict(steps=4, save_every=2, keep_checkpoints=4)
    straight = start(flags(setup, "k9_straight", **common) + [REWARD])
    assert straight.wait(timeout=600) == 0, straight.stdout.read()[-3000:]
    killed = start(flags(setup, "k9_killed", **common) + [REWARD])
    run = setup / "runs" / "k9_killed"
    wait_for(lambda: (run / "checkpoints" / "step_000002" / "trainer_state.pt").exists(), killed, "checkpoint 2")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert [c.name for c in checkpoint.checkpoint_dirs(run)] == ["step_000002"]   # killed before step 4 finished
    resumed = start(flags(setup, "k9_killed", resume="true", **common) + [REWARD])
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output[-3000:]
    assert "taken over" in output                # the killed run's lock
    a, b = rows_of(run, "metrics.jsonl"), rows_of(setup / "runs" / "k9_straight", "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 and r["adv_nonzero"] > 0 for r in b)           # real gradients every step
    for key in ("reward", "pg_loss", "grad_norm", "entropy", "resp_len"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-6, abs=1e-9), key
    wa, wb = weights(run / "checkpoints" / "step_000004"), weights(setup / "runs" / "k9_straight" / "checkpoints"
                                                                           / "step_000004")
    sa, sb = (trainer_state(r / "checkpoints" / "step_000004") for r in (run, setup / "runs" / "k9_straight"))
    moments = [k for k in sa if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and sa.keys() == sb.keys()
    assert all(float(sb[k].abs().max()) > 0 for k in moments)                    # the moments are not zero
    diffs = {"weights": max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa),
             "moments": max(float((sa[k].float() - sb[k].float()).abs().max()) for k in moments)}
    print(f"grad norms {[round(r['grad_norm'], 6) for r in b]}; largest differences {diffs}")
    assert diffs["weights"] <= 1e-7 and diffs["moments"] <= 1e-9


def test_one_run_per_folder(setup):
    """A second run with the same --run_name while the first runs: one line naming the first, nothing of the first
    touched; a first run killed (SIGKILL) leaves its lock free: a --resume takes it over."""
    first = start(flags(setup, "locked", steps=40) + [REWARD])
    run, lock = setup / "runs" / "locked", setup / "runs" / ".locked.lock"
    wait_for(lambda: checkpoint.checkpoint_dirs(run), first, "a first checkpoint")
    try:
        for resume in ("false", "true"):
            with pytest.raises(cli.UserError) as second:
                train.main(flags(setup, "locked", steps=40, resume=resume), score=fake_score)
            line = str(second.value)
            assert "\n" not in line and f"{run} is in use by another run (pid {first.pid} on " in line, line
            assert "give another --run_name" in line
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert f"pid {first.pid}" in lock.read_text()                                 # what the killed run left
    steps = int(checkpoint.checkpoint_dirs(run)[-1].name.split("_")[1]) + 1
    out = train.main(flags(setup, "locked", steps=steps, resume="true"), score=fake_score)
    assert out["steps"] == steps and not lock.exists()                              # taken, then removed at the end


def test_a_run_stopped_before_its_first_checkpoint_restarts_clean(setup, monkeypatch):
    real = train.rl_step

    def step_then_die(run, step, progress=None):
        if step == 1:
            raise RuntimeError("the machine went away")
        return real(run, step, progress)
    monkeypatch.setattr(train, "rl_step", step_then_die)
    argv = flags(setup, "partial", steps=2, save_every=0, eval_data=str(setup / "qa.jsonl"), eval_limit=1, eval_n=1)
    with pytest.raises(RuntimeError, match="went away"):
        train.main(argv, score=fake_score)
    run = setup / "runs" / "partial"
    assert [r["step"] for r in rows_of(run, "metrics.jsonl")] == [1] and not checkpoint.checkpoint_dirs(run)
    monkeypatch.setattr(train, "rl_step", real)
    train.main(argv, score=fake_score)                                            # the same command again
    assert [r["step"] for r in rows_of(run, "metrics.jsonl")] == [1, 2]         # not [1, 1, 2]
    aside = [p for p in run.parent.iterdir() if p.name.startswith("partial.partial-")]
    assert len(aside) == 1 and [r["step"] for r in rows_of(aside[0], "metrics.jsonl")] == [1]
    before = json.loads((run / "eval" / "before_summary.json").read_text())
    assert before["wall_s"] != json.loads((aside[0] / "eval" / "before_summary.json").read_text())["wall_s"] or \
        (run / "eval" / "before_summary.json").stat().st_mtime > (aside[0] / "eval" / "before_summary.json").stat().st_mtime


def test_a_run_stopped_during_its_final_evaluation_runs_it_on_resume(setup, monkeypatch):
    real = train.evaluate

    def evaluate(run, name):
        if name == "after":
            raise RuntimeError("killed during the final evaluation")
        return real(run, name)
    monkeypatch.setattr(train, "evaluate", evaluate)
    argv = flags(setup, "cut_eval", steps=1, eval_data=str(setup / "qa.jsonl"), eval_limit=1, eval_n=1)
    with pytest.raises(RuntimeError, match="final evaluation"):
        train.main(argv, score=fake_score)
    run = setup / "runs" / "cut_eval"
    assert not (run / "eval" / "after_summary.json").exists()
    monkeypatch.setattr(train, "evaluate", real)
    out = train.main(argv + ["--resume=true"], score=fake_score)
    assert (run / "eval" / "after_summary.md").exists() and "after" in out["evals"]
    stamp = (run / "eval" / "after_summary.json").stat().st_mtime
    train.main(argv + ["--resume=true"], score=fake_score)                         # finished: not evaluated again
    assert (run / "eval" / "after_summary.json").stat().st_mtime == stamp


def test_a_failed_resume_writes_nothing_and_damaged_checkpoints_are_one_line(setup):
    train.main(flags(setup, "damaged", steps=1), score=fake_score)
    run = setup / "runs" / "damaged"
    ckpt = checkpoint.checkpoint_dirs(run)[-1]
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}

    def resume_fails(match: str) -> None:
        with pytest.raises(cli.UserError, match=match) as failure:
            train.main(flags(setup, "damaged", steps=2, resume="true"), score=fake_score)
        assert "\n" not in str(failure.value)
        now = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        assert now == files, sorted(set(now) ^ set(files))                          # not even config_history.yaml
    state = (ckpt / "trainer_state.pt").read_bytes()
    (ckpt / "trainer_state.pt").write_bytes(state[:len(state) // 2])               # truncated
    files[ckpt / "trainer_state.pt"] = (ckpt / "trainer_state.pt").read_bytes()
    resume_fails(r"--resume: .*step_000001/trainer_state.pt cannot be read")
    (ckpt / "trainer_state.pt").write_bytes(state)
    files[ckpt / "trainer_state.pt"] = state
    shard = next((ckpt / "trainer").glob("*.distcp"))
    data = shard.read_bytes()
    shard.unlink()
    del files[shard]
    resume_fails(r"--resume: .*step_000001/trainer cannot be read")
    shard.write_bytes(data)
    files[shard] = data
    model = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").unlink()
    del files[ckpt / "model.safetensors"]
    resume_fails(r"--resume .*step_000001: no weights")
    (ckpt / "model.safetensors").write_bytes(model)
    files[ckpt / "model.safetensors"] = model
    config_json = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(config_json.replace('"hidden_size": 32', '"hidden_size": 64'))
    files[ckpt / "config.json"] = (ckpt / "config.json").read_bytes()
    resume_fails(r"--resume: .*step_000001 holds another model than --model .*tiny: hidden_size 64 \(--model's 32\)")


def test_line_separators_in_text_keep_every_row_through_a_resume(setup, tmp_path, capsys):
    """U+2028, U+2029 and U+0085, which JSON writes raw (ensure_ascii=False) and str.splitlines() takes for line
    ends, in a question, a search corpus row and a python call's output: the run reads them, finishes (its trees
    drawn from trees.jsonl) and a --resume keeps every complete row of samples.jsonl and trees.jsonl, with no
    warning of lines cut mid-write."""
    odd = "\u2028\u2029\x85"
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"What is{odd}the capital of France? ({i})", "answer": ["Paris"]},
                                     ensure_ascii=False) + "\n" for i in range(4)), encoding="utf-8")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": f"Paris{odd}", "text": f"The capital{odd}of France."},
                                 ensure_ascii=False) + "\n" + json.dumps({"id": "2", "title": "Rome", "text": "Italy"}),
                      encoding="utf-8")
    common = dict(train_data=qa, search="bm25", search_kw=json.dumps({"corpus_path": str(corpus)}),
                  max_response_tokens=60)
    train.main(flags(setup, "separators", steps=1, **common), score=fake_score,
               make_generator=PrintsSeparators.factory())
    run = setup / "runs" / "separators"
    assert (run / "trees.png").exists()
    before = {name: (run / name).read_text(encoding="utf-8") for name in ("samples.jsonl", "trees.jsonl")}
    samples = [json.loads(line) for line in before["samples.jsonl"].split("\n")[:-1]]
    assert len(samples) == 2 and all(row["question"].startswith(f"What is{odd}the capital") for row in samples)
    assert all("<result>\none\u2028two\u2029threefour\n</result>" in row["text"] for row in samples)   # U+0085: D46
    assert [rec["step"] for rec in map(json.loads, before["trees.jsonl"].split("\n")[:-1])] == [1, 1]
    capsys.readouterr()
    train.main(flags(setup, "separators", steps=2, resume="true", **common), score=fake_score,
               make_generator=PrintsSeparators.factory())
    assert "warning" not in capsys.readouterr().err
    for name, text in before.items():
        after = (run / name).read_text(encoding="utf-8")
        assert after.startswith(text) and len(after.split("\n")) > len(text.split("\n")), name
