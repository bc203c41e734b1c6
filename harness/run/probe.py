"""The probe: a fixed set of trajectories on which the policy's own token entropy is measured at every step.

The sampled tokens' entropy (the step's `entropy` metric) moves with the questions each step draws and with what the
tree samples; the probe's is the same tokens teacher-forced by each step's policy (`probe_entropy` in metrics.jsonl,
docs/reference.md).
"""
from __future__ import annotations

import json

import torch

import rollout
import sampler
from harness.run.policy import tensorize, unwrap

QUESTIONS = 4                    # held-out questions the probe samples one trajectory each from


def record(run) -> list:
    """The probe: one trajectory from each of the first QUESTIONS held-out questions, sampled once by the
    starting policy at the rollout temperature and kept in <run>/probe.json (a resumed run reads it back), so that
    the policy's entropy is measured on the same tokens at every step (the sampled tokens' entropy moves with the
    questions each step draws and with what the tree samples)."""
    cfg, path = run.cfg, run.dir / "probe.json"
    if not run.eval_rows:
        return []
    if path.exists():
        return [tuple(item) for item in json.loads(path.read_text())]
    rows = run.eval_rows[:QUESTIONS]
    with torch.no_grad(), run.amp():
        trajectories, _ = rollout.tree_rollout(
            [run.tools.format.build_prompt(run.tokenizer, r["question"]) for r in rows], run.generator, run.tools,
            run.tokenizer, run.tree_settings, sampling=run.sampling, seed=sampler.request_seed(cfg.seed, "probe"), k=1,
            entropy_branching=False)
    probe = [(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajectories if sum(t.loss_mask)]
    if run.master:
        path.write_text(json.dumps(probe))
    return probe


@torch.no_grad()
def entropy(run, probe: list) -> float:
    """The current policy's mean token entropy H_t (algorithm.md §1) over the probe's policy tokens, teacher-forced
    (every rank computes it: a collective under FSDP2)."""
    unwrap(run.policy).eval()
    batch = tensorize(probe, run.tokenizer.pad_token_id, run.device)
    with run.amp():
        _, h = run.policy(batch.input_ids, batch.attention_mask, batch.mask, run.cfg.temperature)
    return float((h * batch.mask).sum() / batch.mask.sum())
