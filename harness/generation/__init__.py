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
    """All contexts of a round decoded together, token by token with the model's KV cache, at most batch_size rows
    at once: each row leaves the batch as soon as its segment ends (a closing tool tag, `</answer>`, EOS or its own
    token budget) and a waiting context takes its place, so that the others go on without it (`model.generate` would
    run a padded batch until its longest row ends, then start the next; transformers' continuous batching returns
    the sampled tokens' log-probs but not the top-10 that H_seg reads). It samples the model's own
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
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer
        layers = DynamicCache(config=model.config).layers
        self.joins = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)   # plain KV caches only

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
        """Each context's segment. At most batch_size rows decode at once; as rows end, waiting contexts join the
        running batch (their prefill, then the merged cache), so the batch stays full until the queue is empty.
        The draws are generate's (one multinomial over the rows of each forward, after the same processors): a
        call whose rows all fit in one batch and end together samples what `model.generate` would."""
        torch.manual_seed(seed)
        rows = [_Row(limit) for limit in max_new_tokens]
        waiting = [i for i, row in enumerate(rows) if not row.finish_if_empty()]     # budget 0: never decoded
        batch = None
        while waiting or (batch is not None and batch.running):
            free = self.batch_size - (len(batch.running) if batch is not None else 0)
            if waiting and free > 0 and (batch is None or not batch.running or self.joins):
                take, waiting = waiting[:free], waiting[free:]
                new = self._prefill([contexts[i] for i in take], take, rows, sampling, on_step)
                batch = new if batch is None or not batch.running else batch.merge(new, self.pad_id)
            else:
                self._step(batch, batch.pending[:, None], batch.attn.sum(-1, keepdim=True) - 1, rows, sampling,
                           on_step)
        return [Segment(row.token_ids, row.reason, segment_entropy(row.top, self.vocab_size), row.text, row.logprobs)
                for row in rows]

    def _prefill(self, contexts, indices, rows, sampling: Sampling, on_step) -> _Batch:
        """The contexts left-padded into a batch of their own, run through the model, their first tokens drawn."""
        from transformers import DynamicCache
        device = next(self.model.parameters()).device
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            attn[i, width - len(c):] = 1
        ids, attn = ids.to(device), attn.to(device)
        batch = _Batch(DynamicCache(config=self.model.config), ids, attn, width - attn.sum(-1), list(indices),
                       self.joins)
        self._step(batch, ids, (attn.cumsum(-1) - 1).clamp(min=0), rows, sampling, on_step)
        return batch

    def _step(self, batch: _Batch, step_ids, positions, rows, sampling: Sampling, on_step) -> None:
        """One forward over the batch's rows, one token drawn for each; the rows that end leave the batch."""
        logits = self.model(input_ids=step_ids, attention_mask=batch.attn, position_ids=positions, use_cache=True,
                            logits_to_keep=1, **{self.cache_kw: batch.cache}).logits[:, -1].float()
        scores = self._processors(sampling, batch.pads)(batch.seqs, logits.clone())
        sample, temperature = sampling.temperature > 0, sampling.temperature if sampling.temperature > 0 else 1.0
        chosen = torch.multinomial(torch.softmax(scores, -1), 1)[:, 0] if sample else scores.argmax(-1)
        logp = torch.log_softmax(logits / temperature, -1).gather(1, chosen[:, None])[:, 0].tolist()
        needs_top = any(len(rows[i].token_ids) < self.n_entropy for i in batch.running)
        top = torch.log_softmax(logits, -1).topk(self.topk, -1).values.tolist() if needs_top else None
        for j, i in enumerate(batch.running):
            rows[i].add(int(chosen[j]), logp[j], top[j] if top is not None else None, self)
        if on_step is not None:
            on_step(len(batch.running))
        batch.seqs = torch.cat([batch.seqs, chosen[:, None]], 1)
        batch.attn = torch.cat([batch.attn, torch.ones_like(batch.attn[:, :1])], 1)
        batch.pending = chosen
        keep = [j for j, i in enumerate(batch.running) if not rows[i].reason]
        if len(keep) < len(batch.running):            # finished rows leave the batch and its cache
            batch.select(keep)

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


class _Batch:
    """The rows decoding together: their KV cache, ids so far and attention mask (left-padded: the cache's positions
    plus the pending token's), left-pad counts (the repetition penalty skips them), the token each feeds next, and
    which of the call's contexts they are. plain: a plain KV cache (full attention), which can be trimmed and merged."""

    def __init__(self, cache, seqs, attn, pads, running: list[int], plain: bool):
        self.cache, self.seqs, self.attn, self.pads, self.running, self.plain = cache, seqs, attn, pads, running, plain
        self.pending = None

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.seqs.device)
        self.cache.reorder_cache(index)               # every layer type has it (a hybrid's recurrent state too)
        self.seqs, self.attn, self.pads, self.pending = (self.seqs[index], self.attn[index], self.pads[index],
                                                         self.pending[index])
        self.running = [self.running[j] for j in keep]
        if self.plain and self.running:
            self.trim()

    def trim(self) -> None:
        """Drop the leading positions that are padding in every row (left by rows that have left); plain KV caches."""
        lead = int((self.attn.sum(0) == 0).long().cumprod(0).sum())
        if lead:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., lead:, :], layer.values[..., lead:, :]
            self.seqs, self.attn, self.pads = self.seqs[:, lead:], self.attn[:, lead:], self.pads - lead

    def merge(self, other: _Batch, pad_id: int) -> _Batch:
        """One batch of both: the shorter side left-padded (cache, ids and mask) to the longer. Plain KV caches."""
        width = max(self.attn.shape[1], other.attn.shape[1])
        for side in (self, other):
            extra = width - side.attn.shape[1]
            if extra:
                for layer in side.cache.layers:
                    layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, extra, 0))
                    layer.values = torch.nn.functional.pad(layer.values, (0, 0, extra, 0))
                side.seqs = torch.nn.functional.pad(side.seqs, (extra, 0), value=pad_id)
                side.attn = torch.nn.functional.pad(side.attn, (extra, 0))
                side.pads = side.pads + extra
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys, mine.values = torch.cat([mine.keys, theirs.keys]), torch.cat([mine.values, theirs.values])
        self.seqs, self.attn = torch.cat([self.seqs, other.seqs]), torch.cat([self.attn, other.attn])
        self.pads, self.pending = torch.cat([self.pads, other.pads]), torch.cat([self.pending, other.pending])
        self.running = self.running + other.running
        return self


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
