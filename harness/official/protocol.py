"""The authors' evaluation protocol, run with this project's code (eval.py --protocol official): one trajectory per
question and run by text completion with per-tool limits and the browsing search, scored by their evaluator's rules.

Per question (`infer`): the chat template once, then calls to the policy (a `rollout.Generator`: transformers, vLLM,
an OpenAI-compatible endpoint or a test's script) at temperature 0.6, top-p 0.95, top-k 20, repetition penalty 1.1,
at most 4,096 tokens a call. A call's text is cut at a `<result>` the policy wrote itself and after its first
closing tag; a step whose calls hold no closing tag is continued, up to 4 calls in all. A step that ends with
</python> runs the code (120 s), one with </search> the browsing search (harness/official/browse.py: 120 s for its
SERP request and pages, 600 s more for its summary), each as `<result>…</result>`; past 5 python or 10 search calls,
or for a query the question already searched, the result says so and nothing runs. Any other step ends the sample,
and so does its 1,500 s deadline. The prediction is the last \\boxed{} of the last <answer>; the scores (`score`) are
the official evaluator's EM, accuracy, F1, math_equal and, with a judge, llm_equal (harness/correctness.py).
`evaluate` repeats this for `runs` runs, one output file each, and reports the mean over runs and the unbiased Pass@k
over them. algorithm.md §6 and D29-D39 say how this differs from the authors' pipeline.
"""
from __future__ import annotations

import json
import string
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.official.rules import TAGS, aggregate, cut_call, print_last_expression, run_summary, score, tag_content
from rollout import Sampling

PYTHON_LIMIT = "The python tool may not be used any more: its call limit is exceeded."
SEARCH_LIMIT = "The search tool may not be used any more: its call limit is exceeded."
REPEATED = "You have already searched this query. Use the results you got for it before."
# eval.py's flags that both protocols read, at their official values under this one (its own flags default to theirs)
OFFICIAL = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_response_tokens": 4096,
            "search": "brightdata", "search_kw": {}, "judge": True, "batch_size": 50}


@dataclass(frozen=True)
class OfficialSettings:
    """The official protocol's settings (their infer_local_sds.sh and vllm_scripts/)."""
    sampling: Sampling = Sampling(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1)
    call_tokens: int = 4096          # tokens per generate call
    calls_per_step: int = 4          # generate calls per step: the first and its continuations
    python_limit: int = 5            # python calls per question
    search_limit: int = 10           # search calls per question
    tool_timeout_s: float = 120.0    # per tool call; the search's SERP request and page fetches, not its summary
    summary_timeout_s: float = 600.0  # per summary (officially none set: the OpenAI client's default, 600 s)
    sample_timeout_s: float = 1500.0  # per question
    max_model_len: int = 32768       # the policy server's context (prompt + call_tokens)
    batch_size: int = 50             # questions in flight together (their 50 concurrent requests)
    seed: int = 0
    tool_grace_s: float = 5.0        # past a tool's deadline, for it to report its own timeout
    allow_failures: float = 0.05     # the share of an endpoint's requests that may fail (more: the evaluation fails)


@dataclass
class Sample:
    """One question's trajectory in the protocol: `output` is what follows the prompt, `logs` its steps as the
    official code logs them (each policy step and each <result> block), `pending` the step being continued."""
    index: int
    question: str
    prompt: str
    output: str = ""
    logs: list = field(default_factory=list)
    pending: str = ""
    calls: int = 0
    python_calls: int = 0
    search_calls: int = 0
    queries: list = field(default_factory=list)
    finish: str = ""                 # "answer" | "no_tool" | "timeout" | "context" | "policy_error" ("" if active)
    started: float = 0.0
    counts: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)


# --------------------------------------------------------------------------------------------------
# Inference


def _step(s: Sample, settings: OfficialSettings, python, browse) -> tuple | None:
    """A finished step: logged; its tool call decided (a job to run, or the limit / repeated-query result at once)
    or the sample finished. Returns (tool, callable) for a job, else None."""
    step, s.pending, s.calls = s.pending, "", 0
    s.output += step
    s.logs.append(step)
    if "</python>" in step:
        if s.python_calls >= settings.python_limit:
            s.counts["python_limit_hits"] += 1
            _result(s, PYTHON_LIMIT)
            return None
        s.python_calls += 1
        code = print_last_expression(tag_content(step, "python"))
        return "python", lambda deadline, summary_s: python(code, deadline)
    if "</search>" in step:
        query = tag_content(step, "search")
        if s.search_calls >= settings.search_limit:
            s.counts["search_limit_hits"] += 1
            _result(s, SEARCH_LIMIT)
            return None
        if query in s.queries:
            s.counts["repeated_queries"] += 1
            _result(s, REPEATED)
            return None
        s.search_calls += 1
        s.queries.append(query)
        logs = list(s.logs)
        return "search", lambda deadline, summary_s: browse(query, logs, deadline, summary_s)
    s.finish = "answer" if "</answer>" in step else "no_tool"
    return None


def _result(s: Sample, text: str) -> None:
    block = f"<result>{text}</result>"
    s.output += block
    s.logs.append(block)


def infer(rows: list[dict], generator, tokenizer, python, browse, settings: OfficialSettings = OfficialSettings(),
          system_prompt: str = "", seed: int = 0, clock=time.monotonic, progress=None) -> tuple[list[Sample], Counter]:
    """Run the protocol once over `rows` ({"question", ...}). python(code, deadline_s) -> text and browse(query,
    logs, deadline_s, summary_s) -> (text, counts) are the tools: deadline_s bounds a call (for the search, its SERP
    request and page fetches) and summary_s the search's summary, each at most what is left of the question's time.
    Returns the samples in row order and the run's counts."""
    todo = [Sample(i, row["question"], tokenizer.apply_chat_template(
        [{"role": "system", "content": system_prompt}, {"role": "user", "content": row["question"]}],
        tokenize=False, add_generation_prompt=True)) for i, row in enumerate(rows)]
    waiting, active, done, rnd, counts = list(todo), [], [], 0, Counter()
    pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="aepo-official")
    try:
        while waiting or active:
            while waiting and len(active) < settings.batch_size:
                active.append(waiting.pop(0))
                active[-1].started = clock()
            for s in active:
                if clock() - s.started > settings.sample_timeout_s:
                    s.finish = "timeout"
            contexts = {id(s): tokenizer.encode(s.prompt + s.output + s.pending, add_special_tokens=False)
                        for s in active if not s.finish}
            for s in active:
                if not s.finish and len(contexts[id(s)]) + settings.call_tokens > settings.max_model_len:
                    s.finish = "context"             # the server would refuse the call
            calling = [s for s in active if not s.finish]
            began = clock()
            segments = generator.generate([contexts[id(s)] for s in calling], [settings.call_tokens] * len(calling),
                                          (seed * 1_000_003 + rnd) % 2 ** 31, settings.sampling) if calling else []
            rnd += 1
            jobs = []
            for s, segment in zip(calling, segments):
                s.seconds["llm"] += clock() - began
                s.counts["policy_calls"] += 1
                if segment.finish_reason == "error":  # the policy's server gave no reply: the question ends
                    s.counts["policy_errors"] += 1
                    s.output, s.finish = s.output + s.pending, "policy_error"
                    continue
                s.counts["generated_tokens"] += len(segment.token_ids)
                s.pending += cut_call(tokenizer.decode(segment.token_ids, skip_special_tokens=True))
                s.calls += 1
                if not any(tag in s.pending for tag in TAGS) and s.calls < settings.calls_per_step:
                    s.counts["continuations"] += 1
                    continue
                s.counts["steps_without_tag"] += not any(tag in s.pending for tag in TAGS)
                job = _step(s, settings, python, browse)
                if job is not None:             # its deadlines: their own, or what is left of the question's
                    left = settings.sample_timeout_s - (clock() - s.started)
                    deadline = max(0.01, min(settings.tool_timeout_s, left))
                    summary_s = max(0.01, min(settings.summary_timeout_s, left)) if job[0] == "search" else 0.0
                    jobs.append((s, job[0], pool.submit(job[1], deadline, summary_s), deadline + summary_s))
            for s, tool, future, bound in jobs:
                _finish_job(s, tool, future, bound, settings, clock)
            for s in [s for s in active if s.finish]:
                if s.finish == "timeout":
                    s.output += f"\n[Timeout: the question passed its {settings.sample_timeout_s:g} s]"
                s.seconds["total"] = clock() - s.started
                counts[f"finish/{s.finish}"] += 1
                active.remove(s)
                done.append(s)
                if progress is not None:
                    progress(len(done), len(todo))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for s in done:
        counts.update(s.counts)
    return sorted(done, key=lambda s: s.index), counts


def _finish_job(s: Sample, tool: str, future, bound: float, settings: OfficialSettings, clock) -> None:
    """Wait for one tool call (its bound: the call's deadline, and the summary's for a search; then tool_grace_s for
    the tool to report its own timeout) and append its result."""
    started = clock()
    try:
        value = future.result(timeout=bound + settings.tool_grace_s)
    except FutureTimeout:
        s.counts[f"{tool}_timeouts"] += 1
        value = f"Error: the {tool} call passed its {bound:g} s"
    except Exception as err:  # noqa: BLE001 -- a failing tool is its result text, never a crashed run
        s.counts[f"{tool}_errors"] += 1
        value = f"Error: the {tool} tool failed: {type(err).__name__}: {err}"
    if isinstance(value, tuple):                 # the browsing search: (text, counts)
        value, tool_counts = value
        s.counts.update({f"browse/{key}": n for key, n in tool_counts.items()})
    s.seconds[tool] += clock() - started
    s.counts[f"{tool}_calls"] += 1
    _result(s, value)
    if clock() - s.started > settings.sample_timeout_s:
        s.finish = "timeout"


# --------------------------------------------------------------------------------------------------
# The runs


def evaluate(generator, tokenizer, rows: list[dict], python, browse, settings: OfficialSettings, runs: int = 1, *,
             judge=None, name: str = "eval", out_dir=None, system_prompt: str = "", config: dict | None = None,
             progress: bool = True) -> dict:
    """`runs` runs of `infer` over rows, each scored; with out_dir, {name}_output_{r}.jsonl per run (one record per
    question: output, steps, prediction, metrics) and {name}_summary.{json,md}. Returns the summary (`aggregate`,
    with each run's own summary under "per_run")."""
    from tqdm import tqdm
    started, all_runs, per_run = time.time(), [], []
    for r in range(1, runs + 1):
        bar = tqdm(total=len(rows), desc=f"{name} run {r}/{runs}", unit="question", disable=not progress)
        samples, counts = infer(rows, generator, tokenizer, python, browse, settings, system_prompt,
                                seed=settings.seed * 1009 + r, progress=lambda d, t: bar.update(d - bar.n))
        bar.close()
        records = [score(s, rows[s.index], judge) for s in samples]
        all_runs.append(records)
        per_run.append(run_summary(records, counts))
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(out_dir) / f"{name}_output_{r}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    summary = aggregate(all_runs, name)
    summary.update(criterion="llm_equal" if judge is not None else "em / math_equal", per_run=per_run,
                   wall_s=round(time.time() - started, 1), settings=asdict(settings), config=config,
                   prompts={"system": system_prompt, "judge": getattr(judge, "prompt", None)})
    if out_dir is not None:
        (Path(out_dir) / f"{name}_summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
        (Path(out_dir) / f"{name}_summary.md").write_text(markdown_table([summary]))
    return summary


def markdown_table(summaries: list[dict]) -> str:
    """One row per data set: Pass@k over the runs, then the official metrics (means over runs, in %), the tool calls
    per question and the run's notable counts (continued calls, limit hits, repeated queries, timeouts)."""
    ks = sorted({int(key[5:]) for s in summaries for key in s if key.startswith("pass@")})
    head = ["dataset", "questions", "runs", "criterion"] + [f"Pass@{k}" for k in ks] + \
        ["EM", "acc", "F1", "math_equal", "llm_equal", "python", "search", "continued", "limits", "repeated",
         "timeouts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        counts = Counter()
        for r in s["per_run"]:
            counts.update(r["counts"])
        runs = max(1, s["runs"])
        cells = [s["dataset"], s["questions"], s["runs"], s["criterion"]]
        cells += [f"{100 * s[f'pass@{k}']:.1f}" for k in ks]
        cells += [f"{100 * s[key]:.1f}" if key in s else "—"
                  for key in ("em", "acc", "f1", "math_equal", "llm_equal")]
        cells += [f"{s['python_calls']:.2f}", f"{s['search_calls']:.2f}", f"{counts['continuations'] / runs:g}",
                  f"{(counts['python_limit_hits'] + counts['search_limit_hits']) / runs:g}",
                  f"{counts['repeated_queries'] / runs:g}", f"{counts['finish/timeout'] / runs:g}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def prompt_file(key: str, path: str, placeholders: tuple = ()) -> str:
    """The text of the prompt file given as --KEY FILE, checked at start-up: a readable UTF-8 file, not empty,
    and, where `placeholders` are named (a prompt filled by str.format), holding each as {name} and no other field (a
    literal brace is written {{ or }}). Anything else is a one-line UserError naming the file."""
    from harness.cli import UserError
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--{key} {path}: cannot be read as UTF-8 text ({type(err).__name__}: {err})") from None
    if not text.strip():
        raise UserError(f"--{key} {path}: the file is empty")
    if not placeholders:
        return text
    names = ", ".join("{" + name + "}" for name in placeholders)
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as err:
        raise UserError(f"--{key} {path}: not a str.format template ({err}; write a literal brace as {{{{ or "
                        f"}}}})") from None
    for name in placeholders:
        if name not in fields:
            raise UserError(f"--{key} {path}: the placeholder {{{name}}} is missing (the prompt needs {names})")
    for name in fields:
        if name not in placeholders:
            raise UserError(f"--{key} {path}: {{{name}}} is not a placeholder it fills (only {names}; write a "
                            f"literal brace as {{{{ or }}}})")
    return text


def main(cfg, datasets: list, out: Path) -> list[dict]:
    """eval.py --protocol official, from its EvalConfig: the prompts (cfg.system_prompt, cfg.judge_prompt: files,
    checked first), every endpoint and the page cache (harness/official/endpoints.py), the policy (the endpoint at
    cfg.policy_url, else cfg.model sampled by transformers), the browsing search over cfg.search's results, the python
    tool, the judge; then `evaluate` on every data set and summary.{md,json} over them, with a line for each endpoint
    whose requests failed: a RunFailure when one failed more than cfg.allow_failures of them."""
    import tools
    from harness import config, models, openai_client, search as search_mod
    from harness.official import endpoints
    from harness.official.browse import BrowseSearch, Summarizer
    from harness.cli import RunFailure, UserError
    from harness.correctness import JUDGE_PLACEHOLDERS, OFFICIAL_JUDGE_PROMPT, OfficialJudge
    from harness.settings import python_isolation, python_limits
    if list(cfg.tools) != ["search", "python"] or cfg.mcp_server or cfg.tool_format != "tags":
        raise UserError("--protocol official runs the authors' search and python in tags: --tools, --mcp_server and "
                        "--tool_format are the training protocol's (drop them, or --protocol training)")
    if cfg.search not in ("brightdata", "web"):
        raise UserError(f"--protocol official fetches the pages of web results: --search brightdata (the official "
                        f"SERP API) or web, not {cfg.search}")
    system_prompt = prompt_file("system_prompt", cfg.system_prompt) if cfg.system_prompt else tools.SYSTEM_PROMPT
    judge_prompt = prompt_file("judge_prompt", cfg.judge_prompt, JUDGE_PLACEHOLDERS) if cfg.judge_prompt else \
        OFFICIAL_JUDGE_PROMPT
    checked = endpoints.check(cfg, cfg.page_cache or config.cache_dir() / "browse" / "pages.sqlite")
    judge = OfficialJudge(checked.judge.url, checked.judge.model, checked.judge.api_key, judge_prompt) \
        if checked.judge else None
    serp_kw = {"timeout_s": cfg.tool_timeout_s, "retries": 2, **cfg.search_kw}   # 3 tries, as the official evaluator's
    browse = BrowseSearch(search_mod.make_search(cfg.search, **serp_kw),
                          Summarizer(checked.summarizer.url, checked.summarizer.model, checked.summarizer.api_key),
                          checked.cache, cfg.fetch_timeout_s)
    print(f"browsing search: {browse!r}; judge: {getattr(judge, 'model', None)}; system prompt: "
          f"{cfg.system_prompt or 'tools.SYSTEM_PROMPT'}; judge prompt: {cfg.judge_prompt or 'OFFICIAL_JUDGE_PROMPT'}",
          flush=True)
    print(python_isolation(cfg.python_isolation, cfg.python_limits), flush=True)
    python_kw = {key: value for key, value in python_limits(cfg.python_limits).items() if key != "timeout_s"}

    def python(code: str, deadline_s: float) -> str:              # the official per-call deadline, not timeout_s
        return tools.run_python(code, timeout_s=deadline_s, **python_kw)

    if checked.policy:
        tokenizer = models.load_tokenizer(models.model_source(cfg.model))
        generator = openai_client.CompletionsGenerator(checked.policy.url, tokenizer, checked.policy.model,
                                                       checked.policy.api_key)
    else:
        from harness.generation import TransformersGenerator
        model, tokenizer = models.load_model(cfg.model, cfg.device, cfg.dtype)
        generator = TransformersGenerator(model, tokenizer, batch_size=cfg.batch_size)
    settings = OfficialSettings(Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.repetition_penalty),
                                call_tokens=cfg.max_response_tokens, calls_per_step=cfg.calls_per_step,
                                python_limit=cfg.python_limit, search_limit=cfg.search_limit,
                                tool_timeout_s=cfg.tool_timeout_s, summary_timeout_s=cfg.summary_timeout_s,
                                max_model_len=cfg.max_model_len,
                                batch_size=cfg.batch_size, seed=cfg.seed, allow_failures=cfg.allow_failures)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    summaries = []
    for path, rows in datasets:
        summaries.append(evaluate(generator, tokenizer, rows[:cfg.limit] if cfg.limit else rows, python, browse,
                                  settings, cfg.runs, judge=judge, name=Path(path).stem, out_dir=out,
                                  system_prompt=system_prompt, config=asdict(cfg)))
    first_errors = {**{f"browse/{key}": error for key, error in browse.first_errors.items()},
                    "judge_errors": getattr(judge, "first_error", ""),
                    "policy_errors": getattr(generator, "first_error", "")}
    lines, failed = endpoints.failures(summaries, first_errors, settings.allow_failures)
    table = markdown_table(summaries) + "".join(f"\n{line}\n" for line in lines)
    (out / "summary.md").write_text(table)
    (out / "summary.json").write_text(json.dumps(summaries, indent=2, ensure_ascii=False))
    print(table + f"results in {out}", flush=True)
    checked.cache.close()
    if failed:
        raise RunFailure(f"{' and '.join(failed)} failed more than --allow_failures {settings.allow_failures:g} of "
                         f"{'its' if len(failed) == 1 else 'their'} requests (FAILED above): these scores do not "
                         f"measure the policy alone; results in {out}")
    return summaries
