"""The official evaluation's rules on text and its scoring: how a policy call is cut, a tool's argument read, the
python tool's last expression printed, the prediction taken from the output, and a sample scored as the authors'
evaluator scores it (EM, accuracy, F1, math_equal, llm_equal), then a run and several runs summarised.
"""
from __future__ import annotations

import ast
from collections import Counter

from harness.correctness import official_scores
from reward import pass_at_k

TAGS = ("</python>", "</search>", "</answer>")


# --------------------------------------------------------------------------------------------------
# The text


def cut_call(text: str) -> str:
    """A call's text as the official code keeps it: before any <result> the policy wrote, and up to the first closing
    tag (</search>, </python> or </answer>) inclusive."""
    text = text.split("<result>")[0]
    ends = [text.find(tag) + len(tag) for tag in TAGS if tag in text]
    return text[:min(ends)] if ends else text


def tag_content(step: str, tool: str) -> str:
    """The argument of a call: from the step's first <tool> to the next </tool>, stripped ("" without them)."""
    start = step.find(f"<{tool}>")
    end = step.find(f"</{tool}>", start + len(tool) + 2) if start >= 0 else -1
    return step[start + len(tool) + 2:end].strip() if end >= 0 else ""


def print_last_expression(code: str) -> str:
    """The code with its last statement printed when it is an expression other than a print() call (the official
    python tool's rule)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr) or (isinstance(last.value, ast.Call) and isinstance(last.value.func, ast.Name)
                                          and last.value.func.id == "print"):
        return code
    tree.body[-1] = ast.Expr(ast.Call(ast.Name("print", ast.Load()), [last.value], []))
    return ast.unparse(ast.fix_missing_locations(tree))


def last_boxed(text: str) -> str:
    """From the last \\boxed (or \\fbox) to its closing brace, or to the end when it does not close ("" if none)."""
    start = text.rfind("\\boxed")
    start = text.rfind("\\fbox") if start < 0 else start
    if start < 0:
        return ""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if text[i] == "}" and depth == 0:
            return text[start:i + 1]
    return text[start:]


def _unbox(boxed: str) -> str:
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        boxed = boxed[len("\\boxed{"):-1]
        if boxed.startswith("\\text{") and boxed.endswith("}"):
            boxed = boxed[len("\\text{"):-1]
    return boxed


def prediction(output: str) -> str:
    """The official prediction: inside the last <answer>…</answer>, its last \\boxed{} content (\\text{} unwrapped),
    else the answer's whole text; without an answer, the last \\boxed{} of the output ("" when there is none)."""
    end = output.rfind("</answer>")
    start = output[:end].rfind("<answer>") if end >= 0 else -1
    answer = output[start + len("<answer>"):end] if start >= 0 else ""
    if answer:
        return _unbox(last_boxed(answer.strip())) or answer
    return _unbox(last_boxed(output.strip()))


def count_calls(output: str, tool: str) -> int:
    """Complete <tool>…</tool> pairs in the output, scanning forward (the official tool-call count)."""
    count, at = 0, 0
    while (start := output.find(f"<{tool}>", at)) >= 0 and (end := output.find(f"</{tool}>", start)) >= 0:
        count, at = count + 1, end + len(tool) + 3
    return count


# --------------------------------------------------------------------------------------------------
# The scores


def score(sample, row: dict, judge=None) -> dict:
    """The official evaluator's record for one sample (an official_eval.Sample): the prediction ("Timeout" for a
    timed-out sample; when empty, the output's last 5 lines are judged), EM, acc, F1, math_equal, llm_equal (judge:
    correctness.OfficialJudge), tool calls; `correct` is llm_equal with a judge, else math_equal for math rows and
    EM for the others."""
    predicted = "Timeout" if sample.finish == "timeout" else prediction(sample.output)
    judged = predicted or "\n".join(sample.output.replace("\n\n", "\n").strip().split("\n")[-5:])
    task = "math" if row["meta"].get("kind") == "math" else "qa"
    metrics = official_scores(judged, row["golds"], task) if judged else \
        {"em": 0, "acc": 0, "f1": 0.0, "math_equal": 0}
    metrics.update(is_valid_answer=bool(judged), python_calls=count_calls(sample.output, "python"),
                   search_calls=count_calls(sample.output, "search"))
    if judge is not None:
        verdict, reply, failed = judge(row["question"], judged, row["golds"]) if judged else (False, "", False)
        metrics.update(llm_equal=int(verdict), llm_response=reply, judge_error=failed)
    correct = metrics["llm_equal"] if judge is not None else metrics["math_equal" if task == "math" else "em"]
    return {"index": sample.index, "question": row["question"], "golds": row["golds"], "meta": row["meta"],
            "prediction": predicted, "output": sample.output, "logs": sample.logs, "search_queries": sample.queries,
            "finish": sample.finish, "counts": dict(sample.counts), "seconds": dict(sample.seconds),
            "metrics": metrics, "correct": bool(correct)}


METRICS = ("em", "acc", "f1", "math_equal", "llm_equal", "python_calls", "search_calls")


def run_summary(records: list[dict], counts: Counter) -> dict:
    """One run's means over its questions (the official overall metrics), the questions sent to the judge and those
    whose every attempt failed, and its counts."""
    q = max(1, len(records))
    out = {key: sum(r["metrics"][key] for r in records) / q for key in METRICS if key in records[0]["metrics"]} \
        if records else {}
    out.update(correct=sum(r["correct"] for r in records) / q, valid_answers=sum(r["metrics"]["is_valid_answer"]
                                                                                  for r in records),
               judge_requests=sum("judge_error" in r["metrics"] and r["metrics"]["is_valid_answer"] for r in records),
               judge_errors=sum(bool(r["metrics"].get("judge_error")) for r in records), counts=dict(counts))
    return out


def aggregate(runs: list[list[dict]], name: str) -> dict:
    """Over the runs: Pass@1 = the mean of the runs' correctness, Pass@k (k ≤ runs) the unbiased estimator over each
    question's runs, every metric the mean of the runs' means."""
    n, per_run = len(runs), [run_summary(records, Counter()) for records in runs]
    correct = [sum(records[i]["correct"] for records in runs) for i in range(len(runs[0]))] if runs else []
    summary = {"dataset": name, "questions": len(correct), "runs": n}
    for k in range(1, n + 1):
        summary[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / max(1, len(correct))
    for key in METRICS + ("judge_errors",):
        if per_run and key in per_run[0]:
            summary[key] = sum(r[key] for r in per_run) / n
    return summary
