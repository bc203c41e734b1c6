"""Evaluation: n rollouts per held-out question, Pass@1 and unbiased Pass@k, EM, F1 and the reward; or the authors'
own evaluation protocol.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, paper §4 experimental setup;
algorithm.md §6: each question gets n independent trajectories from the training rollout code (no branching) at
temperature 0.6 and top-p 0.95; Pass@1 is the mean correctness and Pass@k the unbiased estimator. Correct is exact
match of the boxed answer, `math_equal` for math questions, or an LLM judge (harness/correctness.py). `--protocol
official` runs the authors' evaluation instead (harness/official/protocol.py: text completion with per-tool limits, the
browse-and-summarise search, their judge rule, Pass@k over --runs runs), each of its settings a flag whose default
under that protocol is the official value.

    python eval.py --run runs/<name>                   # a run's latest checkpoint, evaluated the way it trained
    python eval.py --model PATH --data '[data/qa_test.jsonl, ../shared/data/benchmarks/bamboogle.jsonl]'
    python eval.py --protocol official --model PATH --data ../shared/data/benchmarks/gaia.jsonl --summarizer_url URL \\
        --judge_url URL                                # the paper's evaluation (README: Evaluation)

Deviations from the paper / official code (algorithm.md §8): D27 ("correct" explicit per data set), D28 (several
processes split the questions in whole chunks, each with its one-process seed); under --protocol official, D29-D39.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Union

import rollout
import tools
from harness import cli, config, generation, search as search_mod, settings as settings_mod, trees
from harness.run import checkpoint, parallel, rundir, runlog
from harness.official import flags as official_flags, protocol
from harness.cli import UserError
from harness.config import Config, arg, expert
from harness.correctness import Judge, math_equal
from harness.dataset import check_prompts, load_files
from harness.models import check_run_model, load_model, load_tokenizer, model_source
from reward import pass_at_k, score_response  # noqa: F401 (eval.pass_at_k: the name other code imports)

# --------------------------------------------------------------------------------------------------
# Evaluation: n independent rollouts per question with the training rollout code


@dataclass(frozen=True)
class EvalSettings:
    """How `evaluate` samples (algorithm.md §6 defaults): n trajectories per question, each an independent rollout
    (no branching) with these sampling settings, token budget and tool-call limit; batch_size trajectories generated
    together (batch_size // n questions per rollout call); seed + the first question's index seeds each call."""
    n: int = 5
    sampling: rollout.Sampling = rollout.Sampling(temperature=0.6, top_p=0.95)
    max_response_tokens: int = 4096
    max_tool_calls: int = 6
    batch_size: int = 64
    seed: int = 0
    strict_format: bool = False                  # reward.check_format's strict rule


def _criterion(row: dict, judge) -> str:
    return "judge" if judge is not None else ("math_equal" if row["meta"].get("kind") == "math" else "exact_match")


def evaluate(generator, tokenizer, rows: list[dict], tool_runner, settings: EvalSettings = EvalSettings(), *,
             name: str = "eval", judge: Judge | None = None, out_dir=None, config: dict | None = None,
             rank: int = 0, world: int = 1, progress: bool = True) -> dict:
    """Sample settings.n trajectories per question and score them. Returns the summary dict; with out_dir, rank 0
    writes {name}_results.jsonl (one line per question, full trajectories), {name}_summary.json, {name}_summary.md
    and {name}_trees.jsonl.

    generator: a `rollout.Generator` (the trainer's, or generation.TransformersGenerator); tool_runner: a
    `tools.Tools`. Correct = exact_match of the boxed answer, or math_equal for rows with meta["kind"] == "math", or
    judge(question, prediction, golds) if given. Several processes (world > 1, every rank calls it): questions go
    out in chunks of batch_size // n, chunk j to rank j % world, each with the seed it has in one process, so the
    merged results equal one process's (D28); every rank returns the summary."""
    started = time.time()
    part = _sample_and_score(generator, tokenizer, rows, tool_runner, settings, judge, name, progress, rank, world)
    gathered = parallel.gather(part)
    records = sorted((rec for recs, _, _ in gathered for rec in recs), key=lambda rec: rec["index"])
    shapes = [shape for _, part, _ in gathered for shape in part]
    tool_counts = sum((Counter(counts) for _, _, counts in gathered), Counter())
    summary = summarize(records, settings.n, name)
    summary.update(wall_s=round(time.time() - started, 1), tool_counts=dict(tool_counts),
                   settings={**asdict(settings), "judge": None if judge is None else
                             {"url": judge.url, "model": judge.model}}, config=config)
    if out_dir is not None and rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{name}_results.jsonl", "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        (out / f"{name}_summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
        (out / f"{name}_trees.jsonl").write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in shapes))
        per_type = [{**s, "dataset": f"{name}: {kind}"} for kind, s in summary.get("by_type", {}).items()]
        (out / f"{name}_summary.md").write_text(markdown_table([summary, *per_type]))
    return summary


def _sample_and_score(generator, tokenizer, rows, tool_runner, settings: EvalSettings, judge, name, progress, rank,
                      world) -> tuple[list[dict], list[dict], dict]:
    """This rank's chunks of questions: settings.n rollouts each, scored. Returns per-question records, tree records
    (trees.py) and tool counts."""
    from tqdm import tqdm
    per_call = max(1, settings.batch_size // settings.n)
    tree = rollout.TreeSettings(k=settings.n, dynamic_budget=False, entropy_branching=False,
                                max_tool_calls=settings.max_tool_calls, max_response_tokens=settings.max_response_tokens)
    records, shapes, tool_counts = [], [], Counter()
    fmt = getattr(tool_runner, "format", tools.TAGS)      # the tool-call format: prompts and the format check
    mine = list(range(0, len(rows), per_call))[rank::world]
    bar = tqdm(total=sum(len(rows[s:s + per_call]) for s in mine) * settings.n, desc=f"eval {name}", unit="traj",
               disable=not progress)
    for start in mine:
        chunk = rows[start:start + per_call]
        trajectories, stats = rollout.tree_rollout(
            [fmt.build_prompt(tokenizer, r["question"]) for r in chunk], generator, tool_runner, tokenizer, tree,
            sampling=settings.sampling, seed=settings.seed + start,
            progress=runlog.RolloutProgress(bar, "generation", count=True) if progress else None)
        tool_counts.update({key: v for key, v in stats.items() if key.startswith("tools/")})
        scored = [score_response(t.text, chunk[t.group_id]["golds"], settings.strict_format, fmt.format_tags)
                  for t in trajectories]
        shapes += trees.records(name, chunk, trajectories, stats["m_per_question"], [s["reward"] for s in scored])
        for g, row in enumerate(chunk):
            mine_g = [(t, s) for t, s in zip(trajectories, scored) if t.group_id == g]
            records.append(_question_record(start + g, row, mine_g, _criterion(row, judge), judge, settings.n))
    bar.close()
    return records, shapes, dict(tool_counts)


def _question_record(index: int, row: dict, scored: list, criterion: str, judge, n: int) -> dict:
    """One question's record: its samples (each trajectory, its score and whether it is correct) and Pass@k."""
    samples = []
    for t, s in scored:
        if s["prediction"] is None:
            correct = False
        elif criterion == "judge":
            correct = judge(row["question"], s["prediction"], row["golds"])
        elif criterion == "math_equal":
            correct = any(math_equal(s["prediction"], gold) for gold in row["golds"])
        else:
            correct = bool(s["em"])
        samples.append({"traj_id": t.traj_id, "correct": correct, **s, "tool_calls": [list(c) for c in t.tool_calls],
                        "finish_reason": t.finish_reason, "truncated": t.truncated,
                        "response_tokens": len(t.response_ids), "generated_tokens": sum(t.loss_mask),
                        "text": t.text})
    c = sum(x["correct"] for x in samples)
    return {"index": index, "question": row["question"], "golds": row["golds"], "meta": row["meta"],
            "criterion": criterion, "n": n, "num_correct": c,
            "pass@k": {str(k): pass_at_k(n, c, k) for k in range(1, n + 1)}, "samples": samples}


def summarize(records: list[dict], n: int, name: str, by_type: bool = True) -> dict:
    """Dataset-level metrics from per-question records (means over questions, then samples); with by_type, the same
    per question type (`by_type`), where the rows have a `type` field."""
    samples = [s for r in records for s in r["samples"]]
    q, m = max(1, len(records)), max(1, len(samples))
    summary = {"dataset": name, "questions": len(records), "n": n,
               "criterion": dict(Counter(r["criterion"] for r in records))}
    for k in range(1, n + 1):
        summary[f"pass@{k}"] = sum(pass_at_k(n, r["num_correct"], k) for r in records) / q
    for key in ("em", "f1", "reward", "format_valid", "tool_calls", "truncated", "response_tokens"):
        summary[key] = sum(len(s[key]) if key == "tool_calls" else s[key] for s in samples) / m
    kinds = sorted({r["meta"]["type"] for r in records if isinstance(r["meta"].get("type"), str)})
    if by_type and kinds:
        summary["by_type"] = {kind: summarize([r for r in records if r["meta"].get("type") == kind], n, name, False)
                              for kind in kinds}
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


def like(key: str, default=dataclasses.MISSING, help: str = ""):
    """A field of another command's config (eval.py) that is the training setting `key`: Config's help unless `help`
    is given, Config's default unless `default` is, and metadata "train_key" (eval.py --run reads the run's value of
    `key` into it); rarely changed (--help's last group) where the training setting is."""
    source = {f.name: f for f in dataclasses.fields(Config)}[key]
    if default is dataclasses.MISSING:
        default = source.default_factory() if source.default_factory is not dataclasses.MISSING else source.default
    return arg(default, help or source.metadata["help"].replace(" [embedded]", ""), source.metadata["valid"],
               train_key=key, expert=source.metadata.get("expert", False))


@dataclass
class _Common:
    """The settings both protocols read (EvalConfig: these, then the official protocol's own)."""
    run: str = arg("", "a training run folder (runs/<name>): evaluate its latest checkpoint (or --step) with the data, "
                       "tools, search, token budget and sampling it trained with; the flags below override them",
                   group="what to evaluate, and how (both protocols)")
    step: int = arg(0, "with --run: the checkpoint of this step (0 = the latest)", valid="[0, inf)")
    model: str = arg("", "a model directory (e.g. runs/<name>/checkpoints/step_000016) or hub id, evaluated with "
                         "the defaults below unless flags change them")
    protocol: str = arg("training", "training: n rollouts per question with the training rollout and search; "
                                    "official: the authors' evaluation (algorithm.md §6), with the settings of its "
                                    "own group below", valid="training | official")
    data: Union[str, list[str]] = arg("data/qa_test.jsonl", "dataset file(s), .jsonl or verl .parquet; several: "
                                                            "--data '[a.jsonl, b.jsonl]'", train_key="eval_data")
    limit: int = like("eval_limit", 0, "evaluate only the first N questions of each file (0 = all)")
    n: int = like("eval_n", EvalSettings.n, "samples per question (Pass@k for every k <= n; algorithm.md §6: 5)")
    temperature: float = arg(EvalSettings.sampling.temperature, "evaluation sampling temperature (algorithm.md §6)",
                             valid="[0, inf)")
    top_p: float = arg(EvalSettings.sampling.top_p, "evaluation nucleus sampling (algorithm.md §6)", valid="(0, 1]")
    max_response_tokens: int = like("max_response_tokens", EvalSettings.max_response_tokens,
                                    "response budget per trajectory: policy tokens + "
                                    "tool results (official protocol: tokens per generate call, 4096)")
    max_tool_calls: int = like("max_tool_calls")
    strict_format: bool = like("strict_format")
    batch_size: int = like("gen_batch_size", help="trajectories generated together (batch_size // n questions per "
                                                  "rollout call)")
    skip_bad: bool = like("skip_bad")
    search: str = arg("bm25", "search backend for search.make_search: bm25 (embedded Wikipedia), replay, http, web, "
                              "brightdata (official protocol: brightdata, whose results' pages it browses)",
                      valid="bm25 | replay | http | web | brightdata", train_key="search")
    search_kw: dict = like("search_kw", {}, "keyword arguments for search.make_search (default: 10 snippets, as the "
                                            "official code)")
    python_limits: dict = like("python_limits")
    tools: list[str] = like("tools")
    mcp_server: Union[str, list[str]] = like("mcp_server")
    tool_format: str = like("tool_format")
    observations_as_data: bool = like("observations_as_data")
    python_isolation: str = like("python_isolation")
    device: str = arg("cuda", "torch device (cpu when CUDA is unavailable)")
    dtype: str = expert("auto", "model dtype", valid="auto | float32 | bfloat16 | float16")
    seed: int = like("seed", help="rollout seed")
    out_dir: str = arg("", "output directory (default: <run>/eval/<checkpoint>-<time> with --run, else "
                           "runs/eval/<time>)")
    judge: bool = arg(False, "correctness by an OpenAI-compatible LLM judge instead of EM / math_equal (official "
                             "protocol: on, with its rule)", group="the LLM judge")
    judge_url: str = arg("", "the judge's base URL (default $AEPO_JUDGE_URL)")
    judge_model: str = expert("", "the judge's model name (default $AEPO_JUDGE_MODEL)")
    judge_cache: str = expert("", "JSON file of cached verdicts (default <out_dir>/judge_cache.json)")
    top_k: int = expert(0, "top-k sampling, 0 = off (official protocol: 20)", valid="[0, inf)")
    repetition_penalty: float = expert(1.0, "repetition penalty on sampling only, never on H_seg or log-probs; 1 = off "
                                            "(official protocol: 1.1)", valid="(0, inf)")


@dataclass
class EvalConfig(official_flags.OfficialConfig, _Common):
    """eval.py's settings: _Common's fields, then harness/official/flags.py's OfficialConfig (a dataclass takes its
    bases' fields from the last base to the first), so --help lists the official protocol's group after both's."""


# eval.py flag <- the run's config.yaml key
FROM_RUN = {f.name: f.metadata["train_key"] for f in fields(EvalConfig) if "train_key" in f.metadata}


def eval_settings(cfg: EvalConfig | Config) -> EvalSettings:
    """The EvalSettings of eval.py's flags, or of a training Config read through FROM_RUN (eval_n, gen_batch_size,
    ...; its sampling then the evaluation's own, algorithm.md §6): the one place both commands build them."""
    if isinstance(cfg, Config):
        cfg = EvalConfig(**{flag: getattr(cfg, key) for flag, key in FROM_RUN.items()})
    return EvalSettings(n=cfg.n, sampling=rollout.Sampling(cfg.temperature, cfg.top_p, cfg.top_k,
                                                           cfg.repetition_penalty),
                        max_response_tokens=cfg.max_response_tokens, max_tool_calls=cfg.max_tool_calls,
                        batch_size=cfg.batch_size, seed=cfg.seed, strict_format=cfg.strict_format)


def run_settings(run_dir: Path) -> dict:
    """The eval.py flags a training run implies (its config.yaml, newest start), as parser defaults."""
    saved = config.read_saved(run_dir, "--run")
    out = {flag: saved[key] for flag, key in FROM_RUN.items() if key in saved}
    if not out.get("data"):
        out.pop("data", None)
    if saved.get("search") == "bm25" and saved.get("cache_dir"):
        out["search_kw"] = {"cache": saved["cache_dir"], **saved.get("search_kw", {})}
    return out


def _training_note(model: str, cfg: EvalConfig) -> str:
    """When --model is a checkpoint of a training run evaluated without --run: the settings that differ."""
    run_dir = Path(model).resolve().parent.parent
    if Path(model).resolve().parent.name != "checkpoints" or not (run_dir / "config.yaml").exists():
        return ""
    implied = run_settings(run_dir)
    differ = [f"{flag} {implied[flag]!r} (here {getattr(cfg, flag)!r})" for flag in implied
              if implied[flag] != getattr(cfg, flag)]
    return (f"note: {model} is a checkpoint of {run_dir}, which evaluated with " + ", ".join(differ) +
            f"; add --run {run_dir} to evaluate it the way its training did") if differ else ""


def _settings(argv) -> tuple[EvalConfig, str]:
    """The evaluation's settings, checked: the defaults, then a training run's settings (--run) or the official
    protocol's, then the flags. Returns them and a phrase saying where they came from."""
    parser = config.build_parser(EvalConfig, prog="eval.py",
                                 description="Evaluate a tool-using policy (AEPO, arXiv:2510.14545): Pass@k, EM, F1")
    args = config.parse_args(parser, argv, "eval.py", EvalConfig)
    official = args["protocol"] == "official"
    source = "the defaults and flags"
    if args["run"]:                                                   # the run's settings; flags still override
        parser.set_defaults(**{k: v for k, v in run_settings(Path(args["run"])).items()
                               if not (official and k in protocol.OFFICIAL)})
    if official:
        parser.set_defaults(**protocol.OFFICIAL)
    if args["run"] or official:
        args = config.parse_args(parser, argv, "eval.py", EvalConfig)
    if args["run"]:
        model = args["model"] or str(checkpoint.run_checkpoint(Path(args["run"]), args["step"]))
        args["model"] = check_run_model(model, Path(args["run"]), given=bool(args["model"]))
        source = f"the settings of {args['run']} and the flags"
    cfg = EvalConfig(**{k: v for k, v in args.items() if k != "config"})
    config.check_valid(cfg)                      # before anything is read or written
    given = [f"--{f.name}" for f in fields(official_flags.OfficialConfig) if getattr(cfg, f.name) != f.default]
    if given and not official:
        raise UserError(f"{', '.join(given)}: read by --protocol official only (python eval.py --help: the group "
                        f"'{official_flags.GROUP}')")
    if not cfg.model:
        raise UserError("give --run runs/<name> (a training run) or --model PATH (python eval.py --help)")
    return cfg, source


def main(argv=None) -> list[dict]:
    cfg, source = _settings(argv)
    official = cfg.protocol == "official"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(cfg.out_dir) if cfg.out_dir else \
        Path(cfg.run, "eval", f"{Path(cfg.model).name}-{stamp}") if cfg.run else Path("runs", "eval", stamp)
    print(f"evaluating {cfg.model} ({cfg.protocol} protocol) with {source}: data {cfg.data}, limit {cfg.limit}, n "
          f"{cfg.n}, temperature {cfg.temperature}, top_p {cfg.top_p}, max_response_tokens {cfg.max_response_tokens}, "
          f"max_tool_calls {cfg.max_tool_calls}, search {cfg.search} {cfg.search_kw}", flush=True)
    if not cfg.run and (note := _training_note(cfg.model, cfg)):
        print(note, flush=True)
    datasets = load_files(cfg.data, cfg.skip_bad)                          # every input checked before any output
    rundir.check_writable(str(out), "out_dir")
    if official:
        return protocol.main(cfg, datasets, out)
    judge = Judge.from_env(cfg.judge_url, cfg.judge_model, None,
                           cfg.judge_cache or out / "judge_cache.json") if cfg.judge else None
    search = search_mod.make_search(cfg.search, **cfg.search_kw)
    search_mod.check_reachable(search)
    source = model_source(cfg.model)             # the tokenizer, then the prompts checked, then the weights
    tokenizer = load_tokenizer(source)
    print(settings_mod.python_isolation(cfg.python_isolation, cfg.python_limits), flush=True)
    tool_runner = settings_mod.make_tools(search, cfg.python_limits, cfg.tools, cfg.mcp_server, cfg.tool_format,
                                          tokenizer, cfg.model, cfg.observations_as_data)
    check_prompts(datasets, cfg.limit, tokenizer, tool_runner.format.build_prompt, source)
    model = load_model(source, cfg.device, cfg.dtype)[0]
    new_dir = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    generator = generation.TransformersGenerator(model, tokenizer, batch_size=cfg.batch_size,
                                                 stop_strings=tool_runner.format.stop_strings)
    settings = eval_settings(cfg)
    summaries = []
    try:
        for path, rows in datasets:
            rows = rows[:cfg.limit] if cfg.limit else rows
            summaries.append(evaluate(generator, tokenizer, rows, tool_runner, settings, name=Path(path).stem,
                                      judge=judge, out_dir=out, config=asdict(cfg)))
    except KeyboardInterrupt:
        tool_runner.close()
        if summaries:
            raise cli.Interrupted(f"{len(summaries)} of {len(datasets)} data set(s) evaluated; their results are "
                                     f"in {out}") from None
        if new_dir:
            shutil.rmtree(out, ignore_errors=True)
        raise cli.Interrupted("no data set was finished, so nothing was kept") from None
    table = markdown_table(summaries)
    (out / "summary.md").write_text(table)
    (out / "summary.json").write_text(json.dumps(summaries, indent=2, ensure_ascii=False))
    print(table + f"results in {out}")
    tool_runner.close()
    return summaries


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
