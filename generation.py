"""Generation backends for the tree rollout: transformers (any device) and vLLM (GPU, one engine per rank).

Paper: Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv:2510.14545, §3.2 and SPEC §1: both
backends return, per context, the segment the policy generated up to the next tool stop, `</answer>`, EOS or the
token budget, with its segment entropy H_seg (`rollout.segment_entropy` over the top-10 log-probs of the first 20
positions). Both read the top-10 of the raw (temperature 1) distribution, so a tree does not depend on the backend.

vLLM (`vllm==0.32.0`, read in its source; see `VLLMGenerator`): under torchrun every rank builds its own engine in
its own process on cuda:LOCAL_RANK (`distributed_executor_backend="external_launcher"`, tensor parallel size 1);
after each optimiser step the trainer streams the new weights in parameter by parameter and the engine sleeps
while the trainer updates.

Deviations from the paper / official code:
1. H_seg keeps ranks 1..10 of what vLLM returns at a position; vLLM adds the sampled token when it is outside the
   top-10, and the official code sums that one too (0.3-2.5% higher on synthetic distributions).
2. H_seg is normalised by log of the model config's vocabulary size; the official code uses
   log(len(tokenizer.get_vocab())).
"""
from __future__ import annotations

import os

import torch

import tools
from config import UserError
from rollout import Segment, segment_entropy


def _finish_reason(stop: str | None) -> str:
    return "answer" if stop == "</answer>" else "tool"


class _TopkRecorder:
    """A logits processor that records the top-k log-probs of the raw logits for the first n steps
    and changes nothing. Custom processors run before temperature and top-p in `generate`, so it
    sees the model's own distribution; keeping only (B, k) per step avoids storing (B, V) logits."""

    def __init__(self, k: int, n: int, on_step=None):
        self.k, self.n, self.steps, self.on_step = k, n, [], on_step

    def __call__(self, input_ids, scores):
        if len(self.steps) < self.n:
            self.steps.append(torch.log_softmax(scores.float(), -1).topk(self.k, -1).values.cpu())
        if self.on_step is not None:
            self.on_step(scores.shape[0])
        return scores


class TransformersGenerator:
    """All contexts of a round in batched `model.generate` calls (left padding), stopping at the
    closing tool tags, `</answer>` and EOS. H_seg uses the top-10 log-probs of the raw logits (T=1),
    the same quantity vLLM returns by default, so trees do not depend on the backend."""

    def __init__(self, model, tokenizer, temperature: float = 1.0, top_p: float = 1.0,
                 batch_size: int = 64, topk: int = 10, n_entropy: int = 20):
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p, self.batch_size = temperature, top_p, batch_size
        self.topk, self.n_entropy = topk, n_entropy
        self.vocab_size = model.config.vocab_size
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.on_step = None           # called after every decoding step with the rows decoded (progress bars)

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        """Copy new weights, (name, full tensor) pairs, into the model this generator samples from."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    @torch.no_grad()
    def generate(self, contexts, max_new_tokens, seed):
        out: list[Segment] = []
        for start in range(0, len(contexts), self.batch_size):
            out += self._generate_batch(contexts[start:start + self.batch_size],
                                        max_new_tokens[start:start + self.batch_size], seed + start)
        return out

    def _generate_batch(self, contexts, max_new_tokens, seed):
        device = next(self.model.parameters()).device
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            attn[i, width - len(c):] = 1
        torch.manual_seed(seed)
        sample = self.temperature > 0
        recorder = _TopkRecorder(self.topk, self.n_entropy, self.on_step)
        gen = self.model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max(max_new_tokens),
            do_sample=sample, temperature=self.temperature if sample else None,
            top_p=self.top_p if sample else None, top_k=0, logits_processor=[recorder],
            stop_strings=list(tools.STOP_STRINGS), tokenizer=self.tokenizer,
            eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id, return_dict_in_generate=True)
        new = gen.sequences[:, width:].tolist()
        n_ent = len(recorder.steps)
        topk = torch.stack(recorder.steps) if n_ent else torch.empty(0, len(contexts), self.topk)  # (n, B, topk)
        segments = []
        for i, row in enumerate(new):
            token_ids, reason, text = self._cut(row, max_new_tokens[i])
            per_pos = topk[:min(len(token_ids), n_ent), i].tolist()
            segments.append(Segment(token_ids, reason, segment_entropy(per_pos, self.vocab_size), text))
        return segments

    def _cut(self, row: list[int], limit: int) -> tuple[list[int], str, str]:
        """Keep tokens up to the first stop string / EOS (inclusive) or `limit` tokens."""
        text = ""
        for j, tok in enumerate(row[:limit]):
            if tok in self.eos_ids:
                return row[:j + 1], "eos", text
            text += self.tokenizer.decode([tok])
            hit = tools.first_stop(text[-64:])         # (end offset, stop string) or None
            if hit is not None:
                return row[:j + 1], _finish_reason(hit[1]), self.tokenizer.decode(row[:j + 1])
        kept = row[:limit]
        return kept, "length", self.tokenizer.decode(kept)


class VLLMGenerator:
    """vLLM backend (GPU): token-id prompts, prefix caching on (branches share their prefix),
    `logprobs=10` of the raw distribution for H_seg, stop strings kept in the output, one engine per
    rank colocated with the trainer, sleep while the trainer updates, weights streamed in after.

    Checked against the source of vllm 0.32.0 (file:function cited where the API is not public):
    - Under torchrun (torch.distributed initialised) the engine uses
      `distributed_executor_backend="external_launcher"` (v1/executor/uniproc_executor.py:
      ExecutorWithExternalLauncher): it runs in this process (config/parallel.py:ParallelConfig.__post_init__
      turns V1 multiprocessing off), on cuda:LOCAL_RANK (v1/worker/gpu_worker.py:Worker.init_device), reusing the
      trainer's process group; with tensor parallel size 1 every rank is an independent replica. Every rank must
      build its engine at the same point (vLLM makes process subgroups, a collective). One process without
      torchrun uses the default in-process executor (VLLM_ENABLE_V1_MULTIPROCESSING=0) on the current device.
    - Building an engine re-seeds the global RNGs with `seed` (utils/torch_utils.py:set_random_seed): the
      trainer seeds its own RNGs after building it.
    - The model is reached in-process through llm.llm_engine.model_executor (v1/engine/llm_engine.py:
      LLMEngine.__init__ sets it only without multiprocessing) .driver_worker.worker.model_runner.get_model()
      (v1/worker/gpu/model_runner.py:GPUModelRunner.get_model). Its `load_weights` (models/utils.py:
      AutoWeightsLoader) takes Hugging Face names, one (name, tensor) pair at a time, copies into the existing
      parameters and raises ValueError on an unknown name.
    - Sleep level 2 drops weights and KV cache (v1/worker/gpu_worker.py:Worker.sleep); the documented update order
      is wake_up(tags=["weights"]) -> load every parameter -> wake_up(tags=["kv_cache"]) (the scheduler resumes
      only when fully awake: v1/engine/core.py:EngineCore.wake_up). sleep() already resets the prefix cache;
      `reset_prefix_cache()` returns False when KV blocks are still in use (v1/core/block_pool.py).
    Only this class imports vllm, and only when constructed. Tested on CPU against a stand-in module that behaves
    like vLLM 0.32 in both executor modes (tests/fake_vllm.py); see the README for what has run on a GPU.
    """

    def __init__(self, model_path: str, temperature: float = 1.0, top_p: float = 1.0, topk: int = 10,
                 n_entropy: int = 20, gpu_memory_utilization: float = 0.4, seed: int = 0,
                 max_model_len: int | None = None, enable_sleep_mode: bool = True, dtype: str = "bfloat16",
                 vllm_module=None, **llm_kwargs):
        if vllm_module is None:
            try:
                import vllm as vllm_module
            except ImportError:
                raise UserError("--backend vllm needs vllm: pip install -r requirements-vllm.txt (GPU machines "
                                "only), or use --backend transformers") from None
        self.vllm = vllm_module
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
            llm_kwargs.setdefault("tensor_parallel_size", 1)
        else:                                        # one process: keep the engine in this process
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = vllm_module.LLM(model=model_path, enable_prefix_caching=True, seed=seed, dtype=dtype,
                                   gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                                   enable_sleep_mode=enable_sleep_mode, logprobs_mode="raw_logprobs", **llm_kwargs)
        self.temperature, self.top_p, self.topk, self.n_entropy = temperature, top_p, topk, n_entropy
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.tokenizer = self.llm.get_tokenizer()
        self.asleep = False

    def generate(self, contexts, max_new_tokens, seed):
        params = [self.vllm.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, max_tokens=n, logprobs=self.topk,
            stop=list(tools.STOP_STRINGS), include_stop_str_in_output=True, seed=seed * 1_000_003 + i)
            for i, n in enumerate(max_new_tokens)]
        prompts = [self.vllm.inputs.TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        segments = []
        for out in outputs:
            o = out.outputs[0]
            # vLLM adds the sampled token to the top-k dict when it is outside it: keep ranks 1..topk only
            per_pos = [[lp.logprob for lp in pos.values() if lp.rank is not None and lp.rank <= self.topk]
                       for pos in (o.logprobs or [])[:self.n_entropy]]
            if o.finish_reason == "length":
                reason = "length"
            elif isinstance(o.stop_reason, str):
                reason = _finish_reason(o.stop_reason)
            else:  # EOS (stop_reason None) or a stop token id
                reason = "eos"
            segments.append(Segment(list(o.token_ids), reason,
                                    segment_entropy(per_pos, self.vocab_size), o.text))
        return segments

    def model(self):
        """The engine's torch model, in this process."""
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        if executor is None:
            raise RuntimeError("the vLLM engine runs in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1): build it "
                               "with VLLMGenerator, which keeps it in this process")
        return executor.driver_worker.worker.model_runner.get_model()

    def load_weights(self, named_tensors) -> None:
        """Copy new weights into an awake engine (one (Hugging Face name, full tensor) pair at a time) and drop
        cached prefixes computed with the old weights."""
        self._write_weights(named_tensors)
        self._reset_prefix_cache()

    def sleep(self) -> None:
        """Release the engine's GPU memory for training (level 2: weights and KV cache dropped; the next
        wake_up must bring new weights)."""
        self.llm.sleep(level=2)
        self.asleep = True

    def wake_up(self, named_tensors) -> None:
        """After an optimiser step: take the memory back in the order vLLM documents for weight updates, writing
        `named_tensors` ((Hugging Face name, full tensor), e.g. policy.full_named_parameters) in between."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()             # return the trainer's cached blocks before the engine allocates
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self._write_weights(named_tensors)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self._reset_prefix_cache()

    def _write_weights(self, named_tensors) -> None:
        """Every engine parameter must be written: after a level-2 sleep the others would hold garbage."""
        model = self.model()
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                try:
                    loaded |= set(model.load_weights([(name, tensor)]) or ())
                except ValueError as err:
                    raise ValueError(f"vLLM rejected trainer parameter {name!r}: {err}") from err
        missing = {name for name, _ in model.named_parameters()} - loaded
        if missing:
            raise RuntimeError(f"the weight sync did not write {len(missing)} engine parameter(s), e.g. "
                               f"{sorted(missing)[:3]}: generating would use stale or dropped weights")

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (KV blocks still in use)")
