"""More mistakes a user makes end in one line: `error: ...` on stderr naming the flag or file and what is wrong, exit
code 2, no traceback and no run folder (or evaluation folder), before any work: a tokenizer prompts cannot be built
with, a --config file that is not UTF-8, gives a key twice or one that is no setting, is a list or an alias bomb (in
a file, a --config text or a flag's value), a data row nested too deeply, with a non-finite gold or an id given
twice, a question longer than the model's context, a run name too long for a folder, a cache or --out_dir that cannot
be written, --device cuda without CUDA, eval.py --run on a damaged run folder or on a checkpoint of another model, a
web search without its API key, and --resume on a checkpoint that lacks its trainer state. A --resume on logs cut
short is one warning line, and the run goes on. U+2028, U+2029 and U+0085 inside a data row or a demonstration are
text, not line ends."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest

import eval as evaluation
import train
from harness import cli, config, models
from tests.conftest import flags, make_tiny_model
from tests.fakes import fake_score


def one_line(capsys, main, argv) -> str:
    """cli.run_cli(main, argv), as the command line runs it: its one stderr line, checked to be `error: ...` with
    exit code 2 and no traceback."""
    code = cli.run_cli(main, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err[-2000:])
    assert "Traceback" not in err
    return lines[0]


def train_mistake(capsys, setup, name: str, **over) -> str:
    """train.py with the `setup` flags and `over`: its one error line, checked to leave no run folder."""
    line = one_line(capsys, train.main, flags(setup, name, **over))
    assert not (setup / "runs").exists() or name not in os.listdir(setup / "runs"), name
    return line


# ---------------------------------------------------------------------------------------------------------------------
# 1. A tokenizer prompts cannot be built with, or whose responses cannot end


def tokenizer_without(setup, tmp_path, what: str) -> Path:
    """A copy of the setup's model directory whose tokenizer lacks `what`: chat template | eos and pad | pad."""
    path = tmp_path / what.replace(" ", "_")
    shutil.copytree(setup / "tiny", path)
    if what == "chat template":
        (path / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    drop = {"chat template": ("chat_template",), "eos and pad": ("eos_token", "pad_token"), "pad": ("pad_token",)}[what]
    (path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tokenizer_config.items()
                                                            if k not in drop}))
    return path


@pytest.mark.parametrize("what, says", [("chat template", "its tokenizer has no chat template"),
                                        ("eos and pad", r"its tokenizer has no eos token \(nor a pad token\)")])
def test_a_tokenizer_without_template_or_eos_is_one_line(what, says, setup, tmp_path, capsys):
    path = tokenizer_without(setup, tmp_path, what)
    line = train_mistake(capsys, setup, f"tokenizer_{what[:3]}", model=path)
    assert re.search(f"--model {path}: {says}", line), line
    line = one_line(capsys, evaluation.main, ["--model", str(path), "--data", str(setup / "qa.jsonl"), "--device",
                                              "cpu", "--out_dir", str(tmp_path / "ev")])
    assert re.search(says, line) and not (tmp_path / "ev").exists(), line


def test_a_tokenizer_without_a_pad_token_is_no_mistake(setup, tmp_path):
    """Its eos token pads (as most chat models' tokenizers are used)."""
    from transformers import AutoTokenizer
    path = tokenizer_without(setup, tmp_path, "pad")
    assert AutoTokenizer.from_pretrained(path).pad_token is None
    tokenizer = models.load_tokenizer(str(path))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"


# ---------------------------------------------------------------------------------------------------------------------
# 2. A --config file that is not UTF-8, gives a key twice, or is not a mapping


CONFIG_FILES = {
    "not UTF-8": ("lr: 0.001\nk: 2 # caf\xe9\n".encode("latin-1"), r"line 2 is not UTF-8 text \(byte 0xe9\)"),
    "a key twice": (b"lr: 0.001\nk: 2\nlr: 0.01\n", "line 3: key 'lr' is given twice \\(first on line 1\\)"),
    "a nested key twice": (b"search_kw:\n  topk: 1\n  topk: 3\n", "line 3: key 'topk' is given twice"),
    "a list": (b"- lr: 0.001\n- k: 2\n", "its top level is a list, not a mapping of settings"),
    "an unknown key": (b"seed: 1\nbogus: 3\n", "line 2: Option 'bogus' is not accepted"),
    "not YAML": (b"lr: [0.001\n", "not valid YAML: line 2, column 1"),
    "an alias bomb": (b"search_kw:\n  a: &a [x, x, x, x, x, x, x, x, x, x]\n" +
                      b"".join(f"  {b}: &{b} [{', '.join(['*' + a] * 10)}]\n".encode() for a, b in zip("abc", "bcd")),
                      r"line 5: its aliases \(\*name\) expand this value to 11,111 values, more than the 10,000 any "
                      r"settings need \(an alias bomb\); write the values out$"),
    "an alias inside itself": (b"search_kw:\n  a: &a [1, *a]\n", r"line 2: an alias \(\*name\) inside the value it "
                                                                 "names repeats it without end"),
}


@pytest.mark.parametrize("kind", list(CONFIG_FILES))
def test_a_bad_config_file_is_one_line(kind, setup, tmp_path, capsys):
    text, says = CONFIG_FILES[kind]
    path = tmp_path / "settings.yaml"
    path.write_bytes(text)
    line = train_mistake(capsys, setup, f"config_{kind.replace(' ', '_')}", config=path)
    assert re.search(f"--config {path}: {says}", line), line
    line = one_line(capsys, evaluation.main, ["--config", str(path), "--model", str(setup / "tiny")])
    assert re.search(says, line), line


def test_config_files_that_are_fine():
    """Merge keys are no duplicates; a --config that is YAML text rather than a file is still the parser's."""
    assert config.parse_config(["--config", "{k: 3, lr: 0.01}"]).k == 3


def test_aliases_are_bounded_in_every_yaml_value():
    """An alias that repeats a value a few times is YAML as usual; one that would expand a value past 10,000 values
    (jsonargparse copies each value, so a bomb of a few hundred bytes grew without bound) is one line naming the flag,
    whether the YAML is a --config text, a flag's value or a --set value."""
    fine = "report_to: &none []\nmismatch_masks: *none\nsearch_kw: {a: &x [1, 2], b: *x}"
    cfg = config.parse_config(["--config", fine])
    assert (cfg.report_to, cfg.mismatch_masks, cfg.search_kw) == ([], [], {"a": [1, 2], "b": [1, 2]})
    levels = ["&a [" + ", ".join(["x"] * 10) + "]"]
    levels += [f"&{b} [{', '.join(['*' + a] * 10)}]" for a, b in zip("abc", "bcd")]      # each 10 of the one before
    mapping = "{" + ", ".join(f"{name}: {level}" for name, level in zip("abcd", levels)) + "}"
    for argv, flag in [(["--config", mapping], "--config"), (["--python_limits", mapping], "--python_limits"),
                       ([f"--search_kw={mapping}"], "--search_kw"),
                       (["--set", f"mismatch_band=[{', '.join(levels)}]"], "--mismatch_band")]:
        with pytest.raises(cli.UserError, match=f"^{flag}: line 1: its aliases \\(\\*name\\) expand this value to "
                                                "11,111 values, more than the 10,000 any settings need"):
            config.parse_config(argv)


# ---------------------------------------------------------------------------------------------------------------------
# 3. Data rows: each mistake one line naming the file and the line


def data_file(tmp_path, kind: str) -> tuple[Path, str]:
    """A data file with the mistake `kind` and what the line must say."""
    path = tmp_path / "data.jsonl"
    good = json.dumps({"question": "Q?", "answer": "A"}) + "\n"
    rows = {
        "nested 100,000 deep": '{"question": "Q?", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "answer NaN": '{"question": "Q?", "answer": NaN}',
        "an answer Infinity": '{"question": "Q?", "answer": ["A", Infinity]}',
        "no answer": '{"question": "Q?"}',
        "question not text": '{"question": 7, "answer": "A"}',
        "answer an object": '{"question": "Q?", "answer": {"text": "A"}}',
        "10 MB not JSON": '{"question": "' + "word " * 2_000_000 + '", "answer": ',
        "an id twice": '{"id": 7, "question": "Q2?", "answer": "B"}\n{"id": 7, "question": "Q3?", "answer": "C"}',
    }
    says = {
        "nested 100,000 deep": "line 2: malformed row: nested too deeply to read",
        "answer NaN": "line 2: malformed row: the answer nan is a non-finite number",
        "an answer Infinity": "line 2: malformed row: the answer inf is a non-finite number",
        "no answer": "line 2: malformed row: no 'answer' field",
        "question not text": "line 2: malformed row: no non-empty 'question'",
        "answer an object": "line 2: malformed row: answer is an object without 'target' or 'ground_truth'",
        "10 MB not JSON": "line 2: malformed row: Expecting value",
        "10 MB question": r"every question's prompt is longer than --max_prompt_tokens \(2000\)",
        "an id twice": r"line 3: malformed row: id 7 is given twice \(first on line 2\); give each question its own id",
        "not UTF-8": r"line 2 is not UTF-8 text \(byte 0xe9\)",
        "empty": "no questions in it",
        "a directory": "file not found|a directory, not a data file",
    }[kind]
    if kind in rows:
        path.write_text(good + rows[kind] + "\n")
    elif kind == "10 MB question":
        path.write_text(json.dumps({"question": "word " * 2_000_000, "answer": "A"}) + "\n")
    elif kind == "not UTF-8":
        path.write_bytes(good.encode() + '{"question": "Caf\xe9?", "answer": "A"}\n'.encode("latin-1"))
    elif kind == "empty":
        path.write_text("")
    else:
        path.mkdir()
    return path, says


DATA_MISTAKES = ["nested 100,000 deep", "answer NaN", "an answer Infinity", "no answer", "question not text",
                 "answer an object", "10 MB not JSON", "10 MB question", "not UTF-8", "empty", "a directory",
                 "an id twice"]
# eval.py has no --max_prompt_tokens: a prompt must leave room for a response in the model's context
EVAL_SAYS = {"10 MB question": r"line 1: the question's prompt is 2,000,\d{3} tokens, no shorter than the model's "
                               r"context \(4,096, max_position_embeddings\)"}


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("kind", DATA_MISTAKES)
def test_a_bad_data_file_is_one_line(kind, command, setup, tmp_path, capsys):
    path, says = data_file(tmp_path, kind)
    if command == "train":
        line = train_mistake(capsys, setup, f"data_{DATA_MISTAKES.index(kind)}", train_data=path)
    else:
        says = EVAL_SAYS.get(kind, says)
        quick = ["--search", "replay", "--search_kw", json.dumps({"path": str(setup / "search.json")}), "--n", "1",
                 "--max_response_tokens", "4", "--device", "cpu"]       # (a file taken by mistake: evaluated quickly)
        line = one_line(capsys, evaluation.main, ["--model", str(setup / "tiny"), "--data", str(path), *quick,
                                                  "--out_dir", str(tmp_path / "ev")])
        assert not (tmp_path / "ev").exists()
    assert re.search(f"{path}.*: ({says})", line) and len(line) < 500, line[:1000]


def test_line_separators_inside_a_row_are_data(tmp_path):
    """U+2028, U+2029 and U+0085 inside a JSON string (json.dumps writes them raw with ensure_ascii=False; Python's
    str.splitlines() ends a line at each) end no row: a dataset row and a demonstration are read whole, each on its
    own line number (harness/jsonl.py)."""
    from harness import dataset
    from harness.run import coldstart
    odd = "\u2028\u2029\x85"
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": f"Q{odd}?", "answer": f"A{odd}B"}, ensure_ascii=False) + "\n" +
                    json.dumps({"question": "R?", "answer": "C"}) + "\n", encoding="utf-8")
    rows = dataset.load_dataset(data)
    assert [(r["question"], r["golds"], r["id"]) for r in rows] == [(f"Q{odd}?", [f"A{odd}B"], "qa:1"),
                                                                   ("R?", ["C"], "qa:2")]
    demos = tmp_path / "demos.jsonl"
    demo = {"messages": [{"role": "user", "content": f"Q{odd}?"}, {"role": "assistant", "content": f"A{odd}"}]}
    demos.write_text(json.dumps(demo, ensure_ascii=False) + "\n\n" + json.dumps(demo) + "\n", encoding="utf-8")
    assert coldstart.load_demonstrations(str(demos)) == [demo, demo]


# ---------------------------------------------------------------------------------------------------------------------
# 4-6. A run name no folder can have, a cache or --out_dir that cannot be written, --device cuda without CUDA


RUN_NAMES = {"300 characters": ("x" * 300, "--run_name is 300 bytes long: a folder name may have at most 255"),
             "a slash": ("a/b", "--run_name 'a/b': a plain folder name"),
             "a NUL byte": ("a\0b", "--run_name 'a\\\\x00b': a plain folder name")}


@pytest.mark.parametrize("kind", list(RUN_NAMES))
def test_a_run_name_no_folder_can_have_is_one_line(kind, setup, capsys):
    name, says = RUN_NAMES[kind]
    line = one_line(capsys, train.main, flags(setup, name))
    assert re.search(says, line), line


UNWRITABLE = ["read-only folder", "read-only /proc", "under /proc", "under /sys"]


def unwritable(tmp_path, kind: str, name: str) -> str:
    """A folder no file can be written in (one of UNWRITABLE; as root, which writes in a read-only folder, the /proc
    and /sys ones stand in for it)."""
    if kind == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root writes in a read-only folder (the /proc and /sys cases check the same as root)")
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        return str(tmp_path / "ro")
    return {"read-only /proc": "/proc", "under /proc": f"/proc/aepo/{name}", "under /sys": f"/sys/aepo/{name}"}[kind]


@pytest.mark.parametrize("kind", UNWRITABLE)
def test_a_cache_that_cannot_be_written_is_one_line(kind, setup, tmp_path, capsys):
    cache = unwritable(tmp_path, kind, "cache")
    line = train_mistake(capsys, setup, f"cache_{UNWRITABLE.index(kind)}", cache_dir=cache, cold_start="true")
    assert re.search(f"--cache_dir {cache}: cannot write in ", line), line


@pytest.mark.parametrize("kind", UNWRITABLE)
def test_an_out_dir_that_cannot_be_written_is_one_line(kind, setup, tmp_path, capsys):
    out = unwritable(tmp_path, kind, "runs")
    line = one_line(capsys, train.main, flags(setup, "out_dir", out_dir=out))
    assert re.search(f"--out_dir {out}: cannot write in ", line), line
    line = one_line(capsys, evaluation.main, ["--model", str(setup / "tiny"), "--data", str(setup / "qa.jsonl"),
                                              "--out_dir", out])
    assert re.search(f"--out_dir {out}: cannot write in ", line), line


def test_device_cuda_without_cuda_is_one_line(setup, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = train_mistake(capsys, setup, "cuda", device="cuda")
    assert "--device cuda: no CUDA device here" in line and "use --device cpu" in line


# ---------------------------------------------------------------------------------------------------------------------
# 7. eval.py --run on a damaged run folder, a folder that is no run, a checkpoint of another model


def run_folder(setup, tmp_path, config_yaml: str, history: str | None = None, checkpoint_model: Path | None = None):
    """A run folder as train.py leaves it, made by hand: config.yaml (and config_history.yaml), one checkpoint whose
    exported model is `checkpoint_model` (default the setup's own tiny model)."""
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000001"
    shutil.copytree(checkpoint_model or setup / "tiny", step)
    (step / "trainer_state.pt").write_bytes(b"")
    (run / "config.yaml").write_text(config_yaml)
    if history is not None:
        (run / "config_history.yaml").write_text(history)
    return run


def saved_settings(setup) -> str:
    return (f"model: {setup / 'tiny'}\ntrain_data: {setup / 'qa.jsonl'}\neval_data: {setup / 'qa.jsonl'}\n"
            f"search: replay\nsearch_kw: {{path: {setup / 'search.json'}}}\nmax_response_tokens: 4\n")


@pytest.fixture(scope="module")
def wider_model(setup, tokenizer):
    """Another model: the tiny model twice as wide."""
    path = setup / "wider"
    if not path.exists():
        make_tiny_model(tokenizer, hidden_size=64).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


EVAL_RUNS = {
    "config.yaml a list": (dict(config_yaml="- model: x\n- k: 2\n"),
                           "its config.yaml .the run's settings. is damaged: its top level is a list"),
    "history not YAML": (dict(history="--- # resumed\nk: [2\n"),
                         "its config_history.yaml .the run's settings. is damaged: not valid YAML: line 3"),
    "history a list": (dict(history="--- # resumed\n- k: 2\n"),
                       "its config_history.yaml .the run's settings. is damaged: its top level is a list"),
    "no run": (None, "no config.yaml there .not a training run folder."),
    "another model": (dict(checkpoint_model="wider"), "its checkpoint step_000001 is not the model the run trained "
                                                      r"\(--model .*tiny\): hidden_size 64 \(the run's 32\)"),
}


@pytest.mark.parametrize("kind", list(EVAL_RUNS))
def test_eval_run_on_a_damaged_run_is_one_line(kind, setup, wider_model, tmp_path, capsys):
    over, says = EVAL_RUNS[kind]
    if over is None:
        run = tmp_path
    else:
        over = {"config_yaml": saved_settings(setup), **over}
        if over.get("checkpoint_model") == "wider":
            over["checkpoint_model"] = wider_model
        run = run_folder(setup, tmp_path, **over)
    line = one_line(capsys, evaluation.main, ["--run", str(run), "--device", "cpu", "--out_dir", str(tmp_path / "ev")])
    assert re.search(f"--run {run}: {says}", line), line
    assert not (tmp_path / "ev").exists()


def test_eval_of_another_model_with_a_runs_settings_says_so(setup, wider_model, tmp_path, capsys):
    """--model given by hand with --run (e.g. the base model with the run's settings) is evaluated, with a warning
    line naming both models; the run's own checkpoint of the run's model gets no warning."""
    run = run_folder(setup, tmp_path, saved_settings(setup))
    argv = ["--run", str(run), "--device", "cpu", "--limit", "1", "--n", "1"]
    evaluation.main(argv + ["--out_dir", str(tmp_path / "a")])
    assert "warning" not in capsys.readouterr().err
    evaluation.main(argv + ["--model", str(wider_model), "--out_dir", str(tmp_path / "b")])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: --model {wider_model} is not the model {run} trained (--model {setup / 'tiny'}): "
                        "hidden_size 64 (the run's 32), intermediate_size 128 (the run's 64); it is evaluated with "
                        "the run's settings all the same"]
    assert json.loads((tmp_path / "b" / "config.json").read_text())["model"] == str(wider_model)


# ---------------------------------------------------------------------------------------------------------------------
# 8. A web search without its API key (the official protocol's hint: its stand-ins, not the offline bm25 it refuses)


SERP_KEYS = {
    "train.py brightdata": ("train", ["--search=brightdata"], "--search brightdata needs a Bright Data API key: set "
                                                              "BRIGHTDATA_API_KEY"),
    "train.py web": ("train", ["--search=web"], "--search web needs a Serper.dev API key: set SERPER_API_KEY"),
    "eval.py brightdata": ("eval", ["--search", "brightdata"], "--search brightdata needs a Bright Data API key"),
    "official brightdata": ("eval", ["--protocol", "official"], r"--protocol official --search brightdata needs its "
                            r"API key: set BRIGHTDATA_API_KEY \(offline: the stand-ins of tests/standins.py"),
    "official web": ("eval", ["--protocol", "official", "--search", "web"], "--protocol official --search web needs "
                                                                            "its API key: set SERPER_API_KEY"),
}


@pytest.mark.parametrize("kind", list(SERP_KEYS))
def test_a_web_search_without_its_api_key_is_one_line(kind, setup, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BRIGHTDATA_API_KEY", raising=False)
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    command, given, says = SERP_KEYS[kind]
    if command == "train":
        line = one_line(capsys, train.main, flags(setup, "serp", search_kw="{}") + given)
        assert not (setup / "runs" / "serp").exists()
    else:
        closed = "http://127.0.0.1:9/v1"                  # never asked: the key is missing before any request
        endpoints = ["--summarizer_url", closed, "--judge_url", closed] if "official" in given else []
        line = one_line(capsys, evaluation.main, ["--model", str(setup / "tiny"), "--data", str(setup / "qa.jsonl"),
                                                  "--device", "cpu", *endpoints, "--out_dir", str(tmp_path / "ev"),
                                                  *given])
        assert not (tmp_path / "ev").exists()
    assert re.search(says, line), line


# ---------------------------------------------------------------------------------------------------------------------
# 9. --resume on logs cut short (one warning line; the run goes on, nothing complete lost) or on a checkpoint without
# its trainer state (one error line, nothing written)


@pytest.fixture(scope="module")
def two_steps(setup):
    """A run of 2 steps with a checkpoint after each."""
    train.main(flags(setup, "two_steps", steps=2), score=fake_score)
    return setup / "runs" / "two_steps"


RESUMES = {
    "metrics.jsonl cut mid-line": r"warning: --resume: {run}/metrics.jsonl: dropped 1 line\(s\) cut mid-write \(not "
                                  r"JSON with a step\); no line of step\(s\) 2 \(cut short, emptied or removed\): the "
                                  "run goes on, its log without them",
    "metrics.jsonl empty": r"warning: --resume: {run}/metrics.jsonl: no line of step\(s\) 1-2 \(cut short",
    "no trainer_state.pt": r"error: --resume: {run}/checkpoints/step_000002 has no trainer_state.pt, so the "
                           "checkpoint is damaged: move it out of the way to resume from step_000001",
}


@pytest.mark.parametrize("kind", list(RESUMES))
def test_a_resume_on_cut_logs_or_a_checkpoint_without_its_state_is_one_line(kind, setup, two_steps, capsys):
    run = setup / "runs" / f"resume_{list(RESUMES).index(kind)}"
    shutil.copytree(two_steps, run)
    metrics = run / "metrics.jsonl"
    if kind == "metrics.jsonl cut mid-line":
        metrics.write_bytes(metrics.read_bytes()[:-40])
    elif kind == "metrics.jsonl empty":
        metrics.write_bytes(b"")
    else:
        (run / "checkpoints" / "step_000002" / "trainer_state.pt").unlink()
    complete = [line for line in metrics.read_text().splitlines() if line.endswith("}")]
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    argv = flags(setup, run.name, steps=3, resume="true")
    says = RESUMES[kind].format(run=run)
    if kind == "no trainer_state.pt":                  # not a silent resume from step 1 that replaces step 2
        assert re.match(says, one_line(capsys, train.main, argv))
        assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files
        return
    code = cli.run_cli(lambda argv: train.main(argv, score=fake_score), argv)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert code == 0 and "Traceback" not in err and len(warnings) == 1 and re.match(says, warnings[0]), err[-2000:]
    lines = metrics.read_text().splitlines()
    assert lines[:-1] == complete and json.loads(lines[-1])["step"] == 3
