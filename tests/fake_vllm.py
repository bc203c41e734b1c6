"""A stand-in for the parts of vLLM 0.32's offline API that generation.VLLMGenerator uses (vLLM has no CPU install
here), strict where the real one is (read in the vllm==0.32.0 wheel; file:function of each rule below).

- `LLM(...)` accepts only argument names vLLM 0.32 has (entrypoints/llm.py, engine/arg_utils.py:EngineArgs);
  building it re-seeds the global RNGs with `seed` (utils/torch_utils.py:set_random_seed).
- Executor modes: `distributed_executor_backend="external_launcher"` needs RANK and LOCAL_RANK (KeyError
  otherwise), an initialised process group when WORLD_SIZE > 1, every rank building at the same point (vLLM makes
  subgroups: a collective, here a barrier), turns V1 multiprocessing off and places the engine on cuda:LOCAL_RANK
  (v1/executor/uniproc_executor.py, v1/worker/gpu_worker.py:Worker.init_device). Otherwise the engine is on cuda:0,
  and with VLLM_ENABLE_V1_MULTIPROCESSING unset or 1 it runs in another process: `llm.llm_engine` then has no
  `model_executor` (v1/engine/llm_engine.py:LLMEngine.__init__).
- The model behind `model_executor.driver_worker.worker.model_runner.get_model()` loads Hugging Face names; an
  unknown name raises ValueError, a tied `lm_head.weight` sent without `model.embed_tokens.weight` raises
  ValueError, a wrong shape raises AssertionError (models/utils.py:AutoWeightsLoader, weight_utils); it returns the
  names it wrote.
- `sleep(level)`: 1 keeps the weights (offloaded), 2 drops them (here: overwritten with NaN) and the KV cache, and
  both reset the prefix cache (v1/engine/core.py:EngineCore.sleep). `wake_up(tags)` wakes "weights" and/or
  "kv_cache"; writing weights while they sleep, and generating before both are awake, fail here (vLLM would crash
  or wait forever).
- Sampling: token-id prompts, per-request `SamplingParams` (temperature 0 = greedy, top-p, `max_tokens`,
  `logprobs=N` = the top-N log-probs of the raw logits plus the sampled token with its true rank, stop strings kept
  with `include_stop_str_in_output=True`, a per-request seed), `finish_reason` "stop"/"length", `stop_reason` (the
  matched string, or None for EOS). Generation runs a transformers model token by token on the CPU; `device`
  records where the real engine would be.
"""
import os
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

ENGINE_ARGS = {"enable_sleep_mode", "enable_prefix_caching", "max_model_len", "distributed_executor_backend",
               "max_num_seqs", "max_num_batched_tokens", "logprobs_mode", "data_parallel_size", "enforce_eager",
               "tensor_parallel_size", "dtype", "seed", "gpu_memory_utilization"}


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None
    stop: list = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None


class inputs:  # noqa: N801 -- mirrors the vllm.inputs module
    @staticmethod
    def TokensPrompt(prompt_token_ids):  # noqa: N802 -- a TypedDict in vLLM
        return {"prompt_token_ids": prompt_token_ids}


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class _EngineModel:
    """What model_runner.get_model() returns: load_weights with vLLM's name rules, named_parameters."""

    def __init__(self, llm):
        self.llm, self.hf = llm, llm.model

    def named_parameters(self):
        return self.hf.named_parameters()

    def load_weights(self, weights):
        if "weights" in self.llm.asleep:
            raise RuntimeError("load_weights while the weights sleep: call wake_up(tags=['weights']) first")
        params = dict(self.hf.named_parameters())
        tied = self.hf.config.tie_word_embeddings
        weights = list(weights)
        names = [name for name, _ in weights]
        loaded = set()
        for name, tensor in weights:
            if tied and name == "lm_head.weight":
                if "model.embed_tokens.weight" not in names:
                    raise ValueError("'lm_head.weight' was skipped because it is tied to 'model.embed_tokens.weight'"
                                     " but 'model.embed_tokens.weight' was not found in the checkpoint")
                continue
            if name not in params:
                raise ValueError(f"There is no module or parameter named {name!r} in {type(self.hf).__name__}")
            assert params[name].shape == tensor.shape, f"Attempted to load weight ({tuple(tensor.shape)}) into " \
                                                       f"parameter ({tuple(params[name].shape)})"
            params[name].data.copy_(tensor)
            loaded.add(name)
        self.llm.events.append(f"load_weights:{len(loaded)}")
        return loaded


class LLM:
    instances = []

    def __init__(self, model, **kwargs):
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        if kwargs.get("logprobs_mode", "raw_logprobs") != "raw_logprobs":
            raise NotImplementedError("the stand-in computes raw_logprobs only")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.kwargs, self.events, self.asleep = kwargs, [], set()
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
                raise RuntimeError("external_launcher: torch.distributed must be initialised first")
            if torch.distributed.is_initialized():
                torch.distributed.barrier()          # vLLM's new_group calls: every rank builds together
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            self.device, self.rank, multiprocess = f"cuda:{local_rank}", rank, False
        else:
            self.device, self.rank = "cuda:0", 0
            multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") not in ("0", "false", "False")
        seed = kwargs.get("seed", 0)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        import inspect  # transformers renamed past_key_values -> cache in 5.2x
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        vocab = self.model.config.vocab_size
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: vocab))
        if not multiprocess:
            runner = SimpleNamespace(get_model=lambda: _EngineModel(self))
            self.llm_engine.model_executor = SimpleNamespace(
                driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))
        LLM.instances.append(self)

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.events.append("reset_prefix_cache")
        return True

    def sleep(self, level=1, mode="abort"):
        self.events.append(f"sleep{level}")
        if level >= 2:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        tags = list(tags) if tags is not None else ["weights", "kv_cache"]
        self.events.append("wake_up:" + ",".join(tags))
        self.asleep -= set(tags)
        return not self.asleep

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=True):
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} sleep: vLLM 0.32 would wait forever")
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.events.append(f"generate:{len(prompts)}:T={params[0].temperature:g}")
        return [self._one(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]

    def _one(self, ids, sp):
        gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 0)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
        out_ids, logprobs, text = [], [], ""
        finish, stop_reason = "length", None
        ctx = torch.tensor([ids])
        past = None
        for _ in range(sp.max_tokens):
            res = self.model(input_ids=ctx, use_cache=True, **{self._cache_arg: past})
            past = getattr(res, self._cache_arg)
            logits = res.logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            if sp.temperature == 0:
                tok = int(logits.argmax())
            else:
                probs = torch.softmax(logits / sp.temperature, -1)
                sorted_p, order = probs.sort(descending=True)
                keep = sorted_p.cumsum(-1) - sorted_p < sp.top_p
                sorted_p[~keep] = 0
                tok = int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
            if sp.logprobs:
                top = lp.topk(sp.logprobs)
                entry = {int(i): Logprob(float(v), r + 1) for r, (v, i) in enumerate(zip(top.values, top.indices))}
                if tok not in entry:
                    entry[tok] = Logprob(float(lp[tok]), int((lp > lp[tok]).sum()) + 1)
                logprobs.append(entry)
            out_ids.append(tok)
            ctx = torch.tensor([[tok]])
            if tok in eos:
                finish = "stop"
                break
            text += self.tokenizer.decode([tok])
            hit = next((s for s in sp.stop if s in text), None)
            if hit is not None:
                finish, stop_reason = "stop", hit
                if not sp.include_stop_str_in_output:
                    text = text[:text.index(hit)]
                break
        completion = SimpleNamespace(token_ids=out_ids, logprobs=logprobs if sp.logprobs else None,
                                     finish_reason=finish, stop_reason=stop_reason, text=text)
        return SimpleNamespace(prompt_token_ids=ids, outputs=[completion])
