"""The run's generator (`make_generator`) and the transformers generation backend (any device); vLLM's is in
harness/generation/vllm.py. Both implement `rollout.Generator`.

A backend returns, per context, the segment the policy generated up to the next tool stop, `</answer>`, EOS or the
token budget, with its segment entropy H_seg (algorithm.md §1: `rollout.segment_entropy` over the top-10 log-probs of
the first 20 positions). Both read the top-10 of the raw (temperature 1) distribution and sample only as the call's
`rollout.Sampling` says, so a tree does not depend on the backend or on a checkpoint's generation_config.

Deviations from the paper / official code (algorithm.md §8): D9 (H_seg normalised by log of the model
configuration's vocabulary size), D41 (under FSDP2 the transformers backend samples from an unsharded copy).
"""
from __future__ import annotations

import contextlib

import torch

import rollout
import tools
from rollout import Sampling, Segment, segment_entropy


def make_generator(cfg, init_path: str, policy, tokenizer, rank: int, device,
                   stop_strings: tuple[str, ...] = tools.STOP_STRINGS):
    """The run's generator: vLLM (one engine per rank, built from the checkpoint at init_path; with LoRA the base
    model, and the adapter at each sync), or transformers sampling from the policy's own LM (one process, DDP; with
    LoRA its adapters are in it) or from an unsharded copy of it (FSDP2: D41; with LoRA it takes the merged weights).
    Generation stops at stop_strings (the run's tool-call format's), EOS or the token budget."""
    from harness import lora
    from harness.run.policy import is_sharded, unwrap
    lm = unwrap(policy).lm
    if cfg.backend == "vllm":
        from harness.generation.vllm import VLLMGenerator
        return VLLMGenerator(init_path, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, seed=cfg.seed + rank,
                             max_model_len=cfg.max_prompt_tokens + cfg.max_response_tokens,
                             lora=lm.peft_config[lora.ADAPTER] if lora.is_lora(lm) else None,
                             stop_strings=stop_strings)
    from harness.models import load_lm
    if is_sharded(policy):
        lm = load_lm(init_path, device)
    elif lora.is_lora(lm):
        lm = lm.get_base_model()                 # the transformers model with the adapters' layers in it
    return TransformersGenerator(lm, tokenizer, batch_size=cfg.gen_batch_size, stop_strings=stop_strings)


class TransformersGenerator:
    """All contexts of a round decoded together, token by token with the model's KV cache, each row leaving the batch
    as soon as its segment ends (a closing tool tag, `</answer>`, EOS or its own token budget) so that the others go on
    without it: `model.generate` would run the padded batch until its longest row ends. It samples the model's own
    distribution shaped only by the call's `Sampling` (a checkpoint's generation_config is not applied), with
    transformers' own processors in generate's order (repetition penalty, temperature, top-k, top-p), and each
    segment carries the log-prob of its tokens at the sampling temperature. H_seg uses the top-10 log-probs of the raw
    logits (T=1, before any repetition penalty), the same quantity vLLM returns, so trees do not depend on the backend.
    It samples from `model`, which is the policy's own LM with one process or DDP (update_weights then has nothing to
    copy) and an unsharded copy under FSDP2 (D41)."""

    def __init__(self, model, tokenizer, batch_size: int = 64, topk: int = 10, n_entropy: int = 20,
                 stop_strings: tuple[str, ...] = tools.STOP_STRINGS):
        self.model, self.tokenizer, self.batch_size, self.stop_strings = model, tokenizer, batch_size, stop_strings
        self.topk, self.n_entropy = topk, n_entropy
        self.vocab_size = model.config.vocab_size
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.takes_adapter = any(".lora_A." in name for name, _ in model.named_parameters())   # LoRA layers in it
        import inspect                           # transformers 5.25 renamed forward's past_key_values to cache
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def update_weights(self, named_tensors) -> None:
        """Copy new weights, (name, full tensor) pairs named as in the model this generator samples from (its
        adapters' tensors when it has LoRA layers), into that model; a tensor that is already the model's own
        parameter (the policy's LM itself) is skipped."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if params[name].data_ptr() != tensor.data_ptr():
                params[name].copy_(tensor)

    def sleep(self) -> None:
        """Nothing to release: the model is the trainer's (or a copy it keeps)."""

    def close(self) -> None:
        """Nothing to shut down."""

    @torch.no_grad()
    def generate(self, contexts, max_new_tokens, seed, sampling: Sampling = Sampling(), on_step=None):
        out: list[Segment] = []
        for start in range(0, len(contexts), self.batch_size):
            out += self._generate_batch(contexts[start:start + self.batch_size],
                                        max_new_tokens[start:start + self.batch_size], seed + start, sampling, on_step)
        return out

    def _generate_batch(self, contexts, max_new_tokens, seed, sampling: Sampling, on_step):
        """One batch: a prefill of the left-padded contexts, then one forward per step over the rows still running.
        A row that ends leaves the batch, its KV cache rows and attention mask with it. The draws are generate's
        (one multinomial over the running rows per step, after the same processors), so a batch whose rows end
        together samples what `model.generate` would; once rows have left, the later draws differ from its."""
        from transformers import DynamicCache
        device = next(self.model.parameters()).device
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            attn[i, width - len(c):] = 1
        ids, attn = ids.to(device), attn.to(device)
        torch.manual_seed(seed)
        sample, temperature = sampling.temperature > 0, sampling.temperature if sampling.temperature > 0 else 1.0
        rows = [_Row(limit) for limit in max_new_tokens]
        running = [i for i, row in enumerate(rows) if not row.finish_if_empty()]
        pads = width - attn.sum(-1)                  # the repetition penalty ignores the padding
        cache, seqs = DynamicCache(config=self.model.config), ids
        step_ids, positions = ids, (attn.cumsum(-1) - 1).clamp(min=0)
        if len(running) < len(contexts):             # budget 0: never decoded
            index = torch.tensor(running, dtype=torch.long, device=device)
            seqs, attn, pads, step_ids, positions = seqs[index], attn[index], pads[index], ids[index], positions[index]
        while running:
            logits = self.model(input_ids=step_ids, attention_mask=attn, position_ids=positions, use_cache=True,
                                logits_to_keep=1, **{self.cache_kw: cache}).logits[:, -1].float()
            scores = self._processors(sampling, pads)(seqs, logits.clone())
            chosen = torch.multinomial(torch.softmax(scores, -1), 1)[:, 0] if sample else scores.argmax(-1)
            logp = torch.log_softmax(logits / temperature, -1).gather(1, chosen[:, None])[:, 0].tolist()
            needs_top = any(len(rows[i].token_ids) < self.n_entropy for i in running)
            top = torch.log_softmax(logits, -1).topk(self.topk, -1).values.tolist() if needs_top else None
            for j, i in enumerate(running):
                rows[i].add(int(chosen[j]), logp[j], top[j] if top is not None else None, self)
            if on_step is not None:
                on_step(len(running))
            keep = [j for j, i in enumerate(running) if not rows[i].reason]
            seqs = torch.cat([seqs, chosen[:, None]], 1)
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            if len(keep) < len(running):             # finished rows leave the batch and its cache
                index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.reorder_cache(index)           # every layer type has it (a hybrid's recurrent state too)
                seqs, attn, pads, chosen = seqs[index], attn[index], pads[index], chosen[index]
                running = [running[j] for j in keep]
            step_ids, positions = chosen[:, None], attn.sum(-1, keepdim=True) - 1
        return [Segment(row.token_ids, row.reason, segment_entropy(row.top, self.vocab_size), row.text, row.logprobs)
                for row in rows]

    def _processors(self, sampling: Sampling, pads):
        """generate's logits processors for `sampling`, in its order: repetition penalty (after the raw logits that
        H_seg and the log-probs read), then temperature, top-k and top-p when sampling."""
        from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                  TopKLogitsWarper, TopPLogitsWarper)
        out = LogitsProcessorList()
        if sampling.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty, prompt_ignore_length=pads))
        if sampling.temperature > 0:
            if sampling.temperature != 1.0:
                out.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k:
                out.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                out.append(TopPLogitsWarper(sampling.top_p))
        return out


class _Row:
    """One context's segment as it is decoded: its tokens, their log-probs, the top-k log-probs of its first
    positions (H_seg), its text, and why it ended ("" while it runs)."""

    def __init__(self, limit: int):
        self.limit, self.token_ids, self.logprobs, self.top, self.text, self.reason = limit, [], [], [], "", ""

    def finish_if_empty(self) -> bool:
        if self.limit <= 0:
            self.reason = "length"
        return bool(self.reason)

    def add(self, token: int, logprob: float, top: list[float] | None, gen: TransformersGenerator) -> None:
        """Append a sampled token and end the segment at EOS, a stop string (inclusive) or the token budget."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if len(self.token_ids) <= gen.n_entropy and top is not None:
            self.top.append(top)
        if token in gen.eos_ids:
            self.reason = "eos"
            return
        self.text += gen.tokenizer.decode([token])
        hit = rollout.first_stop(self.text[-64:], gen.stop_strings)   # (end offset, stop string) or None
        if hit is not None:
            self.reason = rollout.finish_reason(hit[1])
        elif len(self.token_ids) >= self.limit:
            self.reason = "length"
        if self.reason:
            self.text = gen.tokenizer.decode(self.token_ids)
