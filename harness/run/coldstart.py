"""The optional supervised cold start that teaches a model the tool format before RL.

The RL of paper §4 starts from instruct models that already follow the tool format. The no-argument run uses
SmolLM2-135M-Instruct (models.py), which never writes the tool format on its own, so it first takes a few supervised
steps on demonstrations built from training questions (question -> think -> search its query -> the real search results
-> think -> \\boxed{gold}), tokenised exactly like rollouts: policy segments with mask 1, tool results with mask 0.

Deviations from the paper / official code (algorithm.md §8): D40 (the cold start itself, off officially:
loss = -Σ log π(y_t)·mask / N_valid over all ranks, cached by model, demonstrations and settings).
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

import tools
from harness import cli, settings
from harness.run import parallel
from harness.run.policy import backward_micro_batches, optimizer_step, tensorize, unwrap

# ---------------------------------------------------------------------------------------------------------------------
# Supervised cold start: demonstrations tokenised exactly like rollouts (policy segments mask 1, results mask 0)


DEMO_THINK = ("<think> I need to find {what}. I will search for it. </think>\n",
              "<think> I do not know this for sure, so I will look it up. </think>\n",
              "<think> Let me search the encyclopedia for {what}. </think>\n")
DEMO_NEXT = "<think> The results point to the next thing to find: {what}. I will search for it. </think>\n"
DEMO_ANSWER = ("<think> The search results say the answer is {answer}. </think>\n"
               "<answer> The answer is \\boxed{{{answer}}}. </answer>")


def build_demonstrations(rows: list[dict], search, fmt=tools.TAGS) -> list[dict]:
    """Chat demonstrations from QA rows with good search queries: think -> search -> real results -> ... -> answer,
    each call written in the run's tool-call format `fmt`. A row's `query` is one query, or a list of queries searched
    in turn (a multi-hop demonstration: each later query is what the earlier results pointed to). Rows whose last
    search results do not contain the gold answer are left out (they would teach guessing)."""
    if "search" not in [t.name for t in fmt.tools]:
        raise cli.UserError("the cold start's demonstrations are built with the search tool, which --tools leaves "
                            "out: pass --cold_start_kw '{data: demos.jsonl}' or --cold_start false")
    queries = [row["meta"].get("query") for row in rows]
    queries = [[q] if isinstance(q, str) else q for q in queries]
    missing = [i for i, q in enumerate(queries) if not q or not all(isinstance(x, str) and x for x in q)]
    if missing:
        raise cli.UserError(f"cold start from the training data needs a 'query' field (a query, or a list of queries) "
                            f"in every row (row {missing[0]} has none): pass --cold_start_kw '{{data: demos.jsonl}}' "
                            "or --cold_start false")
    flat = search.search([q for qs in queries for q in qs])      # one batch for every row's every query
    demos, at = [], 0
    for i, (row, qs) in enumerate(zip(rows, queries)):
        results, at = flat[at:at + len(qs)], at + len(qs)
        gold = row["golds"][0]
        if gold.lower() not in results[-1].lower():
            continue
        messages = [{"role": "system", "content": fmt.system_prompt}, {"role": "user", "content": row["question"]}]
        for j, (query, result) in enumerate(zip(qs, results)):
            if j == 0:
                think = DEMO_THINK[i % len(DEMO_THINK)].format(what=query.rstrip("?. ").lower())
            else:                                # the query names what the last results pointed to
                think = DEMO_NEXT.format(what=query.rstrip("?. "))
            messages += [{"role": "assistant", "content": think + fmt.call_text("search", query)},
                         {"role": "tool", "content": result}]
        demos.append({"messages": messages + [{"role": "assistant", "content": DEMO_ANSWER.format(answer=gold)}]})
    return demos


def load_demonstrations(path: str) -> list[dict]:
    from harness import jsonl                    # rows split at "\n" only: a message may hold U+2028
    demos = []
    for n, line in enumerate(jsonl.lines(Path(path).read_text(encoding="utf-8-sig")), 1):
        if not line.strip():
            continue
        try:
            demo = json.loads(line)
        except json.JSONDecodeError as err:
            raise cli.UserError(f"--cold_start_kw data {path}: line {n}: not JSON ({err.msg})") from None
        roles = [m.get("role") for m in demo.get("messages", [])] if isinstance(demo, dict) else []
        if "user" not in roles or "assistant" not in roles:
            raise cli.UserError(f"--cold_start_kw data {path}: line {n}: a demonstration needs {{'messages': [...]}} "
                                   "with a user and an assistant message")
        demos.append(demo)
    if not demos:
        raise cli.UserError(f"--cold_start_kw data {path}: no demonstrations")
    return demos


def demo_tokens(demo: dict, tokenizer, fmt=tools.TAGS) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, response_ids, loss_mask) the way the rollout builds them: the chat-template prompt of the system
    and user messages, then each assistant message encoded on its own (mask 1) and each tool message as the run's
    tool-call format `fmt` renders a result (mask 0)."""
    messages = demo["messages"]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    head = messages[:first]
    if not any(m["role"] == "system" for m in head):
        head = [{"role": "system", "content": fmt.system_prompt}] + head
    prompt = fmt.prompt_ids(tokenizer, head)
    response, mask = [], []
    clean = tools.as_data if getattr(fmt, "as_data", True) else str    # results as a rollout's (D46)
    for m in messages[first:]:
        ids = tokenizer.encode(m["content"], add_special_tokens=False) if m["role"] == "assistant" else \
            fmt.observation_ids(tokenizer, clean(m["content"]))
        response += ids
        mask += [1 if m["role"] == "assistant" else 0] * len(ids)
    return prompt, response, mask


def cold_start(policy, demos: list[dict], tokenizer, cfg, rank: int, world: int, device, amp, log, fmt=tools.TAGS):
    """Supervised steps on the demonstrations: loss = −Σ log π(y_t)·mask / N_valid (global count, like RL)."""
    from tqdm import tqdm
    cs = settings.cold_start_settings(cfg)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cs.lr, weight_decay=0.0)
    items = [demo_tokens(d, tokenizer, fmt) for d in demos]
    rng = random.Random(cfg.seed)
    order: list[int] = []
    unwrap(policy).lm.train()
    for step in tqdm(range(cs.steps), desc="cold start", disable=rank != 0):
        while len(order) < cs.batch * world:
            order += rng.sample(range(len(items)), len(items))
        batch, order = order[:cs.batch * world], order[cs.batch * world:]
        mine = [items[i] for i in batch[rank::world]]
        mbs = [tensorize(mine[s:s + cfg.micro_batch_size], tokenizer.pad_token_id, device)
               for s in range(0, len(mine), cfg.micro_batch_size)]
        n_valid = parallel.all_reduce_sum(sum(mb.mask.sum() for mb in mbs).double()).item()

        def nll(mb, logp, _entropy):             # −Σ log π(y_t)·mask / N_valid
            value = -(logp * mb.mask).sum() / n_valid
            return value, {"nll": value.detach()}

        sums = backward_micro_batches(policy, mbs, world, amp, 1.0, nll, f"cold start {step}")
        grad_norm = optimizer_step(policy, optimizer, cfg.grad_clip)
        total = parallel.reduce_metrics(sums)["nll"]
        log(f"cold start {step + 1}/{cs.steps} | nll/token {total:.3f} | grad_norm {grad_norm:.2f}")
    unwrap(policy).lm.eval()


def cold_start_key(model_path: str, demos: list[dict], cfg, world: int) -> str:
    """Cache key: model + demonstration content + cold-start settings (the global batch grows with world size)."""
    cs = settings.cold_start_settings(cfg)
    key = (cs.steps, cs.batch, cs.lr, cfg.micro_batch_size, cfg.seed, cfg.bf16, world)
    h = hashlib.sha256(json.dumps([model_path, demos, key], sort_keys=True).encode())
    return h.hexdigest()[:16]


def demonstrations(cfg, train_rows: list[dict], search, fmt=tools.TAGS) -> tuple[list[dict], list[dict]]:
    """(demonstrations, the training rows left for RL): --cold_start_kw's data, or its first `questions`
    training questions turned into demonstrations (RL then skips them); none without --cold_start."""
    if not cfg.cold_start:
        return [], train_rows
    cs = settings.cold_start_settings(cfg)
    if cs.data:
        demos = load_demonstrations(cs.data)
    else:
        demos = build_demonstrations(train_rows[:cs.questions], search, fmt)
        train_rows = train_rows[cs.questions:]
    if not demos:
        raise cli.UserError("cold start: no usable demonstrations (no search result held its gold answer): pass "
                               "--cold_start_kw '{data: demos.jsonl}' or --cold_start false")
    return demos, train_rows
