"""A newcomer's mistakes get one clear line: every user mistake is `error: ...` on stderr with exit code 2 and no
traceback, before the run folder exists; --resume refuses changed settings (and keeps the config history); the
defaults fit any number of processes; eval.py evaluates a run the way it trained; a search backend that is down is
caught at start-up and, mid-run, named in the step line; bare boolean flags work."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness import cli
from harness import config
import eval as evaluation
from harness import generation
from harness import search as search_mod
import train
from tests._http_server import FakeServer
from tests.conftest import flags
from tests.fakes import SearchFirst, fake_score

ROOT = Path(__file__).resolve().parents[1]


def command(capsys, main, argv) -> tuple[int, str]:
    """cli.run_cli, as the command line runs it: (exit code, stderr)."""
    code = cli.run_cli(main, argv)
    return code, capsys.readouterr().err


def mistakes(root: Path, tmp: Path) -> dict:
    """Each kind of mistake a user makes: flags to add, and what the one line must say."""
    (tmp / "no_answer.jsonl").write_text(json.dumps({"question": "Q?", "answer": ["A"]}) + "\n" +
                                         json.dumps({"question": "Q2?"}) + "\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "not_json.jsonl").write_text('{"question": "Q?", "answer": "A"}\n{oops\n')
    (tmp / "not_a_model").mkdir(exist_ok=True)
    (tmp / "not_a_model" / "notes.txt").write_text("hello")
    return {
        "malformed row": (dict(train_data=tmp / "no_answer.jsonl"), "line 2: malformed row: no 'answer' field"),
        "not JSON": (dict(train_data=tmp / "not_json.jsonl"), "line 2: malformed row"),
        "empty file": (dict(train_data=tmp / "empty.jsonl"), "no questions in it"),
        "missing file": (dict(eval_data=tmp / "nope.jsonl"), "--eval_data .*nope.jsonl: file not found"),
        "not a model": (dict(model=tmp / "not_a_model"), "no config.json there, so not a transformers model"),
        "no such model": (dict(model=tmp / "gone"), "not a local model directory"),
        "bad sizes": (dict(questions_per_step=6, mini_batch_size=4), "must be a multiple of --mini_batch_size"),
        "unknown flag": (dict(learning_rate=0.1), "unrecognized arguments: --learning_rate"),
        "unknown backend": (dict(search="bing"), "--search bing: unknown search backend"),
        "too few questions": (dict(questions_per_step=8, mini_batch_size=8), "fewer than --questions_per_step"),
    }


@pytest.mark.parametrize("kind", ["malformed row", "not JSON", "empty file", "missing file", "not a model",
                                  "no such model", "bad sizes", "unknown flag", "unknown backend", "too few questions"])
def test_user_mistakes_are_one_line_and_leave_nothing(kind, setup, tmp_path, capsys):  # noqa: F811
    over, expected = mistakes(setup, tmp_path)[kind]
    code, err = command(capsys, train.main, flags(setup, f"mistake_{kind.replace(' ', '_')}", **over))
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    import re
    assert re.search(expected, lines[0]), lines[0]
    assert not (setup / "runs" / f"mistake_{kind.replace(' ', '_')}").exists()       # no orphan run folder
    assert "Traceback" not in err


def test_the_command_line_itself(setup):
    """The real `python train.py` process: one line on stderr, exit code 2, no config dump on stdout."""
    proc = subprocess.run([sys.executable, "train.py", *flags(setup, "cli", train_data=str(setup / "nope.jsonl"))],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: --train_data {setup / 'nope.jsonl'}: file not found"]
    assert "learning" not in proc.stdout and "k: 2" not in proc.stdout


def test_bare_boolean_flags():
    cfg = config.parse_config(["--skip_bad", "--resume", "--sg_clip", "false", "--bf16"])
    assert cfg.skip_bad is True and cfg.resume is True and cfg.sg_clip is False and cfg.bf16 is True
    assert config.parse_config([]).skip_bad is False


def test_defaults_fit_any_number_of_processes():
    """Left at their defaults the sizes grow with the processes (each keeps the one-process share); set by the user
    they must fit, and the error says which values would."""
    cfg, note = config.fit_world(config.Config(), 2)
    assert (cfg.questions_per_step, cfg.mini_batch_size) == (4, 2) and "--questions_per_step 2 -> 4" in note
    assert config.fit_world(config.Config(), 1) == (config.Config(), "")
    cfg, note = config.fit_world(config.Config(questions_per_step=8, mini_batch_size=4), 4)
    assert note == "" and cfg.questions_per_step == 8
    with pytest.raises(cli.UserError, match="--questions_per_step 8 --mini_batch_size 4"):
        config.fit_world(config.Config(questions_per_step=6, mini_batch_size=3), 4)


def test_resume_refuses_changed_settings_and_keeps_history(setup, monkeypatch, capsys):  # noqa: F811
    run = Path(train.main(flags(setup, "history", steps=1), score=fake_score)["run_dir"])
    first = (run / "config.yaml").read_text()
    code, err = command(capsys, train.main, flags(setup, "history", steps=2, resume="true", k=3, lr=0.01))
    assert code == 2
    assert "k: 2 -> 3" in err and "lr: 0.001 -> 0.01" in err and "--allow_config_change" in err
    # length, evaluation and logging settings may change; the history keeps every start, config.yaml the first
    train.main(flags(setup, "history", steps=2, resume="true", log_samples=1, eval_n=3), score=fake_score)
    assert (run / "config.yaml").read_text() == first
    history = [d for d in yaml.safe_load_all((run / "config_history.yaml").read_text()) if d]
    assert len(history) == 1 and history[0]["steps"] == 2 and history[0]["log_samples"] == 1
    train.main(flags(setup, "history", steps=3, resume="true", k=3, allow_config_change="true"), score=fake_score)
    history = [d for d in yaml.safe_load_all((run / "config_history.yaml").read_text()) if d]
    assert [d["k"] for d in history] == [2, 3]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["trajectories"] == 2 * 3


def test_eval_takes_the_runs_settings(setup, monkeypatch, capsys, tmp_path):
    """eval.py --run: the run's data, search, token budget, tool limit and sampling; flags override; --model alone
    on a checkpoint of a run says which settings differ from training's."""
    run = Path(train.main(flags(setup, "evalrun", steps=1, eval_data=str(setup / "qa.jsonl"), eval_limit=2,
                                eval_n=3, eval_temperature=0.7, max_tool_calls=2, eval_before="false"), score=fake_score)["run_dir"])
    capsys.readouterr()
    evaluation.main(["--run", str(run), "--device", "cpu", "--n", "2", "--out_dir", str(tmp_path / "a")])
    used = json.loads((tmp_path / "a" / "config.json").read_text())
    assert used["model"] == str(run / "checkpoints" / "step_000001")
    assert (used["data"], used["limit"], used["n"], used["temperature"]) == (str(setup / "qa.jsonl"), 2, 2, 0.7)
    assert (used["max_response_tokens"], used["max_tool_calls"], used["search"]) == (12, 2, "replay")
    assert used["search_kw"]["path"] == str(setup / "search.json")
    assert "with the settings of" in capsys.readouterr().out
    evaluation.main(["--model", str(run / "checkpoints" / "step_000001"), "--data", str(setup / "qa.jsonl"),
                     "--limit", "1", "--n", "1", "--max_response_tokens", "8", "--device", "cpu", "--search",
                     "replay", "--search_kw", json.dumps({"path": str(setup / "search.json")}),
                     "--out_dir", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert f"add --run {run}" in out and "max_response_tokens 12 (here 8)" in out
    code, err = command(capsys, evaluation.main, ["--run", str(run), "--step", "7"])
    assert code == 2 and "no checkpoint of step 7 (have: step_000001)" in err
    code, err = command(capsys, evaluation.main, ["--model", str(setup)])
    assert code == 2 and "no config.json there" in err


def test_eval_help_explains_every_flag():
    proc = subprocess.run([sys.executable, "eval.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for field in evaluation.EvalConfig.__dataclass_fields__.values():
        first_words = " ".join(field.metadata["help"].split()[:3])
        assert f"--{field.name}" in proc.stdout and first_words in " ".join(proc.stdout.split()), field.name


def test_search_backend_down_at_start(setup, tmp_path, capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                                          # closed again: nobody listens
    url = f"http://127.0.0.1:{port}/retrieve"
    code, err = command(capsys, train.main, flags(setup, "down", search="http", search_kw=json.dumps({"url": url})))
    assert code == 1 and err.startswith("error: search backend HTTPSearch(url=") and "unreachable" in err
    assert not (setup / "runs" / "down").exists()


def test_search_backend_failing_mid_run_is_named(setup, monkeypatch, capsys):
    """The backend answers the start-up check, then fails every call: the step line says `search errors n/n` and a
    warning names the backend and its last error."""
    with FakeServer() as srv:
        kw = json.dumps({"url": srv.url("/first_only"), "retries": 0})
        train.main(flags(setup, "failing", steps=1, search="http", search_kw=kw, max_response_tokens=120), score=fake_score, make_generator=SearchFirst.factory())
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("step 1/1"))
    assert "search errors 4/4" in line
    warning = next(x for x in out.splitlines() if x.startswith("warning: search failed on 4 of 4 calls"))
    assert "HTTPSearch(url=" in warning and "HTTP 500" in warning
    assert search_mod.HTTPSearch(srv.url("/x")).retries == 3                # the check left the backend as it was


# ---------------------------------------------------------------------------------------------------------------------
# Ctrl-C: one line, exit code 130, nothing half-kept


def interrupt(argv: list[str], ready, timeout: float = 600) -> subprocess.CompletedProcess:
    """Start `python train.py argv`, wait until ready() (polled), then send SIGINT as Ctrl-C does."""
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + timeout
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_before_the_first_step_leaves_no_folder(setup):
    """Interrupted during the evaluation before training: one line, code 130, and the new run's folder is gone."""
    run = setup / "runs" / "ctrlc_early"
    argv = flags(setup, "ctrlc_early", eval_data=str(setup / "qa.jsonl"), eval_n=8, max_response_tokens=400,
                 steps=1)
    proc = interrupt(argv, lambda: (run / "config.yaml").exists())
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("interrupted", "error", "Traceback"))]
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert lines == [f"interrupted: no training step was finished, so {run} was removed (nothing to keep)"], lines
    assert "Traceback" not in proc.stderr and not run.exists()


@pytest.mark.slow
def test_ctrl_c_after_a_step_says_what_was_kept_and_the_resume_works(setup):
    run = setup / "runs" / "ctrlc_late"
    argv = flags(setup, "ctrlc_late", steps=40, save_every=2)
    metrics = run / "metrics.jsonl"
    proc = interrupt(argv, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3)
    assert proc.returncode == 130, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    import re
    found = re.fullmatch(r"interrupted: stopped after step (\d+)/40: (.+) keeps the logs of steps 1-(\d+) and "
                         r"checkpoint step_(\d+)(?: \(\d+ step\(s\) after it will run again\))?; continue with: "
                         r"python train\.py --resume true --run_name ctrlc_late --out_dir (.+)", line)
    assert found, line
    done, ckpt = int(found.group(1)), int(found.group(4))
    assert found.group(2) == str(run) and found.group(5) == str(setup / "runs") and ckpt == done - done % 2
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()][-1] >= done
    resumed = subprocess.run([sys.executable, "train.py", *flags(setup, "ctrlc_late", steps=ckpt + 1, save_every=2),
                              "--resume", "true"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, ckpt + 2))


# ---------------------------------------------------------------------------------------------------------------------
# More places a newcomer met a traceback or a silent surprise


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "out_dir is a file", "out_dir unwritable", "abbreviated"])
def test_more_mistakes_are_caught_before_any_work(kind, setup, tmp_path, capsys, monkeypatch):  # noqa: F811
    import importlib.util
    (tmp_path / "a_file").write_text("x")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",          # the optional packages are absent here, or made so
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real_find_spec(name, *a))
    over, expected = {
        "tensorboard": ({"tensorboard": "true"}, "--tensorboard needs the tensorboard package: pip install tensorboard"),
        "wandb": ({"wandb": "true"}, "--wandb needs the wandb package: pip install wandb"),
        "out_dir is a file": ({"out_dir": tmp_path / "a_file" / "runs"}, "a_file is a file, not a directory"),
        "out_dir unwritable": ({"out_dir": "/proc/aepo/runs"}, "--out_dir /proc/aepo/runs: cannot write in /proc"),
        "abbreviated": ({}, "unrecognized arguments: --step"),
    }[kind]
    argv = flags(setup, f"more_{kind.replace(' ', '_')}", **over) + (["--step", "8"] if kind == "abbreviated" else [])
    code, err = command(capsys, train.main, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
    assert not (setup / "runs" / f"more_{kind.replace(' ', '_')}").exists()


def test_eval_refuses_an_empty_data_file(tmp_path, capsys, setup):
    (tmp_path / "empty.jsonl").write_text("")
    code, err = command(capsys, evaluation.main, ["--model", str(setup / "tiny"), "--data", str(tmp_path / "empty.jsonl"),
                                              "--out_dir", str(tmp_path / "out")])
    assert code == 2 and err.strip() == f"error: --data {tmp_path / 'empty.jsonl'}: no questions in it"
    assert not (tmp_path / "out").exists()


def test_resume_keeps_the_runs_own_evaluation_settings(setup, monkeypatch):
    """--resume without evaluation flags evaluates (and records) the way the run did, not with the defaults."""
    argv = flags(setup, "resume_eval", steps=1, eval_data=str(setup / "qa.jsonl"), eval_before="false")
    run = Path(train.main(argv + ["--eval_limit", "3", "--eval_n", "1"], score=fake_score)["run_dir"])
    resumed = [a for a in argv if not a.startswith("--steps=")] + ["--steps=2", "--resume=true"]
    train.main(resumed, score=fake_score)
    history = [d for d in yaml.safe_load_all((run / "config_history.yaml").read_text()) if d]
    assert (history[-1]["eval_limit"], history[-1]["eval_n"]) == (3, 1)
    after = json.loads((run / "eval" / "after_summary.json").read_text())
    assert (after["questions"], after["n"]) == (3, 1)


def test_trees_of_a_missing_step_is_one_line(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trees.jsonl").write_text(json.dumps({"step": 1, "trajectories": []}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "harness.trees", str(tmp_path / "run"), "--step", "5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'run' / 'trees.jsonl'}: no trees of step 5 "
                                                "(steps 1..1)"]
