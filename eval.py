"""Evaluation: n rollouts per held-out question, Pass@1 and unbiased Pass@k (arXiv:2510.14545, §4; SPEC §6).

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, §4 experimental setup: each
question gets n independent trajectories from the training rollout code (no branching) at temperature 0.6 and
top-p 0.95; Pass@1 is the mean correctness and Pass@k the unbiased estimator. Correct is exact match of the boxed
answer, `reward.math_equal` for math questions, or an LLM judge; EM, F1 and the training reward (reward.py) are
reported too.

    python eval.py --model PATH --data data/qa_test.jsonl --n 5
    python eval.py --model PATH --data '[data/qa_test.jsonl, ../shared/data/benchmarks/bamboogle.jsonl]'

Deviations from the paper / official code:
1. "Correct" is explicit and recorded per dataset: exact match of the boxed answer (QA), math_equal
   (rows marked math: aime24/25, math500, gsm8k, parquet rows with ability == "math"), or an
   OpenAI-compatible LLM judge when one is configured.
2. Several processes split the questions in whole chunks, each with the seed it has in one process, so the merged
   numbers equal one process's.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Union

from dataset import load_dataset
from reward import as_list, math_equal, score_response
from tools import build_prompt

# --------------------------------------------------------------------------------------------------
# Pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Eq.: Pass@k = 1 − C(n−c, k) / C(n, k): the chance that k of the n samples (drawn without
    replacement) contain at least one of the c correct ones."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# --------------------------------------------------------------------------------------------------
# Optional LLM judge (any OpenAI-compatible chat endpoint)

JUDGE_PROMPT = ("Question: {question}\nGold answer(s): {golds}\nPredicted answer: {prediction}\n\n"
                "Does the predicted answer mean the same as a gold answer? Reply with one word: "
                "Correct or Incorrect.")


class Judge:
    """Asks an OpenAI-compatible /chat/completions endpoint whether a prediction matches the gold
    answers. Verdicts are cached by (question, prediction, golds), optionally persisted to JSON."""

    def __init__(self, url: str, model: str, api_key: str = "", cache_path=None, timeout_s: float = 60.0):
        if not url or not model:
            raise ValueError("the LLM judge needs a URL and a model (--judge_url/--judge_model or "
                             "AEPO_JUDGE_URL/AEPO_JUDGE_MODEL)")
        self.url = url if url.rstrip("/").endswith("/chat/completions") else url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s
        self.cache_path = Path(cache_path) if cache_path else None
        self.cache: dict[tuple, bool] = {}
        self.requests = 0
        if self.cache_path and self.cache_path.exists():
            for e in json.loads(self.cache_path.read_text()):
                self.cache[(e["question"], e["prediction"], tuple(e["golds"]))] = e["verdict"]

    @classmethod
    def from_env(cls, url=None, model=None, api_key=None, cache_path=None) -> "Judge":
        return cls(url or os.environ.get("AEPO_JUDGE_URL", ""), model or os.environ.get("AEPO_JUDGE_MODEL", ""),
                   api_key or os.environ.get("AEPO_JUDGE_API_KEY", ""), cache_path)

    def __call__(self, question: str, prediction: str, golds) -> bool:
        key = (question, prediction, tuple(as_list(golds)))
        if key not in self.cache:
            self.cache[key] = self._ask(*key)
            if self.cache_path:
                entries = [{"question": q, "prediction": p, "golds": list(g), "verdict": v}
                           for (q, p, g), v in self.cache.items()]
                self.cache_path.write_text(json.dumps(entries, ensure_ascii=False, indent=0))
        return self.cache[key]

    def _ask(self, question: str, prediction: str, golds: tuple) -> bool:
        body = {"model": self.model, "temperature": 0.0, "max_tokens": 8, "messages": [
            {"role": "user", "content": JUDGE_PROMPT.format(question=question, golds=" | ".join(golds),
                                                             prediction=prediction)}]}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        self.requests += 1
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"LLM judge at {self.url} answered HTTP {err.code}: {err.read()[:200]!r}") from err
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise RuntimeError(f"LLM judge at {self.url} is unreachable: {err}") from err
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as err:
            raise RuntimeError(f"LLM judge at {self.url} sent no choices[0].message.content: {reply!r:.200}") from err
        word = (re.findall(r"[a-z]+", text.lower()) or [""])[0]
        if word in ("correct", "yes"):
            return True
        if word in ("incorrect", "no"):
            return False
        raise RuntimeError(f"LLM judge verdict not understood (expected Correct/Incorrect): {text!r:.200}")


# --------------------------------------------------------------------------------------------------
# Evaluation: n independent rollouts per question with the training rollout code


def _criterion(row: dict, judge) -> str:
    return "judge" if judge is not None else ("math_equal" if row["meta"].get("kind") == "math" else "exact_match")


def evaluate(model, tokenizer, rows: list[dict], tools, *, n: int = 5, temperature: float = 0.6,
             top_p: float = 0.95, max_response_tokens: int = 4096, batch_size: int = 64, out_dir=None,
             generator=None, name: str = "eval", judge: Judge | None = None, max_tool_calls: int = 6,
             seed: int = 0, config: dict | None = None, progress: bool = True, rank: int = 0,
             world: int = 1) -> dict:
    """Sample n trajectories per question (rollout.tree_rollout with entropy_branching=False, k=n) and
    score them. Returns the summary dict; with out_dir, writes {name}_results.jsonl (one line per
    question, full trajectories), {name}_summary.json and {name}_summary.md.

    tools: a `tools.Tools`. generator: a rollout Generator (e.g. the trainer's), sampling at `temperature`
    and `top_p` here and set back afterwards; default TransformersGenerator(model, tokenizer, batch_size).
    batch_size: trajectories generated together (each rollout call takes batch_size // n questions).
    Correct = exact_match of the boxed answer, or math_equal for rows with meta["kind"] == "math", or
    judge(question, prediction, golds) if given.
    Several processes (world > 1, every rank calls it): questions go out in chunks of batch_size // n, chunk j to
    rank j % world, each with the seed it has in one process, so the merged results equal one process's; every
    rank returns the summary and rank 0 writes the files.
    """
    import generation
    import parallel
    if generator is None:
        generator = generation.TransformersGenerator(model, tokenizer, batch_size=batch_size)
    started, sampling = time.time(), {"temperature": temperature, "top_p": top_p}
    saved = {key: getattr(generator, key) for key in sampling if hasattr(generator, key)}
    for key in saved:                            # evaluation settings on the generator, then back
        setattr(generator, key, sampling[key])
    try:
        records, tree = _sample_and_score(generator, tokenizer, rows, tools, n, max(1, batch_size // n), judge,
                                          max_tool_calls, max_response_tokens, seed, name, progress, rank, world)
    finally:
        for key, value in saved.items():
            setattr(generator, key, value)
    gathered = parallel.gather((records, dict(tree)))
    records = sorted((rec for recs, _ in gathered for rec in recs), key=lambda rec: rec["index"])
    tree = sum((Counter(counts) for _, counts in gathered), Counter())
    summary = summarize(records, n, name)
    summary.update(wall_s=round(time.time() - started, 1), tool_counts=dict(tree),
                   settings={"n": n, "temperature": temperature, "top_p": top_p, "seed": seed,
                             "max_response_tokens": max_response_tokens, "max_tool_calls": max_tool_calls,
                             "judge": None if judge is None else {"url": judge.url, "model": judge.model}},
                   config=config)
    if out_dir is not None and rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{name}_results.jsonl", "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        (out / f"{name}_summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
        (out / f"{name}_summary.md").write_text(markdown_table([summary]))
    return summary


def _sample_and_score(generator, tokenizer, rows, tools, n, per_call, judge, max_tool_calls, max_response_tokens,
                      seed, name, progress, rank, world) -> tuple[list[dict], Counter]:
    """This rank's chunks of `per_call` questions: n rollouts each, scored. Returns per-question records and tool
    counts."""
    import rollout
    from tqdm import tqdm
    records, tree = [], Counter()
    mine = list(range(0, len(rows), per_call))[rank::world]
    bar = tqdm(total=sum(len(rows[s:s + per_call]) for s in mine) * n, desc=f"eval {name}", unit="traj",
               disable=not progress)
    for start in mine:
        chunk = rows[start:start + per_call]
        done = [0]

        def tick(_round, finished, _total, done=done):
            bar.update(finished - done[0])
            done[0] = finished

        trajectories, stats = rollout.tree_rollout(
            [build_prompt(tokenizer, r["question"]) for r in chunk], generator, tools, tokenizer, k=n,
            dynamic_budget=False, entropy_branching=False, max_tool_calls=max_tool_calls,
            max_response_tokens=max_response_tokens, seed=seed + start, progress=tick)
        bar.update(len(trajectories) - done[0])
        tree.update({key: v for key, v in stats.items() if key.startswith("tools/")})
        for g, row in enumerate(chunk):
            criterion, samples = _criterion(row, judge), []
            for t in (t for t in trajectories if t.group_id == g):
                s = score_response(t.text, row["golds"])
                if s["prediction"] is None:
                    correct = False
                elif criterion == "judge":
                    correct = judge(row["question"], s["prediction"], row["golds"])
                elif criterion == "math_equal":
                    correct = any(math_equal(s["prediction"], gold) for gold in row["golds"])
                else:
                    correct = bool(s["em"])
                samples.append({"traj_id": t.traj_id, "correct": correct, **s,
                                "tool_calls": [list(c) for c in t.tool_calls], "finish_reason": t.finish_reason,
                                "truncated": t.truncated, "response_tokens": len(t.response_ids),
                                "generated_tokens": sum(t.loss_mask), "text": t.text})
            c = sum(x["correct"] for x in samples)
            records.append({"index": start + g, "question": row["question"], "golds": row["golds"],
                            "meta": row["meta"], "criterion": criterion, "n": n, "num_correct": c,
                            "pass@k": {str(k): pass_at_k(n, c, k) for k in range(1, n + 1)},
                            "samples": samples})
    bar.close()
    return records, tree


def summarize(records: list[dict], n: int, name: str) -> dict:
    """Dataset-level metrics from per-question records (means over questions, then samples)."""
    samples = [s for r in records for s in r["samples"]]
    q, m = max(1, len(records)), max(1, len(samples))
    summary = {"dataset": name, "questions": len(records), "n": n,
               "criterion": dict(Counter(r["criterion"] for r in records))}
    for k in range(1, n + 1):
        summary[f"pass@{k}"] = sum(pass_at_k(n, r["num_correct"], k) for r in records) / q
    summary.update(
        em=sum(s["em"] for s in samples) / m, f1=sum(s["f1"] for s in samples) / m,
        reward=sum(s["reward"] for s in samples) / m,
        format_valid=sum(s["format_valid"] for s in samples) / m,
        tool_calls=sum(len(s["tool_calls"]) for s in samples) / m,
        truncated=sum(s["truncated"] for s in samples) / m,
        response_tokens=sum(s["response_tokens"] for s in samples) / m)
    return summary


def markdown_table(summaries: list[dict]) -> str:
    ks = sorted({int(key[5:]) for s in summaries for key in s if key.startswith("pass@")})
    head = ["dataset", "questions", "n", "criterion"] + [f"Pass@{k}" for k in ks] + \
           ["EM", "F1", "reward", "format ok", "tool calls"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        cells = [s["dataset"], s["questions"], s["n"], ", ".join(s["criterion"])]
        cells += [f"{100 * s.get(f'pass@{k}', float('nan')):.1f}" for k in ks]
        cells += [f"{100 * s['em']:.1f}", f"{100 * s['f1']:.1f}", f"{s['reward']:.3f}",
                  f"{100 * s['format_valid']:.1f}", f"{s['tool_calls']:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Command line


@dataclass
class EvalConfig:
    model: str = ""                     # local model directory or hub id (transformers format)
    data: Union[str, list[str]] = "data/qa_test.jsonl"  # dataset file(s), .jsonl/.parquet; several: --data '[a,b]'
    n: int = 5                          # samples per question (Pass@k for every k <= n)
    temperature: float = 0.6            # sampling temperature (SPEC §6)
    top_p: float = 0.95                 # nucleus sampling (SPEC §6)
    max_response_tokens: int = 4096     # response budget per trajectory (policy tokens + tool results)
    max_tool_calls: int = 6             # tool calls per trajectory (official)
    batch_size: int = 64                # trajectories generated together
    limit: int = 0                      # evaluate only the first `limit` questions of each file (0 = all)
    skip_bad: bool = False              # skip malformed dataset rows instead of stopping
    search: str = "bm25"                # search backend for search.make_search (bm25 = embedded Wikipedia)
    search_kw: dict = field(default_factory=dict)  # extra keyword arguments for search.make_search
    judge: bool = False                 # correctness by an LLM judge instead of EM / math_equal
    judge_url: str = ""                 # OpenAI-compatible base URL (default $AEPO_JUDGE_URL)
    judge_model: str = ""               # judge model name (default $AEPO_JUDGE_MODEL)
    judge_api_key: str = ""             # API key (default $AEPO_JUDGE_API_KEY)
    judge_cache: str = ""               # JSON file of cached verdicts (default <out_dir>/judge_cache.json)
    device: str = "cuda"                # torch device (falls back to cpu when CUDA is unavailable)
    dtype: str = "auto"                 # model dtype: auto | float32 | bfloat16 | float16
    seed: int = 0                       # rollout seed
    out_dir: str = ""                   # output directory (default runs/eval/<time>)


def load_model(path_or_id: str, device: str = "cpu", dtype: str = "auto"):
    """(model, tokenizer) from a local directory or a hub id, with a clear error when unavailable."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if not Path(path_or_id).exists() and offline:
        raise FileNotFoundError(f"--model {path_or_id!r} is not a local path and the hub is offline "
                                "(HF_HUB_OFFLINE=1): pass a local model directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path_or_id)
        model = AutoModelForCausalLM.from_pretrained(
            path_or_id, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    except OSError as err:
        raise FileNotFoundError(f"could not load --model {path_or_id!r} (not a local model directory, "
                                f"and the hub lookup failed): {err}") from err
    if device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    return model.to(device).eval(), tokenizer


def main(argv=None) -> list[dict]:
    from jsonargparse import ActionConfigFile, ArgumentParser
    import search as search_mod
    import tools as tools_mod
    parser = ArgumentParser(description="Evaluate a tool-using policy (AEPO, arXiv:2510.14545)")
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(EvalConfig)
    cfg = EvalConfig(**{k: v for k, v in parser.parse_args(argv).as_dict().items() if k != "config"})
    if not cfg.model:
        parser.error("--model is required")
    out = Path(cfg.out_dir or f"runs/eval/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(asdict(cfg), indent=2))
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    judge = Judge.from_env(cfg.judge_url, cfg.judge_model, cfg.judge_api_key,
                           cfg.judge_cache or out / "judge_cache.json") if cfg.judge else None
    model, tokenizer = load_model(cfg.model, cfg.device, cfg.dtype)
    tool_runner = tools_mod.Tools(search_mod.make_search(cfg.search, **cfg.search_kw))
    summaries = []
    for path in [cfg.data] if isinstance(cfg.data, str) else cfg.data:
        rows = load_dataset(path, skip_bad=cfg.skip_bad)
        rows = rows[:cfg.limit] if cfg.limit else rows
        summaries.append(evaluate(model, tokenizer, rows, tool_runner, n=cfg.n, temperature=cfg.temperature,
                                  top_p=cfg.top_p, max_response_tokens=cfg.max_response_tokens,
                                  batch_size=cfg.batch_size, out_dir=out, name=Path(path).stem, judge=judge,
                                  max_tool_calls=cfg.max_tool_calls, seed=cfg.seed, config=asdict(cfg)))
    table = markdown_table(summaries)
    (out / "summary.md").write_text(table)
    (out / "summary.json").write_text(json.dumps(summaries, indent=2, ensure_ascii=False))
    print(table + f"results in {out}")
    return summaries


if __name__ == "__main__":
    main()
