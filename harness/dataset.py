"""Questions and gold answers from every format the project meets, and the training / held-out question lists.

The data sets of paper §4: the benchmark
JSONL files of the authors' release (`question` | `Question` | `problem`, `answer` a string, a number or a list of
aliases; gsm8k solutions cut at '####'), their verl parquet training sets (extra_info.question,
reward_model.ground_truth) and the project's own QA set (data/qa_*.jsonl). Every row becomes {"question", "golds",
"meta"}; meta["kind"] is "math" or "qa" (which correctness check evaluation uses).

Deviations from the paper / official code (algorithm.md §8): D43 (a malformed row stops the run with its file and
line; skip_bad=True skips it with a warning and keeps the message).
"""
from __future__ import annotations

import ast
import json
import math
import random
import sys
from pathlib import Path

import tools
from harness import jsonl
from harness.cli import UserError


MATH_SOURCES = {"aime24", "aime25", "math500", "gsm8k", "math", "amc23"}


class Dataset(list):
    """A list of rows {"question", "golds", "meta"}; `skipped` holds one message per malformed row."""
    skipped: list[str]


def _literal(value):
    """verl stores some fields as JSON or Python-literal strings."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return ast.literal_eval(value)


def _golds(answer) -> list[str]:
    if isinstance(answer, dict):
        if "target" not in answer and "ground_truth" not in answer:
            raise ValueError(f"answer is an object without 'target' or 'ground_truth': {answer!r:.80}")
        answer = answer.get("target", answer.get("ground_truth"))
    if isinstance(answer, str) and answer.strip().startswith("["):
        try:  # a list of aliases written as a string; a math interval like "[0, 1]" stays a string
            parsed = ast.literal_eval(answer.strip())
            answer = parsed if isinstance(parsed, list) and all(isinstance(x, str) for x in parsed) else answer
        except (ValueError, SyntaxError):
            pass
    if isinstance(answer, bool) or answer is None:
        raise ValueError(f"answer has type {type(answer).__name__}")
    if isinstance(answer, (int, float)):
        answer = [answer]
    if isinstance(answer, str):
        answer = [answer.split("\n####")[-1] if "\n####" in answer else answer]  # gsm8k solutions
    if not isinstance(answer, (list, tuple)) or not all(isinstance(a, (str, int, float)) for a in answer):
        raise ValueError(f"answer must be a string or a list of strings, got {answer!r:.80}")
    for a in answer:
        if isinstance(a, float) and not math.isfinite(a):
            raise ValueError(f"the answer {a!r} is a non-finite number (JSON's NaN or Infinity), not a gold answer")
    golds = [str(a).strip() for a in answer if str(a).strip()]
    if not golds:
        raise ValueError("answer is empty")
    return golds


def _jsonl_row(raw: str, source: str) -> dict:
    rec = json.loads(raw)
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    key = next((k for k in ("question", "Question", "problem") if k in rec), None)
    if key is None or not isinstance(rec[key], str) or not rec[key].strip():
        raise ValueError("no non-empty 'question', 'Question' or 'problem' field")
    if "answer" not in rec:
        raise ValueError("no 'answer' field")
    meta = {k: v for k, v in rec.items() if k not in (key, "answer", "question", "problem")}
    if isinstance(rec["answer"], str) and "\n####" in rec["answer"]:
        meta["solution"] = rec["answer"]
    meta.update(source=source, kind="math" if source in MATH_SOURCES else "qa")
    return {"question": rec[key].strip(), "golds": _golds(rec["answer"]), "meta": meta}


def _parquet_row(rec: dict, source: str) -> dict:
    extra = _literal(rec.get("extra_info")) or {}
    reward_model = _literal(rec.get("reward_model")) or {}
    question = extra.get("question") if isinstance(extra, dict) else None
    if not question:  # fall back to the last user message of the chat prompt
        users = [m.get("content") for m in _literal(rec.get("prompt")) or [] if m.get("role") == "user"]
        question = users[-1] if users else None
    if not isinstance(question, str) or not question.strip():
        raise ValueError("no question in extra_info['question'] or the prompt's user message")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError("no reward_model['ground_truth']")
    ability = rec.get("ability")
    meta = {"source": source, "data_source": rec.get("data_source"), "ability": ability,
            "index": extra.get("index") if isinstance(extra, dict) else None,
            "kind": "math" if ability == "math" or source in MATH_SOURCES else "qa"}
    return {"question": question.strip(), "golds": _golds(reward_model["ground_truth"]), "meta": meta}


def _text(path: Path) -> str:
    """The UTF-8 text of `path` (a byte-order mark, as Excel writes, is not data); a UserError naming the line of the
    first byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line} is not UTF-8 text (byte {data[err.start]:#04x}); save the file as "
                        "UTF-8") from None


def load_dataset(path, skip_bad: bool = False) -> Dataset:
    """Rows {"question": str, "golds": list[str], "meta": dict} from a benchmark / QA-set JSONL file
    (`question` | `Question` | `problem`; `answer` a string, number or list of aliases; gsm8k
    solutions are cut at '####') or a verl parquet file (extra_info.question,
    reward_model.ground_truth: string, list or {'target': …}). meta["kind"] is "math" or "qa".
    A malformed row raises a UserError (a ValueError) naming file and line (row); skip_bad=True skips it, warns, and
    records the message in the returned list's `.skipped`."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: a directory, not a data file (.jsonl or .parquet)")
    if not path.is_file():
        raise UserError(f"dataset file not found: {path}")
    rows, skipped = Dataset(), []
    if path.suffix not in (".parquet", ".jsonl", ".json"):
        raise UserError(f"{path}: unknown dataset format (expected .jsonl or .parquet)")
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq
            records = [(f"row {i}", lambda r=r: _parquet_row(r, path.stem)) for i, r in
                       enumerate(pq.read_table(path).to_pylist())]
        else:
            records = [(f"line {i + 1}", lambda raw=raw: _jsonl_row(raw, path.stem))
                       for i, raw in enumerate(jsonl.lines(_text(path))) if raw.strip()]
    except UserError:
        raise
    except (OSError, ValueError) as err:                         # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"{path}: cannot be read as {path.suffix[1:]}: {' '.join(str(err).split())[:200]}") from None
    first = {}                                   # a row's own "id" field -> where it was first given
    for where, parse in records:
        try:
            row = parse()
            if row["meta"].get("id") is not None:        # results are kept per question: an id names one
                given = json.dumps(row["meta"]["id"], sort_keys=True)
                if given in first:
                    raise ValueError(f"id {given} is given twice (first on {first[given]}); give each question its "
                                     "own id")
                first[given] = where
            rows.append({**row, "id": f"{path.stem}:{where.split()[-1]}"})    # e.g. qa_train:17 (line 17)
        except (ValueError, SyntaxError, TypeError, AttributeError, KeyError, RecursionError) as err:
            reason = "nested too deeply to read (Python's recursion limit)" if isinstance(err, RecursionError) else err
            message = f"{path}: {where}: malformed row: {reason}"
            if not skip_bad:
                raise UserError(message + " (add --skip_bad to skip such rows with a warning)") from None
            skipped.append(message)
            print(f"warning: skipping {message}", file=sys.stderr)
    if skipped:
        print(f"warning: {path}: skipped {len(skipped)} malformed row(s), kept {len(rows)}", file=sys.stderr)
    rows.skipped = skipped
    return rows


def load_files(paths: str | list[str], skip_bad: bool = False) -> list[tuple[str, Dataset]]:
    """eval.py's --data: (path, rows) of each file (load_dataset), every file read and checked, none empty."""
    datasets = [(path, load_dataset(path, skip_bad)) for path in ([paths] if isinstance(paths, str) else paths)]
    for path, rows in datasets:
        if not rows:
            raise UserError(f"--data {path}: no questions in it")
    return datasets


def check_prompts(datasets: list[tuple[str, Dataset]], limit: int, tokenizer, build_prompt, model_dir: str) -> None:
    """eval.py: the prompt (build_prompt: the tool-call format's) of each question evaluated (the first `limit` of
    each file; 0: all) leaves room for a response in the model's context (max_position_embeddings in model_dir's
    config.json; not checked where there is none), else a UserError naming the file and line: a longer prompt would
    be sampled for hours (a 10 MB question is some 2,000,000 tokens)."""
    try:
        context = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))["max_position_embeddings"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    for path, rows in datasets:
        for row in rows[:limit or None]:
            tokens = len(build_prompt(tokenizer, row["question"]))
            if tokens >= context:
                where = ("row " if str(path).endswith(".parquet") else "line ") + row["id"].rsplit(":", 1)[1]
                raise UserError(f"--data {path}: {where}: the question's prompt is {tokens:,} tokens, no shorter than "
                                f"the model's context ({context:,}, max_position_embeddings): shorten the question "
                                "or leave it out")


def load_questions(path: str, tokenizer, max_prompt_tokens: int, what: str, skip_bad: bool = False,
                   build_prompt=tools.build_prompt) -> list[dict]:
    """The rows of `path` (load_dataset) whose prompt (build_prompt: the run's tool-call format's) fits
    max_prompt_tokens; the others are dropped with a warning. `what` names the file's role in messages (e.g.
    "train_data")."""
    rows = load_dataset(path, skip_bad=skip_bad)
    if not rows:
        raise UserError(f"--{what} {path}: no questions in it")
    kept = [r for r in rows if len(build_prompt(tokenizer, r["question"])) <= max_prompt_tokens]
    if not kept:
        raise UserError(f"--{what} {path}: every question's prompt is longer than --max_prompt_tokens "
                        f"({max_prompt_tokens})")
    if len(kept) < len(rows):
        print(f"warning: {what} {path}: dropped {len(rows) - len(kept)} question(s) whose prompt is longer than "
              f"max_prompt_tokens={max_prompt_tokens}", file=sys.stderr)
    return kept


def step_questions(rows: list[dict], step: int, questions_per_step: int, seed: int) -> list[dict]:
    """The step's global batch: positions step·Q .. step·Q+Q−1 of a sequence of seeded per-epoch permutations (every
    question once per epoch, a new order each epoch; a resumed run continues the same sequence)."""
    out = []
    for pos in range(step * questions_per_step, (step + 1) * questions_per_step):
        epoch, i = divmod(pos, len(rows))
        perm = list(range(len(rows)))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        out.append(rows[perm[i]])
    return out


def spare_questions(rows: list[dict], step: int, n: int, seed: int) -> list[dict]:
    """n more questions for DAPO's dynamic sampling at `step`, drawn with a seeded RNG of their own (so the main
    sequence of step_questions, and a resume, are unchanged)."""
    return random.Random(seed * 1_000_033 + step).sample(rows, n)
