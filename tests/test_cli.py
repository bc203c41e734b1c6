"""A newcomer's mistakes get one clear line: every user mistake is `error: ...` on stderr with exit code 2 and no
traceback, before the run folder exists; --resume refuses changed settings (and keeps the config history) and a
folder whose settings are not its checkpoint's; python limits that count are whole numbers; the defaults fit any
number of processes; eval.py evaluates a run the way it trained; a search backend that is down is caught at start-up
and, mid-run, named in the step line; console lines carry no bidirectional controls; bare boolean flags work."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness import cli
from harness import config
from harness import parser
import eval as evaluation
from harness import generation
from harness import search as search_mod
import train
from tests._http_server import FakeServer
from tests.conftest import flags
from tests.fakes import SearchFirst, fake_score

ROOT = Path(__file__).resolve().parents[1]

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
        "unknown backend": (dict(search="bing"), "--search 'bing' is out of range: it must be one of bm25"),
        "too few questions": (dict(questions_per_step=8, mini_batch_size=8), "fewer than --questions_per_step"),
        "a flag that went": (dict(sg_clip_low="true"), "--sg_clip_low is gone: use --surrogate gppo"),
        "a YAML key that went": (dict(config=_yaml(tmp, "old.yaml", "lr: 0.001\nentropy_coeff: 0.1\n")),
                                 "--entropy_coeff is gone: use --entropy_coef"),
        "bad python limit": (dict(python_limits='{memory_mb: 9}'), "--python_limits: unknown key.s. memory_mb; the "
                                                                   "keys are timeout_s, max_processes"),
        "fractional python limit": (dict(python_limits='{timeout_s: 2.5, disk_mb: 1.5}'),
                                    r"^error: --python_limits: disk_mb must be a whole number \(at least 1\), "
                                    r"got 1.5$"),
        "bad cold-start key": (dict(cold_start_kw='{step: 9}'), "--cold_start_kw: unknown key step"),
        "bad mismatch band": (dict(mismatch_band="[2, 3]"), "--mismatch_band .2.0, 3.0.: two numbers"),
        "a bad value given to --set": (dict(set="mismatch_band=[2, 3]"), "^error: --mismatch_band .2.0, 3.0.: two "
                                                                         "numbers"),
        "an unknown --set key": (dict(set="pakced=false"), r"^error: --set pakced=false: no such setting 'pakced' "
                                                           r"\(did you mean packed.*python train.py --help lists "
                                                           r"them\)$"),
        "set: in a YAML file": (dict(config=_yaml(tmp, "set.yaml", "set: [packed=false]\n")),
                                "set.yaml: line 1: 'set:' is not a setting: a --config file gives every setting as a "
                                "plain key"),
    }


def _yaml(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    return tmp / name


@pytest.mark.parametrize("kind", ["malformed row", "not JSON", "empty file", "missing file", "not a model",
                                  "no such model", "bad sizes", "unknown flag", "unknown backend", "too few questions",
                                  "a flag that went", "a YAML key that went", "bad python limit",
                                  "fractional python limit", "bad cold-start key", "bad mismatch band",
                                  "a bad value given to --set", "an unknown --set key", "set: in a YAML file"])
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


def test_set_keys_are_typed_like_flags_and_round_trip(tmp_path):
    """--set KEY=VALUE (several after one --set, or --set again), the alias, sets a setting typed as its flag is, in
    its place among the flags (the later wins); a --config file gives it as a plain key; a run's saved config.yaml,
    which holds every setting, comes back equal as --resume's defaults and as a --config file."""
    from harness.run import rundir
    cfg = config.parse_config(["--set", "packed=false", "mismatch_band=[0.4, 3]", "--k", "3", "--set=gen_batch_size=8"])
    assert (cfg.packed, cfg.mismatch_band, cfg.k, cfg.gen_batch_size) == (False, [0.4, 3.0], 3, 8)
    assert config.parse_config(["--set", "packed=false", "--set", "packed=true"]).packed is True
    overlay = _yaml(tmp_path, "dapo_like.yaml", "dynamic_sampling: true\noverlong_cache: 51\n")
    assert config.parse_config(["--config", str(overlay)]).overlong_cache == 51
    assert config.parse_config(["--config", str(overlay), "--set", "overlong_cache=7"]).overlong_cache == 7
    assert config.parse_config(["--set", "overlong_cache=7", "--config", str(overlay)]).overlong_cache == 51
    saved = yaml.safe_load(rundir.config_yaml(cfg))
    assert config.parse_config([], defaults=saved) == cfg
    assert config.parse_config(["--config", str(_yaml(tmp_path, "config.yaml", rundir.config_yaml(cfg)))]) == cfg
    assert config.parse_config(["--set", "gen_batch_size=16"], defaults=saved).gen_batch_size == 16
    with pytest.raises(cli.UserError, match=r"^--gen_batch_size 0 is out of range: it must be in \[1, inf\)$"):
        config.parse_config(["--set", "gen_batch_size=0"])
    with pytest.raises(cli.UserError, match='Parser key "packed"'):
        config.parse_config(["--set", "packed=maybe"])
    with pytest.raises(cli.UserError, match="^--set needs KEY=VALUE, an alias of the flag --KEY VALUE "):
        config.parse_config(["--set", "--k", "3"])
    evaluated = evaluation.EvalConfig(**{k: v for k, v in config.parse_args(
        config.build_parser(evaluation.EvalConfig), ["--set", "top_k=40", "dtype=float32"], "eval.py",
        evaluation.EvalConfig).items() if k != "config"})
    assert (evaluated.top_k, evaluated.dtype) == (40, "float32")


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


def test_python_limits_that_count_are_whole_numbers():
    """max_processes, total_memory_mb and disk_mb count processes and MB: 2.0 is 2, 2.5 is one line naming the key
    (accepted, it made every python call of the run fail); timeout_s may be a fraction."""
    from harness import settings
    limits = settings.python_limits({"max_processes": 2.0, "total_memory_mb": 512, "timeout_s": 2.5})
    assert limits == {"timeout_s": 2.5, "max_processes": 2, "total_memory_mb": 512, "disk_mb": 64}
    assert isinstance(limits["max_processes"], int)
    for key in ("max_processes", "total_memory_mb", "disk_mb"):
        with pytest.raises(cli.UserError, match=f"^--python_limits: {key} must be a whole number \\(at least 1\\), "
                                                "got 2.5$"):
            config.parse_config(["--python_limits", f"{{{key}: 2.5}}"])


def test_resume_refuses_a_folder_whose_settings_are_not_its_checkpoints(setup, capsys):  # noqa: F811
    """The run folder's config.yaml replaced by another run's (here: another seed and beta): --resume says, in one line
    and before writing anything, which settings differ from those its checkpoint was saved with; flags that restate
    the folder's values change nothing; --allow_config_change resumes with the folder's settings."""
    run = Path(train.main(flags(setup, "other_config", steps=1), score=fake_score)["run_dir"])
    capsys.readouterr()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**saved, "seed": 7, "beta": 0.9}, sort_keys=False))
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    for extra in ({}, {"seed": 7, "beta": 0.9}):
        code, err = command(capsys, train.main, flags(setup, "other_config", steps=2, resume="true", **extra))
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and lines == [
            f"error: --resume: {run}/config.yaml does not hold the settings step_000001 was saved with (the "
            "checkpoint's -> the folder's): beta: 0.5 -> 0.9; seed: 0 -> 7; the folder's settings may come from "
            f"another run: restore them from {run}/checkpoints/step_000001/config.yaml, or add --allow_config_change "
            "to resume with the folder's"], err
        assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files
    train.main(flags(setup, "other_config", steps=2, resume="true", allow_config_change="true"), score=fake_score)
    history = [d for d in yaml.safe_load_all((run / "config_history.yaml").read_text()) if d]
    assert [(d["seed"], d["beta"]) for d in history] == [(7, 0.9)]


def test_console_lines_carry_no_bidirectional_controls(capsys):
    """A tool's error text in the step's warning line (runlog.last_error) and a message in the one error line
    (cli.run_cli) lose U+202A-U+202E and U+2066-U+2069, which would make the terminal show what follows in another
    order; the rest of the text stays."""
    from types import SimpleNamespace
    from harness.run import runlog
    odd = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
    trajectory = SimpleNamespace(tool_calls=[("python", "x")], observations=[f"Error: exe.{odd}txt\u2028done\x1b[2J"])
    assert runlog.last_error([trajectory], "python") == "Error: exe.txt done[2J"

    def main(argv):
        raise cli.UserError(f"--run_name {odd}gpj.exe: bad")
    assert cli.run_cli(main, []) == 2
    assert capsys.readouterr().err == "error: --run_name gpj.exe: bad\n"


def test_eval_takes_the_runs_settings(setup, monkeypatch, capsys, tmp_path):
    """eval.py --run: the run's data, search, token budget, tool limit and sampling; flags override; --model alone
    on a checkpoint of a run says which settings differ from training's."""
    run = Path(train.main(flags(setup, "evalrun", steps=1, eval_data=str(setup / "qa.jsonl"), eval_limit=2,
                                eval_n=3, max_tool_calls=2, eval_before="false"), score=fake_score)["run_dir"])
    capsys.readouterr()
    evaluation.main(["--run", str(run), "--device", "cpu", "--n", "2", "--out_dir", str(tmp_path / "a")])
    used = json.loads((tmp_path / "a" / "config.json").read_text())
    assert used["model"] == str(run / "checkpoints" / "step_000001")
    assert (used["data"], used["limit"], used["n"], used["temperature"]) == (str(setup / "qa.jsonl"), 2, 2, 0.6)
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


@pytest.mark.parametrize("script, cls", [("train.py", config.Config), ("eval.py", evaluation.EvalConfig)],
                         ids=["train", "eval"])
def test_help_shows_every_setting_with_its_meaning(script, cls):
    """`python train.py --help` and `python eval.py --help`: every field of the config dataclass is a flag, with its
    meaning and valid values, under its group's title; the groups in help_groups' order (the paper's first for
    train.py), the rarely changed settings (expert_keys) in the last group, titled so."""
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr[-500:]
    text = proc.stdout.split("\noptions:", 1)[1]                             # past the usage block
    groups = config.help_groups(cls)
    assert sorted(f.name for _, fields in groups for f in fields) == sorted(f.name for f in dataclasses.fields(cls))
    assert groups[-1] == (config.RARELY_CHANGED, [f for f in dataclasses.fields(cls) if f.metadata.get("expert")])
    if cls is config.Config:
        assert groups[0][0].startswith("the paper's") and groups[0][1][0].name == "k"
    starts = [text.index(f"\n{title}:\n") for title, _ in groups]
    assert starts == sorted(starts)
    for (title, fields), start, end in zip(groups, starts, [*starts[1:], len(text)]):
        chunk = text[start:end]
        assert re.findall(r"^  --(\w+)", chunk, re.M) == [f.name for f in fields], title
        for f in fields:
            meaning = f.metadata["help"] + (f" (valid: {f.metadata['valid']})" if f.metadata.get("valid") else "")
            assert "".join(meaning.split()) in "".join(chunk.split()), f.name     # wrapped anywhere, even at a hyphen


def test_set_is_an_alias_of_the_flags():
    """`--set name=value` gives exactly what `--name value` gives, for rarely changed settings of each type (a bool,
    an int, a float, a string, a list) and for any other setting; the later item wins whichever syntax it uses."""
    given = {"packed": "false", "gen_batch_size": "8", "vllm_gpu_memory_utilization": "0.7",
             "python_isolation": "strict", "mismatch_band": "[0.4, 3]", "lr": "1e-6", "reinforce_pp": "true"}
    by_flags = config.parse_config([item for key, value in given.items() for item in (f"--{key}", value)])
    by_set = config.parse_config(["--set", *(f"{key}={value}" for key, value in given.items())])
    assert by_flags == by_set
    assert (by_set.packed, by_set.gen_batch_size, by_set.vllm_gpu_memory_utilization, by_set.python_isolation,
            by_set.mismatch_band, by_set.lr, by_set.reinforce_pp) == (False, 8, 0.7, "strict", [0.4, 3.0], 1e-6, True)
    for key, value in given.items():
        assert config.parse_config([f"--{key}={value}"]) == config.parse_config([f"--set={key}={value}"]), key
    assert config.parse_config(["--set", "packed=false", "--packed", "true"]).packed is True
    assert config.parse_config(["--packed", "true", "--set", "packed=false"]).packed is False

    def evaluated(argv):
        parser = config.build_parser(evaluation.EvalConfig, prog="eval.py")
        return config.parse_args(parser, argv, "eval.py", evaluation.EvalConfig)
    assert evaluated(["--top_k", "40", "--dtype", "float32", "--judge_cache", "v.json"]) == \
        evaluated(["--set", "top_k=40", "dtype=float32", "judge_cache=v.json"])


@pytest.mark.parametrize("script, argv, expected", [
    ("train.py", ["--packd", "false"], r"^error: unrecognized arguments: --packd false \(python train.py --help lists "
                                       r"every flag\)$"),
    ("train.py", ["--set", "packd=false"], r"^error: --set packd=false: no such setting 'packd' \(did you mean "
                                           r"packed.*\)$"),
    ("eval.py", ["--model", "embedded", "--topk", "40"], r"^error: unrecognized arguments: --topk 40"),
    ("eval.py", ["--model", "embedded", "--set", "topk=40"], r"^error: --set topk=40: no such setting 'topk' "
                                                             r"\(did you mean top_k.*python eval.py --help")])
def test_an_unknown_flag_or_key_is_one_line(script, argv, expected, capsys):
    main = train.main if script == "train.py" else evaluation.main
    code, err = command(capsys, main, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and re.search(expected, lines[0]), err


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


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "out_dir is a file", "out_dir unwritable", "abbreviated",
                                  "correction without log-probs"])
def test_more_mistakes_are_caught_before_any_work(kind, setup, tmp_path, capsys, monkeypatch):  # noqa: F811
    import importlib.util
    (tmp_path / "a_file").write_text("x")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",          # the optional packages are absent here, or made so
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real_find_spec(name, *a))
    over, expected = {
        "tensorboard": ({"report_to": "[tensorboard]"}, "--report_to tensorboard needs the tensorboard package: pip "
                                                        "install tensorboard"),
        "wandb": ({"report_to": "[wandb]"}, "--report_to wandb needs the wandb package: pip install wandb"),
        "out_dir is a file": ({"out_dir": tmp_path / "a_file" / "runs"}, "a_file is a file, not a directory"),
        "out_dir unwritable": ({"out_dir": "/proc/aepo/runs"}, "--out_dir /proc/aepo/runs: cannot write in /proc"),
        "abbreviated": ({}, "unrecognized arguments: --step"),
        "correction without log-probs": ({"backend": "vllm", "temperature": 0.7, "tis_cap": 2.0},
                                         "needs the generator's log-probs, which vLLM gives at --temperature 1 only"),
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


# ---------------------------------------------------------------------------------------------------------------------
# Every setting's valid values, from the field definitions: below, at and above each bound


def boundary_cases():
    """(command, flag, value, accepted) for every field with a valid interval (Config for train.py, EvalConfig for
    eval.py): each finite bound itself (accepted iff closed), a step outside (refused) and a step inside (accepted);
    an infinite bound refuses inf and nan. Choices: each accepted, a made-up one refused."""
    import dataclasses
    cases = []
    for command, cls in (("train", config.Config), ("eval", evaluation.EvalConfig)):
        for f in dataclasses.fields(cls):
            valid = f.metadata.get("valid", "")
            interval = parser._INTERVAL.fullmatch(valid)
            if not valid:
                continue
            if interval is None:
                cases += [(command, f.name, choice.strip(), True) for choice in valid.split("|")]
                cases.append((command, f.name, "no-such-choice", False))
                continue
            opening, low, high, closing = interval.groups()
            step = 1 if f.type in ("int", int) else 0.5
            for bound, closed, outward in ((low, opening == "[", -step), (high, closing == "]", step)):
                if bound in ("inf", "-inf"):                            # an int flag cannot be inf: the parser says
                    cases += [(command, f.name, bound, False)] if step != 1 else []
                    continue
                value = int(bound) if step == 1 else float(bound)
                cases += [(command, f.name, value, closed), (command, f.name, value + outward, False),
                          (command, f.name, value - outward, True)]
            if step != 1:
                cases.append((command, f.name, "nan", False))
    return cases


@pytest.mark.parametrize("command, flag, value, accepted", boundary_cases(),
                         ids=lambda x: str(x))
def test_every_setting_is_checked_at_its_bounds(command, flag, value, accepted, tmp_path):
    """The range check runs at parse time, before anything is loaded: a value outside is one UserError naming the
    flag, the value and its valid values (a rarely changed setting is given through the alias --set here).
    (Cross-setting rules, e.g. overlong_cache below --max_response_tokens, are other checks; the boundary values here
    avoid them.)"""
    cls = config.Config if command == "train" else evaluation.EvalConfig
    expert = flag in config.expert_keys(cls)
    argv = [f"--set={flag}={value}" if expert else f"--{flag}={value}"]
    refused = rf'--{flag} .* is out of range: it must be|Parser key "{flag}"'
    if flag == "questions_per_step":                                  # the two must divide each other
        argv.append("--mini_batch_size=1")
    if flag == "mini_batch_size" and isinstance(value, int) and value > 0:
        argv.append(f"--questions_per_step={value}")
    if command == "train":
        if flag == "steps" and str(value) == "0":
            argv += ["--epochs", "1"]
        if flag == "epochs" and str(value) == "0":
            argv += ["--steps", "1"]
        if not accepted:
            with pytest.raises(cli.UserError, match=refused):
                config.parse_config(argv)
        else:
            config.parse_config(argv)
        return
    parser = config.build_parser(evaluation.EvalConfig, prog="eval.py")

    def parse_and_check():
        parsed = config.parse_args(parser, argv, "eval.py", evaluation.EvalConfig)
        config.check_valid(evaluation.EvalConfig(**{k: v for k, v in parsed.items() if k != "config"}))
    if not accepted:
        with pytest.raises(cli.UserError, match=refused):
            parse_and_check()
    else:
        parse_and_check()


def test_out_of_range_settings_end_in_one_line_before_any_work(tmp_path):
    """The commands of issue 30's list, run as a user would: one `error:` line naming the flag, exit code 2, and
    nothing created (no run folder, no eval output folder)."""
    cases = [("train.py", ["--lr", "-1"]), ("train.py", ["--steps", "-1"]), ("train.py", ["--temperature", "0"]),
             ("train.py", ["--top_p", "2"]), ("train.py", ["--k", "99999999999999999999"]),
             ("train.py", ["--seed", str(2 ** 70)]), ("train.py", ["--search_kw", "{bogus: 1}"]),
             ("eval.py", ["--model", "embedded", "--n", "0"]), ("eval.py", ["--model", "embedded", "--limit", "-1"]),
             ("eval.py", ["--model", "embedded", "--set", "dtype=float8"]), ("train.py", ["--packed", "maybe"])]
    for script, argv in cases:
        out = tmp_path / script.split(".")[0]
        proc = subprocess.run([sys.executable, script, *argv, "--out_dir", str(out)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and lines and lines[-1].startswith("error: "), (argv, proc.stderr[-500:])
        assert "Traceback" not in proc.stderr and not out.exists(), argv
        print(f"{script} {' '.join(argv)}: {lines[-1]}")


# ---------------------------------------------------------------------------------------------------------------------
# Damaged or foreign model directories: one line naming the file, in train.py and eval.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    from tests.conftest import make_tiny_model
    path = tmp_path_factory.mktemp("model") / "m"
    make_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def damaged(model_dir, tmp_path, how):
    import shutil
    path = tmp_path / how
    shutil.copytree(model_dir, path)
    weights = path / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    elif how == "empty":
        weights.write_bytes(b"")
    elif how == "garbage_header":
        weights.write_bytes((64).to_bytes(8, "little") + b"{not json" + b" " * 80)
    elif how == "unknown_model_type":
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama_from_the_future"}))
    elif how == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"):
            (path / name).unlink(missing_ok=True)
    elif how == "no_weights":
        weights.unlink()
    return path


@pytest.mark.parametrize("how, says", [("truncated", "model.safetensors is truncated"),
                                       ("empty", "model.safetensors is truncated"),
                                       ("garbage_header", "model.safetensors has an unreadable header"),
                                       ("unknown_model_type", "model_type 'llama_from_the_future'"),
                                       ("no_tokenizer", "no tokenizer files"), ("no_weights", "no weights")])
def test_damaged_model_directories_are_refused_in_one_line(how, says, model_dir, setup, tmp_path):
    path = damaged(model_dir, tmp_path, how)
    with pytest.raises(cli.UserError, match=f"--model {path}: .*{says}"):
        train.main(flags(setup, f"damaged_{how}", model=str(path)))
    assert not (setup / "runs" / f"damaged_{how}").exists()
    with pytest.raises(cli.UserError, match=f"--model {path}: .*{says}"):
        evaluation.main(["--model", str(path), "--data", str(setup / "qa.jsonl"), "--out_dir", str(tmp_path / "ev"),
                         "--device", "cpu"])
    assert not (tmp_path / "ev").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Paths: the run folder stays under --out_dir; a byte-order mark is not data; an empty config is an empty overlay


@pytest.mark.parametrize("name", ["../../escaped_run", "a/b", "..", ".", "/tmp/abs"])
def test_run_name_is_a_plain_name(name):
    with pytest.raises(cli.UserError, match="--run_name .*a plain folder name"):
        config.parse_config(["--run_name", name])
    assert config.parse_config(["--run_name", "fine-name_1"]).run_name == "fine-name_1"


def test_bom_prefixed_jsonl_is_read(tmp_path):
    from harness import dataset
    path = tmp_path / "excel.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"question": "Q?", "answer": ["A"]}).encode() + b"\n")
    rows = dataset.load_dataset(path)
    assert [(r["question"], r["golds"]) for r in rows] == [("Q?", ["A"])]


def test_an_empty_config_file_is_an_empty_overlay(tmp_path):
    empty, comments = tmp_path / "empty.yaml", tmp_path / "comments.yaml"
    empty.write_text("")
    comments.write_text("# nothing set here yet\n\n")
    assert config.parse_config([f"--config={empty}"]) == config.Config()
    assert config.parse_config(["--config", str(comments), "--k", "8"]).k == 8
