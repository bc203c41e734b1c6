"""trees.py and bench/branch_concentration.py: a step's tree records round-trip (every trajectory of every question,
each branch's direct parent, branches of branches included, exactly k each, the spans and entropies of the segments),
a run writes all ranks' questions and the last step's drawing, the renderer draws a k = 16 tree, and the simulation's
numbers are exact for a fixed seed."""
import json
import sys
from pathlib import Path

import pytest

from harness import trees
from rollout import tree_rollout
from tests.conftest import flags, spawn, train_worker
from tests.fakes import TOK, EchoTools, ScriptedGenerator, prompts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import branch_concentration  # noqa: E402


@pytest.fixture(scope="module")
def k16():
    """Two questions, k = 16, three tool steps with rising entropies: global samples, branches, completions."""
    gen = ScriptedGenerator(n_tools=3, entropy=lambda s: [0.2, 1.5, 2.5, 3.0][s])
    trajs, stats = tree_rollout(prompts(2), gen, EchoTools(), TOK, k=16, seed=5)
    rows = [{"id": f"q:{i}", "question": f"question {i}?"} for i in range(2)]
    rewards = [0.1 * (t.traj_id % 7) - 0.2 for t in trajs]
    return trajs, stats, trees.records(3, rows, trajs, stats["m_per_question"], rewards)


def test_records_round_trip(k16, tmp_path):
    trajs, stats, recs = k16
    trees.append(tmp_path / "trees.jsonl", recs)
    back = trees.load(tmp_path / "trees.jsonl")
    assert back == json.loads(json.dumps(recs))
    by_id = {(t.group_id, t.traj_id): t for t in trajs}
    assert any(t.parent is not None and by_id[t.group_id, t.parent].parent is not None for t in trajs)  # nested
    for rec, m in zip(back, stats["m_per_question"]):
        ids = [t["id"] for t in rec["trajectories"]]
        assert rec["k"] == 16 and sorted(ids) == list(range(16)) and rec["m"] == m
        for t in rec["trajectories"]:
            assert t["parent"] is None or t["parent"] in ids and t["parent"] < t["id"]
            assert (t["parent"] is None) == (t["kind"] in ("premonitor", "global", "completion"))
    for t in trajs:                                                        # the shape of every trajectory
        rec = back[t.group_id]["trajectories"][t.traj_id]
        policy_tokens = [i for i, m in enumerate(t.loss_mask) if m]
        assert [i for a, b in rec["segments"] for i in range(a, b)] == policy_tokens
        assert rec["h_seg"] == pytest.approx(t.seg_entropies, abs=1e-4)
        assert rec["tools"] == [[tool, arg[:60]] for tool, arg in t.tool_calls]
        assert (rec["fork"], rec["length"], rec["finish"]) == (t.fork_offset, len(t.response_ids), t.finish_reason)
        assert (rec["parent"], rec["kind"], rec["round"], rec["l"]) == (t.parent, t.kind, t.round, t.l)  # direct parent


def test_a_run_records_every_ranks_questions_and_draws_the_last_step(setup):
    """2 ranks, 1 question each per step: trees.jsonl holds both ranks' questions, k trajectories each."""
    spawn(train_worker, flags(setup, "trees_two_ranks", parallel="fsdp", mini_batch_size=2, steps=2, k=3))
    run = setup / "runs" / "trees_two_ranks"
    recs = [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 1, 2, 2]
    assert all(r["k"] == 3 and len(r["trajectories"]) == 3 for r in recs)
    assert len({r["question_id"] for r in recs if r["step"] == 1}) == 2 and recs[0]["question_id"].startswith("qa:")
    assert (run / "trees.png").stat().st_size > 10_000


def test_the_renderer_draws_k16(k16, tmp_path):
    _, _, recs = k16
    out = trees.draw(recs, tmp_path / "k16.png", "k = 16")
    assert out.stat().st_size > 20_000
    run = tmp_path / "run"
    run.mkdir()
    trees.append(run / "trees.jsonl", recs)
    assert trees.main([str(run)]).name == "trees_step_3.png"
    with pytest.raises(ValueError, match="no trees of step 9"):
        trees.load(run / "trees.jsonl", 9)


def test_the_simulation_is_exact_for_a_seed():
    measured = {"h_root": [0.2, 0.5, 0.9], "h_post": [0.1, 0.6, 1.4, 2.0], "p_call": {"0": 0.9, "1": 0.3}}
    a = branch_concentration.simulate(measured, "deep", 12, "AEPO", 40, seed=3)
    assert a == branch_concentration.simulate(measured, "deep", 12, "AEPO", 40, seed=3)
    assert a != branch_concentration.simulate(measured, "deep", 12, "AEPO", 40, seed=4)
    arpo = branch_concentration.simulate(measured, "deep", 12, "ARPO", 40, seed=3)
    assert arpo["m_mean"] == 6 and a["questions"] == arpo["questions"] == 40       # ARPO: m = k / 2
    assert 0 < arpo["top1_share"] <= arpo["top3_share"] <= 1
