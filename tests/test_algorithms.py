"""Every compared algorithm (configs/<name>.yaml, algorithm.md §7) reaches its own objective and advantage in the
training loop: one real step of train.main on the tiny model, with spies on the functions of loss.py and advantage.py
that record how the loop called them. The functions' values and gradients are tested in test_loss.py and
test_advantage.py; here, that the switches are read (a config whose switch the loop ignored would train another
algorithm under its name)."""
import dataclasses
import json
from pathlib import Path

import pytest

import advantage
import loss
import train
from tests.conftest import flags
from tests.fakes import SearchFirst, fake_score

ROOT = Path(__file__).resolve().parents[1]
SPIED = ("group_advantages", "entropy_weighted_advantages", "reinforce_pp_returns", "reinforce_pp_advantages",
         "dynamic_sampling_mask", "overlong_penalty", "gigpo_advantages")


@pytest.fixture
def calls(monkeypatch):
    """name -> list of (args, kwargs) of every spied call (the real function still runs)."""
    record = {name: [] for name in (*SPIED, "policy_loss")}

    def spy(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            record[name].append((args, kwargs))
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)
    for name in SPIED:
        spy(advantage, name)
    spy(loss, "policy_loss")
    return record


def run(setup, name, **over):
    argv = flags(setup, f"algo_{name}", config=str(ROOT / "configs" / f"{name}.yaml"), steps=1, k=4,
                 max_response_tokens=64, micro_batch_size=8, **over)
    run_dir = Path(train.main(argv, score=fake_score, make_generator=SearchFirst.factory())["run_dir"])
    return [json.loads(line) for line in (run_dir / "trees.jsonl").read_text().splitlines()]


def loss_kw(calls) -> dict:
    """The settings (loss.LossSettings, as a dict) every policy_loss call of the step got: the same for all."""
    kws = [dataclasses.asdict(args[5]) for args, _ in calls["policy_loss"]]
    assert kws and all(kw == kws[0] for kw in kws)
    return kws[0]


def test_grpo(setup, calls):
    trees = run(setup, "grpo")
    kw = loss_kw(calls)
    assert (kw["surrogate"], kw["sg_clip"]) == ("aepo", False)              # the PPO clip
    assert calls["group_advantages"][0][1]["std_norm"] is True and not calls["entropy_weighted_advantages"]
    assert all(t["kind"] == "global" for tree in trees for t in tree["trajectories"])          # k independent


def test_reinforce_pp(setup, calls):
    run(setup, "reinforce_pp")
    (rewards, mask, old_logp, ref_logp), kw = calls["reinforce_pp_returns"][0]
    assert kw["beta"] == 0.01 and old_logp is not None and ref_logp is not None      # the KL goes into the reward
    assert calls["reinforce_pp_advantages"] and loss_kw(calls)["kl_coef"] == 0.0       # ... and not into the loss
    advantages = calls["policy_loss"][0][0][2]
    assert advantages.shape == mask.shape                                             # per token, batch-normalised


def test_dapo(setup, calls):
    trees = run(setup, "dapo")
    kw = loss_kw(calls)
    assert (kw["eps_high"], kw["sg_clip"], kw["loss_agg"]) == (0.28, False, "token-mean")
    (lengths, max_len, cache_len), _ = calls["overlong_penalty"][0]
    assert (max_len, cache_len) == (64, 51)
    rewards, groups = calls["dynamic_sampling_mask"][0][0]
    assert len(set(groups.tolist())) == 4 and len(trees) == 2       # 2 x 2 questions rolled out, the 2 kept logged


def test_gppo(setup, calls):
    run(setup, "gppo")
    kw = loss_kw(calls)
    assert kw["surrogate"] == "gppo"


def test_cispo(setup, calls):
    run(setup, "cispo")
    kw = loss_kw(calls)
    assert (kw["surrogate"], kw["eps_low"], kw["eps_high"]) == ("cispo", 1.0, 0.28)


def test_gigpo(setup, calls):
    trees = run(setup, "gigpo", seed=3)
    args, kw = calls["gigpo_advantages"][0]
    assert kw.get("omega", 1.0) == 1.0                                              # GiGPO's ω = 1
    per_token = calls["policy_loss"][0][0][2]
    assert per_token.dim() == 2
    assert any(t["kind"] == "branch" for tree in trees for t in tree["trajectories"])    # shared states exist


def test_arpo(setup, calls):
    trees = run(setup, "arpo", seed=3)
    assert all(tree["m"] == 2 for tree in trees)                                # m = k // 2, no pre-monitor
    assert not calls["entropy_weighted_advantages"] and loss_kw(calls)["sg_clip"] is False


def test_aepo(setup, calls):
    trees = run(setup, "aepo", seed=3)
    assert calls["entropy_weighted_advantages"] and (loss_kw(calls)["surrogate"], loss_kw(calls)["sg_clip"]) == ("aepo", True)
    assert any(t["kind"] == "premonitor" for tree in trees for t in tree["trajectories"])


def test_dr_grpo(setup, calls):
    trees = run(setup, "dr_grpo")
    kw = loss_kw(calls)
    assert kw["loss_agg"] == "seq-mean-token-sum-norm" and kw["max_len"] == 64 and kw["sg_clip"] is False
    assert calls["group_advantages"][0][1]["std_norm"] is False and not calls["entropy_weighted_advantages"]
    assert all(t["kind"] == "global" for tree in trees for t in tree["trajectories"])
