"""The benchmark helpers that produce README numbers: the lookup task (data/build_lookup.py), the comparison's aggregation and
the branch-concentration statistics its plots use."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import rollout
from harness import search as search_mod
from harness.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "data"))
import build_lookup  # noqa: E402
import compare_algorithms  # noqa: E402


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_lookup_task_is_deterministic_and_answerable_by_search(tmp_path):
    a = build_lookup.make_task(tmp_path / "a", n_train=40, n_test=20, n_cold=10, two_hop_demos=4)
    b = build_lookup.make_task(tmp_path / "b", n_train=40, n_test=20, n_cold=10, two_hop_demos=4)
    for key in a:
        assert Path(a[key]).read_text() == Path(b[key]).read_text()
    train, test, corpus = read(a["train"]), read(a["test"]), read(a["corpus"])
    assert len(train) == 50 and len(test) == 20 and len(corpus) == 2 * 70
    assert [r["type"] for r in train[:10]].count("two_hop") == 4                # the cold-start rows
    assert [r["type"] for r in train[10:14]] == ["lookup", "two_hop", "lookup", "two_hop"]
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    # a demonstration names only cold-start people and their firms: no RL or test entity
    later = {r["bridge"] for r in train[10:] + test if "bridge" in r} | \
        {r["question"].split(" of ")[-1].rstrip("?") for r in train[10:] + test}
    assert not any(name in json.dumps(r) for r in train[:10] for name in later)
    search = search_mod.make_search("bm25", corpus_path=a["corpus"], cache=tmp_path / "cache", topk=1)
    rows = train + test
    for r in rows:
        queries = [r["query"]] if r["type"] == "lookup" else r["query"]
        results = search.search(queries)
        phrase = r["answer"][0]
        assert len(phrase.split()) == 3 and phrase in results[-1], (r, results)
        if r["type"] == "two_hop":                     # the question's own text finds the firm, not the answer ...
            first = search.search([r["question"]])[0]
            assert phrase not in first and f"Its director is {r['bridge']}." in first, (r, first)
            assert r["query"][1] == f"{r['bridge']} passphrase"      # ... which names the director: the second query


def test_three_hop_questions_need_three_searches(tmp_path):
    """With three_hop_every = 3 every third RL and test row is three-hop: the question's own text finds the
    employee's page (whose passphrase is the wrong one), and the three queries in turn find the firm, the director and
    the answer; a three-hop demonstration names only cold-start entities; the lookup and two-hop rows are the people
    they are without three-hop (the employees are drawn apart), and the demonstrations search three times."""
    from harness.run import coldstart
    task = build_lookup.make_task(tmp_path / "t", n_train=30, n_test=12, n_cold=10, two_hop_demos=2,
                                  three_hop_demos=3, three_hop_every=3)
    plain = build_lookup.make_task(tmp_path / "p", n_train=30, n_test=12, n_cold=10, two_hop_demos=2)
    train, test = read(task["train"]), read(task["test"])
    assert [r["type"] for r in train[:10]].count("three_hop") == 3
    assert [r["type"] for r in train[:10]].count("two_hop") == 2
    assert [r["type"] for r in train[10:16]] == ["lookup", "two_hop", "three_hop", "two_hop", "lookup", "three_hop"]
    assert [r["type"] for r in test].count("three_hop") == 4
    for mine, theirs in zip(train + test, read(plain["train"]) + read(plain["test"])):
        assert mine["answer"] == theirs["answer"]                         # the same person at every row
    later = {r["question"].split(" where ")[-1].removesuffix(" works?") for r in train[10:] + test
             if r["type"] == "three_hop"} | {r["bridge"] for r in train[10:] + test if "bridge" in r}
    assert not any(name in json.dumps(r) for r in train[:10] for name in later)
    search = search_mod.make_search("bm25", corpus_path=task["corpus"], cache=tmp_path / "cache", topk=1)
    for r in [r for r in train + test if r["type"] == "three_hop"]:
        employee = r["question"].split(" where ")[-1].removesuffix(" works?")
        results = search.search([*r["query"], r["question"]])
        assert r["answer"][0] in results[2] and r["answer"][0] not in results[3], r
        assert employee in results[3] and employee in results[0]          # the question finds the employee's page
        assert f"Its director is {r['bridge']}." in results[1]
    rows = [{"question": r["question"], "golds": r["answer"], "meta": r} for r in train[:10]]
    for row, demo in zip(rows, coldstart.build_demonstrations(rows, search)):
        hops = build_lookup.SEARCHES[row["meta"]["type"]]
        assert [m["role"] for m in demo["messages"]].count("tool") == hops
        assert row["golds"][0] in demo["messages"][-2]["content"]


def test_committed_lookup_task_is_what_the_generator_writes(tmp_path):
    """data/lookup/ (configs/learn.yaml) is build_lookup.py's output at its defaults, byte for byte."""
    made = build_lookup.make_task(tmp_path / "lookup")
    for key, path in made.items():
        assert Path(path).read_bytes() == (ROOT / "data" / "lookup" / Path(path).name).read_bytes(), key


def test_two_hop_rows_make_two_search_demonstrations(tmp_path):
    from harness.run import coldstart
    task = build_lookup.make_task(tmp_path / "t", n_train=2, n_test=2, n_cold=4, two_hop_demos=2)
    rows = [{"question": r["question"], "golds": r["answer"], "meta": r} for r in read(task["train"])[:4]]
    search = search_mod.make_search("bm25", corpus_path=task["corpus"], cache=tmp_path / "cache", topk=1)
    demos = coldstart.build_demonstrations(rows, search)
    assert len(demos) == 4
    for row, demo in zip(rows, demos):
        roles = [m["role"] for m in demo["messages"]]
        hops = 2 if row["meta"]["type"] == "two_hop" else 1
        assert roles == ["system", "user"] + ["assistant", "tool"] * hops + ["assistant"]
        calls = [m["content"] for m in demo["messages"] if m["role"] == "assistant"][:-1]
        queries = row["meta"]["query"] if hops == 2 else [row["meta"]["query"]]
        assert all(f"<search> {q} </search>" in c for q, c in zip(queries, calls))
        assert row["golds"][0] in demo["messages"][-2]["content"]                 # the last result holds the answer
        assert f"\\boxed{{{row['golds'][0]}}}" in demo["messages"][-1]["content"]
    bad = [dict(rows[1], meta={**rows[1]["meta"], "query": ["a firm director", ""]})]
    with pytest.raises(Exception, match="a list of queries"):
        coldstart.build_demonstrations(bad, search)
def traj(group, tid, parent=None):
    return rollout.Trajectory(group_id=group, traj_id=tid, prompt_ids=[1, 2], response_ids=[3, 4, 5],
                              loss_mask=[1, 1, 1], parent=parent, fork_offset=1 if parent is not None else 0)


def test_tree_stats_branch_concentration():
    # question 0: globals 0, 1; branches 2 <- 0, 3 <- 2 (both on chain 0), 4 <- 1  -> top chain 2/3
    # question 1: no branch (left out of the share);  question 2: one branch -> 1.0
    groups = [[traj(0, 0), traj(0, 1), traj(0, 2, 0), traj(0, 3, 2), traj(0, 4, 1)],
              [traj(1, 0), traj(1, 1)],
              [traj(2, 0), traj(2, 1, 0)]]
    stats = rollout.tree_stats([t for group in groups for t in group], [2, 2, 1], {}, 1)
    assert stats["trees_branched"] == 2 and stats["questions"] == 3
    assert stats["branch_top_chain"] == pytest.approx(2 / 3 + 1.0)       # a sum over the branched trees
    assert stats["branches"] == 4


def fake_run(run_dir: Path, rewards, before=None, after=0.5, branches=1.0, step4=None, argv=None):
    (run_dir / "eval").mkdir(parents=True)
    rows = [{"step": i + 1, "reward": r, "entropy": 0.5 + 0.01 * i, "clip_hi": 0.01, "clip_lo": 0.002,
             "grad_kept": 0.01, "grad_dropped": 0.003, "branches": branches if i else 0.0, "tool_calls": 1.2,
             "diversity/answers": 0.5, "diversity/tokens": 0.25 + 0.1 * i, "diversity/tool_seqs": 1.0,
             "tools/search/calls": 10.0, "time/step": 30.0, "probe_entropy": 0.6 - 0.02 * i}
            for i, r in enumerate(rewards)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, v in (("before", before), ("after", after), ("step4", step4)):
        if v is not None:
            (run_dir / "eval" / f"{name}_summary.json").write_text(
                json.dumps({"pass@1": v, "pass@4": min(1.0, 2 * v), "f1": v, "tool_calls": 1.1, "wall_s": 60.0,
                            "format_valid": 0.5 if name == "before" else 1.0}))
            correct = round(20 * v)                 # 10 questions x 2 samples, the first `correct` samples right
            (run_dir / "eval" / f"{name}_results.jsonl").write_text("".join(      # the start: one sample in format
                json.dumps({"index": i, "n": 2, "num_correct": min(2, max(0, correct - 2 * i)),
                            "samples": [{"format_valid": True}, {"format_valid": name != "before"}]}) + "\n"
                for i in reversed(range(10))))
    if argv is not None:
        (run_dir.parent.parent / "logs").mkdir(exist_ok=True)
        (run_dir.parent.parent / "logs" / f"{run_dir.name}.argv.json").write_text(json.dumps(argv))


def test_compare_report_aggregates_every_seed(tmp_path):
    args = compare_algorithms.main_parser().parse_args(
        ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--seeds", "0,1", "--eval_n", "4",
         "--steps", "8", "--eval_every", "4", "--backend", "transformers"])
    task = build_lookup.make_task(tmp_path / "work" / "task", n_train=4, n_test=2, n_cold=2, two_hop_demos=1)
    after = {("grpo", 0): 0.2, ("grpo", 1): 0.4, ("aepo", 0): 0.5, ("aepo", 1): 0.1,
             ("aepo-shortcold", 0): 0.0, ("aepo-shortcold", 1): 0.0}
    for (algo, seed), v in after.items():
        fake_run(tmp_path / "work" / "runs" / f"{algo}-s{seed}", [0.0, 0.5, 1.0, 1.0, 0.0, 0.5, 1.0, 1.0],
                 before=0.25 if algo == "grpo" else None, after=v, step4=v / 2,
                 argv=compare_algorithms.train_argv(algo, seed, task, args))
    res = compare_algorithms.report(args, ["grpo", "aepo", "aepo-shortcold"], [0, 1], tmp_path / "out")
    grpo, aepo = res["algos"]["grpo"], res["algos"]["aepo"]
    assert grpo["mean_sd"]["pass@1"] == pytest.approx((0.3, math.sqrt(0.02)))
    assert aepo["mean_sd"]["pass@1"] == pytest.approx((0.3, math.sqrt(0.08)))
    assert aepo["per_seed"][1]["pass@4"] == pytest.approx(0.2)
    assert grpo["mean_sd"]["train_reward_2nd_half"][0] == pytest.approx(0.625)    # steps 5-8
    assert grpo["mean_sd"]["diversity_tokens"][0] == pytest.approx(0.25 + 0.1 * 3.5)
    assert res["before"][0]["pass@1"] == 0.25
    # the settings as the runs got them (--config's where no flag was given); time: 8 steps x 30 s a run, and one
    # minute an evaluation (GRPO's runs three: before, step 4, after; the others two)
    assert res["settings"]["steps"] == 8 and res["settings"]["k"] == parse_config(["--config", "configs/learn.yaml"]).k
    assert res["minutes"] == {"train": pytest.approx(6 * 4.0), "eval": pytest.approx(2 * 3 + 4 * 2)}
    assert grpo["per_seed"][0]["eval_min"] == pytest.approx(3.0)
    assert grpo["per_seed"][0]["probe_change"] == pytest.approx(-0.02 * 7)     # step 8's probe less step 1's
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| AEPO | 0.300 ± 0.283 [0.500, 0.100]" in md
    assert "| 0.600 ± 0.000 → 0.460 ± 0.000 (-0.140 ± 0.000 [-0.140, -0.140]) |" in md
    for key, _ in compare_algorithms.MECHANISMS:
        assert (tmp_path / "out" / f"{key}.png").stat().st_size > 5_000, key
    run = compare_algorithms.load_run(tmp_path / "work" / "runs" / "aepo-s0")
    assert compare_algorithms.pass1_curve(run, 8, 4) == [(4, 0.25), (8, 0.5)]
    run = compare_algorithms.load_run(tmp_path / "work" / "runs" / "grpo-s0")
    assert compare_algorithms.pass1_curve(run, 8, 4)[0] == (0, 0.25)            # the curve starts at the start
    assert "--seed=0" in res["train_commands"]["aepo"] and "configs/aepo.yaml" in res["train_commands"]["aepo"]
    assert aepo["questions"] == 10 and aepo["pass@1"][0] == pytest.approx(0.3)
    assert aepo["pass@1"][1] < 0.3 < aepo["pass@1"][2]
    assert grpo["aepo_minus"][0] == pytest.approx(0.0) and "aepo_minus" not in aepo
    assert res["start_format_valid"][0] == pytest.approx(0.5) and aepo["format_gain"][0] == pytest.approx(0.5)
    assert "| 1.000 [1.000, 1.000] | 0.500 [0.500, 0.500] |" in md
    short = res["algos"]["aepo-shortcold"]                       # its own cold start: no gain over the shared one
    assert "gain" not in short and "format_gain" not in short and short["aepo_minus"][0] == pytest.approx(0.3)
    assert "| AEPO, 2 cold-start steps | – | 0.000 [0.000, 0.000] | – |" in md
    assert aepo["gain"][0] == pytest.approx(0.3 - 0.25) and res["start_pass@1"][0] == pytest.approx(0.25)
    row = next(line for line in md.splitlines() if line.startswith("| AEPO | 0.250 ["))
    assert "| 0.300 [" in row and "| – | 1.000 [" in row            # AEPO has no AEPO − AEPO


def typed_run(run_dir: Path, correct_after: list[int], before: list[int] | None, informative: float, branches: float,
              three_hop_searches: int = 3):
    """A finished run over 6 held-out questions (lookup, two_hop, three_hop, twice) x 2 samples: `correct_after[i]`
    samples right on question i, each sample searching as often as its type needs (three-hop: `three_hop_searches`);
    4 steps, each with one question of every type, `informative` of the two-hop groups with unequal rewards,
    `branches` branches per two-hop question."""
    kinds = ["lookup", "two_hop", "three_hop"] * 2
    (run_dir / "eval").mkdir(parents=True)
    metrics = [{"step": i + 1, "reward": 0.5, "entropy": 0.5, "clip_hi": 0.0, "clip_lo": 0.0, "grad_kept": 0.01,
                "grad_dropped": 0.0, "branches": branches, "branch_top_chain": 0.75, "tool_calls": 2.0,
                "diversity/answers": 0.5, "diversity/tokens": 0.5, "diversity/tool_seqs": 0.5,
                "tools/search/calls": 8.0, "time/step": 30.0, "probe_entropy": 0.6,
                **{f"type/{t}/{key}": v for t in ("lookup", "two_hop", "three_hop") for key, v in
                   (("questions", 1), ("frac_reward_zero_std", 1 - informative if t == "two_hop" else 1.0),
                    ("branches", branches if t == "two_hop" else 0.0), ("m", 4.0 if t == "two_hop" else 8.0))}}
               for i in range(4)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    for name, correct in (("after", correct_after), ("before", before)):
        if correct is None:
            continue
        rows = [{"index": i, "n": 2, "num_correct": c, "meta": {"type": kinds[i]},
                 "samples": [{"correct": j < c, "format_valid": True,
                              "tool_calls": [["search", "q"]] * (three_hop_searches if kinds[i] == "three_hop"
                                                                  else build_lookup.SEARCHES[kinds[i]])}
                             for j in range(2)]}
                for i, c in enumerate(correct)]
        (run_dir / "eval" / f"{name}_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        p1 = sum(correct) / 12
        (run_dir / "eval" / f"{name}_summary.json").write_text(json.dumps(
            {"pass@1": p1, "pass@2": p1, "tool_calls": 2.0, "format_valid": 1.0}))


def test_compare_report_by_question_type_and_mechanisms(tmp_path):
    """after − start and AEPO − method per question type (the same seeds and questions), and the mechanism table:
    informative groups per step and their share, branches and m per question by type, held-out searches per correct
    answer."""
    args = compare_algorithms.main_parser().parse_args(["--work", str(tmp_path / "work"), "--out", str(tmp_path / "o"),
                                                        "--seeds", "0,1", "--backend", "transformers"])
    start = [1, 0, 0, 1, 0, 0]                                  # lookups only, in both seeds
    after = {"grpo": [2, 1, 0, 2, 1, 0], "arpo": [2, 2, 0, 2, 2, 0], "aepo": [2, 2, 1, 2, 2, 1]}
    for a, correct in after.items():
        for seed in (0, 1):
            typed_run(tmp_path / "work" / "runs" / f"{a}-s{seed}", correct, start if a == "grpo" else None,
                      informative={"grpo": 0.25, "arpo": 0.5, "aepo": 0.75}[a], branches=0.0 if a == "grpo" else 2.0,
                      three_hop_searches=2 if (a, seed) == ("arpo", 1) else 3)      # one run stops a search short
            (tmp_path / "work" / "logs").mkdir(exist_ok=True)
            (tmp_path / "work" / "logs" / f"{a}-s{seed}.argv.json").write_text(json.dumps(
                compare_algorithms.train_argv(a, seed, {"train": "t", "test": "e", "corpus": "c"}, args)))
    res = compare_algorithms.report(args, ["grpo", "arpo", "aepo"], [0, 1], tmp_path / "o")
    assert res["types"] == {"lookup": 2, "two_hop": 2, "three_hop": 2}
    grpo, aepo = res["algos"]["grpo"]["by_type"], res["algos"]["aepo"]["by_type"]
    assert grpo["two_hop"]["gain"][0] == pytest.approx(0.5) and aepo["three_hop"]["gain"][0] == pytest.approx(0.5)
    assert grpo["lookup"]["gain"][0] == pytest.approx(0.5) and res["start_by_type"]["two_hop"][0] == 0.0
    assert grpo["two_hop"]["aepo_minus"][0] == pytest.approx(0.5) and grpo["three_hop"]["aepo_minus"][0] == 0.5
    assert res["algos"]["arpo"]["by_type"]["lookup"]["aepo_minus"] == (0.0, 0.0, 0.0)
    mech = {a: res["algos"][a]["mean_sd"] for a in after}
    assert mech["aepo"]["informative/two_hop"][0] == pytest.approx(0.75)     # one two-hop question a step
    assert mech["grpo"]["informative_share/two_hop"][0] == pytest.approx(0.25)
    assert mech["aepo"]["informative/lookup"][0] == 0.0
    assert mech["arpo"]["branches/two_hop"][0] == 2.0 and mech["arpo"]["branches/lookup"][0] == 0.0
    assert mech["aepo"]["m/two_hop"][0] == 4.0 and mech["aepo"]["top_chain"][0] == 0.75
    assert "top_chain" not in mech["grpo"]                                   # no branches: no share
    # held-out searches per correct answer: GRPO 6 right of 12 samples, 2 x (1 + 2 + 3) x 2 = 24 searches
    assert mech["grpo"]["searches_per_correct/all"][0] == pytest.approx(24 / 6)
    assert mech["aepo"]["searches_per_correct/three_hop"][0] == pytest.approx(12 / 2)
    assert "searches_per_correct/three_hop" not in mech["grpo"]               # none right: no such number
    # held-out searches per sample and the share that searched as often as the type needs
    assert mech["grpo"]["searches/three_hop"] == (3.0, 0.0) and mech["grpo"]["as_needed/two_hop"] == (1.0, 0.0)
    assert mech["arpo"]["searches/three_hop"] == pytest.approx((2.5, math.sqrt(0.5)))
    assert mech["arpo"]["as_needed/three_hop"] == pytest.approx((0.5, math.sqrt(0.5)))
    assert mech["arpo"]["as_needed/lookup"] == (1.0, 0.0)
    md = (tmp_path / "o" / "results.md").read_text()
    assert "| GRPO | two_hop | 0.000 [0.000, 0.000] | 0.500 [0.500, 0.500] | 0.500 [0.500, 0.500] | 0.500 [" in md
    assert "| informative groups / step (lookup / two_hop / three_hop) |" in md
    assert ("| AEPO | 0.00 ± 0.00 / 0.75 ± 0.00 / 0.00 ± 0.00 | 0.00 ± 0.00 / 0.75 ± 0.00 / 0.00 ± 0.00 | "
            "0.00 ± 0.00 / 2.00 ± 0.00 / 0.00 ± 0.00 | 8.0 ± 0.0 / 4.0 ± 0.0 / 8.0 ± 0.0 | 0.75 ± 0.00 | "
            "0.0100 ± 0.0000 / 0.0000 ± 0.0000 | 0.000 ± 0.000 | 2.40 ± 0.00 (1.00 ± 0.00 / 2.00 ± 0.00 / 6.00 ± 0.00) | "
            "1.00 ± 0.00 / 2.00 ± 0.00 / 3.00 ± 0.00 | 1.00 ± 0.00 / 1.00 ± 0.00 / 1.00 ± 0.00 |" in md.splitlines())


def test_interval_resamples_seeds_and_questions():
    """The bootstrap's interval: none for a constant, the seeds' spread counted (two seeds 0.2 apart on every
    question give a wider interval than the same spread within each seed), near the normal one for many questions."""
    interval = compare_algorithms.interval
    assert interval(np.full((3, 50), 0.4)) == (pytest.approx(0.4), pytest.approx(0.4), pytest.approx(0.4))
    between = np.array([[0.3] * 40, [0.5] * 40])
    within = np.array([[0.3, 0.5] * 20, [0.3, 0.5] * 20])
    assert interval(between)[0] == pytest.approx(0.4) == interval(within)[0]
    assert interval(between)[2] - interval(between)[1] > 2 * (interval(within)[2] - interval(within)[1])
    rng = np.random.default_rng(1)
    one = rng.binomial(1, 0.3, (1, 2000)).astype(float)
    mean, lo, hi = interval(one)
    half = 1.96 * one.std() / np.sqrt(one.size)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1) and lo < mean < hi


def test_compare_report_names_a_missing_run(tmp_path):
    args = compare_algorithms.main_parser().parse_args(["--work", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(FileNotFoundError, match="grpo-s0"):
        compare_algorithms.report(args, ["grpo"], [0], tmp_path / "o")


def test_compare_methods_chooses_among_only(tmp_path):
    parse = compare_algorithms.main_parser().parse_args
    assert compare_algorithms.chosen_reports(parse(["--out", str(tmp_path)])) == {
        "algorithms": (["grpo", "arpo", "aepo"], tmp_path)}                  # the default: GRPO, ARPO, AEPO
    everything = compare_algorithms.chosen_reports(parse(["--out", str(tmp_path), "--only", "all"]))
    assert everything["experiments"] == (["grpo", "aepo", *compare_algorithms.EXPERIMENTS], tmp_path / "experiments")
    assert compare_algorithms.chosen_reports(parse(["--out", str(tmp_path), "--methods", "dapo,grpo,aepo"])) == {
        "algorithms": (["grpo", "dapo", "aepo"], tmp_path)}                  # any of the eight, in the table's order
    some = compare_algorithms.chosen_reports(parse(["--out", str(tmp_path), "--only", "experiments",
                                                    "--methods", "aepo-norollout,grpo"]))
    assert some == {"experiments": (["grpo", "aepo-norollout"], tmp_path / "experiments")}     # in the table's order
    assert list(compare_algorithms.chosen_reports(parse(["--methods", "arpo"]))) == ["algorithms"]
    with pytest.raises(ValueError, match="aepo-nosg not among --only algorithms's"):
        compare_algorithms.chosen_reports(parse(["--only", "algorithms", "--methods", "aepo,aepo-nosg"]))


def test_every_algorithm_and_experiment_has_its_config(tmp_path):
    """Each compared algorithm is a configs/<name>.yaml overlay that parses; each entropy-fall experiment is AEPO
    with one flag changed."""
    from harness import config
    args = compare_algorithms.main_parser().parse_args(["--work", str(tmp_path), "--backend", "transformers"])
    task = {"train": "t", "test": "e", "corpus": "c"}
    for name in [*compare_algorithms.ALGOS, *compare_algorithms.EXPERIMENTS]:
        argv = compare_algorithms.train_argv(name, 0, task, args)
        cfg = config.parse_config(argv[1:])
        assert cfg.seed == 0 and cfg.backend == "transformers", name
        assert cfg.max_tool_calls == 3, name                  # a three-hop question's searches, learn.yaml allows 2
    aepo = config.parse_config(compare_algorithms.train_argv("aepo", 0, task, args)[1:])
    parse = compare_algorithms.main_parser().parse_args
    two_hop = parse(["--work", str(tmp_path), "--three_hop_every", "0"])
    assert config.parse_config(compare_algorithms.train_argv("aepo", 0, task, two_hop)[1:]).max_tool_calls == \
        config.parse_config(["--config", "configs/learn.yaml"]).max_tool_calls
    given = parse(["--work", str(tmp_path), "--max_tool_calls", "5"])
    assert config.parse_config(compare_algorithms.train_argv("aepo", 0, task, given)[1:]).max_tool_calls == 5
    for name, flags in compare_algorithms.EXPERIMENTS.items():
        cfg = config.parse_config(compare_algorithms.train_argv(name, 0, task, args)[1:])
        differ = {f for f in config.Config.__dataclass_fields__ if getattr(cfg, f) != getattr(aepo, f)}
        assert differ == {"run_name", flags[0].split("=")[0][2:]}, (name, differ)


def test_compare_refuses_a_finished_run_with_other_settings(tmp_path):
    args = compare_algorithms.main_parser().parse_args(["--work", str(tmp_path), "--steps", "3"])
    task = {"train": "t", "test": "e", "corpus": "c"}
    fake_run(tmp_path / "runs" / "grpo-s0", [0.0], before=0.1)
    (tmp_path / "logs").mkdir(exist_ok=True)
    argv = compare_algorithms.train_argv("grpo", 0, task, args)
    (tmp_path / "logs" / "grpo-s0.argv.json").write_text(json.dumps(argv))
    assert "reused" in compare_algorithms.run_one("grpo", 0, task, args)        # same settings: not run again
    args.steps = 4
    with pytest.raises(RuntimeError, match="other settings"):
        compare_algorithms.run_one("grpo", 0, task, args)


# ---------------------------------------------------------------------------------------------------------------------
# bench/memory_sim.py: the paper's setting's memory, simulated with fake tensors over 8 fake ranks

import re  # noqa: E402

import torch  # noqa: E402

MEMSIM_ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False)


def test_memory_sim_holds_rank_zeros_fsdp2_shards():
    """Over 8 fake ranks rank 0 holds its row-shard of every parameter (ceil(rows / 8), as FSDP2 pads), counted from
    the model's parameter shapes: at the update's peak 4 B of float32 master weight and 4 B of gradient per element,
    after the step 4 B + 8 B of AdamW state (what the trainer keeps beside vLLM); the weight sync, gathered in
    bfloat16 (vLLM's dtype), adds one full parameter and its shard in bfloat16 (float32 would be 4 B + 2 B for the
    cast: three times the peak)."""
    import memory_sim
    from transformers import AutoModelForCausalLM, Qwen3Config
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(Qwen3Config(**MEMSIM_ARCH))
    shard = sum(math.ceil(p.shape[0] / 8) * p[0].numel() for p in lm.parameters())
    largest = max(lm.parameters(), key=lambda p: p.numel())
    setting = memory_sim.Setting(world=8, batch=2, prompt=32, response=96, trajectories=4, chunk=32)
    peaks = memory_sim.simulate("qwen3", MEMSIM_ARCH, setting)
    at_peak = peaks["update:categories"]
    assert at_peak["Sharded Param"] == 4 * shard and at_peak["Sharded Grad"] == 4 * shard
    assert peaks["resident"] - at_peak["Inputs"] == pytest.approx(12 * shard, rel=1e-3)   # + AdamW's step counters
    largest_shard = math.ceil(largest.shape[0] / 8) * largest[0].numel()
    assert peaks["weight sync"] - peaks["resident"] == pytest.approx(2 * largest.numel() + 2 * largest_shard, rel=1e-3)
    assert peaks["params"] == sum(p.numel() for p in lm.parameters()) and peaks["largest"] == largest.numel()


def test_memory_sim_lora_holds_a_bfloat16_base_and_float32_adapters():
    """With LoRA on one rank: 2 B per base element (frozen, bfloat16: no gradient, no AdamW state), 4 B per adapter
    element and 4 B of its gradient at the update's peak, 12 B per adapter element after the step (the adapters and
    their two moments; the gradient freed) beside the base, whose root-module part (embeddings, head, final norm) FSDP2
    leaves gathered (a frozen parameter has no post-backward hook to reshard it); the sync sends the adapters
    alone."""
    import memory_sim
    from harness import lora
    from transformers import AutoModelForCausalLM, Qwen3Config
    with torch.device("meta"):
        lm = lora.add_adapters(AutoModelForCausalLM.from_config(Qwen3Config(**MEMSIM_ARCH)), lora.LoraSettings(8))
    base = sum(p.numel() for p in lm.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    largest_adapter = max(p.numel() for p in lm.parameters() if p.requires_grad)
    setting = memory_sim.Setting(world=1, batch=2, prompt=32, response=96, trajectories=4, chunk=32,
                                 lora=lora.LoraSettings(8))
    peaks = memory_sim.simulate("qwen3", MEMSIM_ARCH, setting)
    at_peak = peaks["update:categories"]
    assert (peaks["params"], peaks["trained"]) == (base + adapters, adapters)
    assert at_peak["Sharded Param"] == 2 * base + 4 * adapters and at_peak["Sharded Grad"] == 4 * adapters
    root = sum(p.numel() for n, p in lm.named_parameters() if ".layers." not in n)
    assert peaks["resident"] - at_peak["Inputs"] == pytest.approx(2 * base + 12 * adapters + 2 * root, rel=1e-3)
    assert peaks["weight sync"] - peaks["resident"] <= 6 * largest_adapter


def test_memory_sim_attention_has_no_score_matrix():
    """Every tensor of a step is linear in the sequence length L (FlashAttention-2's allocations), so 4x the tokens
    cost at most 4x the peak; with a (B, H, L, L) score matrix (transformers' eager attention: 8.2x and 5.9x) not."""
    import memory_sim
    short, long = (memory_sim.simulate("qwen3", MEMSIM_ARCH, memory_sim.Setting(
        world=8, batch=2, prompt=length // 4, response=3 * length // 4, trajectories=2, chunk=64))
        for length in (512, 2048))
    for phase in ("old-policy pass", "update"):
        assert 2 * short[phase] < long[phase] <= 4 * short[phase], phase


def test_memory_sim_counts_no_dtensor_shape_propagation():
    """Under fake tensors DTensor infers the optimiser step's output shapes on global-shape fake tensors in the same
    fake mode; memory_sim.Tracker leaves them out. Counted, they put the whole model in float32 at global shape
    (32 B per element of rank 0's shard) at the step; the real peak here, 8 thin layers, stays below that."""
    import memory_sim
    from transformers import AutoModelForCausalLM, Qwen3Config
    arch = {**MEMSIM_ARCH, "num_hidden_layers": 8, "vocab_size": 64}
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(Qwen3Config(**arch))
    shard = sum(math.ceil(p.shape[0] / 8) * p[0].numel() for p in lm.parameters())
    peaks = memory_sim.simulate("qwen3", arch, memory_sim.Setting(world=8, batch=1, prompt=4, response=12,
                                                                  trajectories=1, chunk=32))
    assert 16 * shard < peaks["update"] < 32 * shard              # params + grads + AdamW state, no global copies


def test_static_select_policy_is_policy_forward():
    """memory_sim.StaticSelectPolicy (mask-1 positions as indices, for fake tensors) computes what Policy.forward
    computes from the mask: the same log-probs and entropies, and the same gradients."""
    import memory_sim
    from harness.run.policy import Policy
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(Qwen3Config(**MEMSIM_ARCH, attn_implementation="sdpa"))
    ids = torch.randint(0, 512, (2, 24))
    mask = torch.zeros(2, 23)
    mask[0, 5:20], mask[1, 9:23] = 1, 1
    outputs = []
    for policy, selection in ((Policy(lm), mask), (memory_sim.StaticSelectPolicy(lm), mask.nonzero(as_tuple=True))):
        lm.zero_grad()
        logp, entropy = policy(ids, torch.ones_like(ids), selection, 0.8, 7)
        (logp.sum() + entropy.sum()).backward()
        outputs.append((logp, entropy, lm.lm_head.weight.grad.clone(), lm.model.embed_tokens.weight.grad.clone()))
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b)


def test_gpu_check_memory_step_on_the_cpu():
    """gpu_check's memory step, CPU side: bench/memory_sim.py --check cpu --quick in a subprocess, the simulation of
    gpu_check's --quick model against the tracker over real tensors, every phase's ratio 1 within 1%."""
    import gpu_check
    [(name, detail, result)] = gpu_check.run_memory_check("cpu", gpu_check.TINY, quick=True)
    assert result == "PASS", detail
    ratios = [float(r) for r in re.findall(r"ratio ([\d.]+)", detail)]
    assert len(ratios) == 4 and all(r == pytest.approx(1.0, abs=0.01) for r in ratios), detail


def test_machine_limit_counts_the_positions_the_passes_compute(tmp_path):
    """bench/machine_limit.py's FLOPs: the micro-batches rebuilt from trees.jsonl as the trainer builds them, padding
    and the attention square included, one step apart from the next."""
    import types
    import machine_limit
    cfg = types.SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                intermediate_size=16, vocab_size=100, num_hidden_layers=3)
    layer, head = machine_limit.model_shapes(cfg)
    assert layer == [(8, 8), (8, 4), (8, 4), (8, 8), (8, 16), (8, 16), (16, 8)] and head == (8, 100)
    # step 1: two questions (one mini-batch of 2) with prompts of 10 and 20 tokens; step 2: one short question
    recs = [{"step": 1, "prompt_tokens": 10, "trajectories": [{"length": 5}, {"length": 30}]},
            {"step": 1, "prompt_tokens": 20, "trajectories": [{"length": 1}]},
            {"step": 2, "prompt_tokens": 4, "trajectories": [{"length": 2}, {"length": 2}]}]
    (tmp_path / "trees.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fixed = machine_limit.step_flops(tmp_path, {"mini_batch_size": 2, "micro_batch_size": 2,
                                                "max_tokens_per_micro_batch": 0}, cfg)
    weights = 3 * (64 + 32 + 32 + 64 + 128 + 128 + 128)
    # step 1 in order: [15, 40] -> 2 x 40, [21] -> 21; step 2: [6, 6] -> 12
    assert fixed[1][2] == 2 * 40 + 21 and fixed[2][2] == 12
    assert fixed[1][0] == 2 * weights * (2 * 40 + 21)
    assert fixed[1][1] == 4 * 3 * 2 * 4 * (2 * 40 ** 2 + 21 ** 2)
    budget = machine_limit.step_flops(tmp_path, {"mini_batch_size": 2, "micro_batch_size": 2,
                                                 "max_tokens_per_micro_batch": 45}, cfg)
    # length-sorted within the budget: [15, 21] -> 2 x 21, [40] -> 40
    assert budget[1][2] == 2 * 21 + 40


@pytest.mark.parametrize("script", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "bench").glob("*.py")))
def test_bench_scripts_name_only_what_the_project_has(script):
    """A benchmark runs for minutes before it reaches its report: every `module.name` it reads from a project module
    (`from harness import config`, `import train`, ...) must exist, or it fails at the end (a moved function did)."""
    import ast
    import importlib
    import types
    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "bench" / script).read_text())
    aliases, missing = {}, []                     # local name -> project module; names not found
    project = {p.stem for p in root.glob("*.py")} | {"harness"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name.split(".")[0] in project
                            and "." not in (a.asname or a.name)})
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in project:
            module = importlib.import_module(node.module)
            for a in node.names:
                if not hasattr(module, a.name):
                    try:                          # a submodule not imported yet
                        importlib.import_module(f"{node.module}.{a.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{node.module}.{a.name} (line {node.lineno})")
                        continue
                if isinstance(getattr(module, a.name, None), types.ModuleType) or not hasattr(module, a.name):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    missing += [f"{aliases[n.value.id]}.{n.attr} (line {n.lineno})" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
                and not hasattr(importlib.import_module(aliases[n.value.id]), n.attr)]
    assert not missing, f"bench/{script} reads names the project does not have: {missing}"
