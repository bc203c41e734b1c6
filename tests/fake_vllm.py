"""A stand-in for the parts of vLLM 0.32's offline API that generation.VLLMGenerator uses, strict where the real one
is (read in the vllm==0.32.0 wheel; file:function of each rule below). The real engine is tested too, on vLLM's CPU
build (tests/test_vllm_engine.py); this stand-in also plays a GPU and runs in the project's own environment.

- `LLM(...)` accepts only argument names vLLM 0.32 has (entrypoints/llm.py, engine/arg_utils.py:EngineArgs);
  building it re-seeds the global RNGs with `seed` (utils/torch_utils.py:set_random_seed).
- `platforms.current_platform`: a GPU by default (sleep mode available); `use_platform("cpu")` makes it vLLM's CPU
  build, where `enable_sleep_mode=True` raises ValueError (config/model.py:ModelConfig.__post_init__) and the LM head
  computes with a packed copy of its weight made by process_weights_after_loading
  (model_executor/layers/utils.py:dispatch_cpu_unquantized_gemm), which a tied head does not redo on reload.
- Executor modes: `distributed_executor_backend="external_launcher"` needs RANK and LOCAL_RANK (KeyError
  otherwise), an initialised process group when WORLD_SIZE > 1, every rank building at the same point (vLLM makes
  subgroups: a collective, here a barrier), turns V1 multiprocessing off and places the engine on cuda:LOCAL_RANK
  (v1/executor/uniproc_executor.py, v1/worker/gpu_worker.py:Worker.init_device). Otherwise the engine is on cuda:0,
  and with VLLM_ENABLE_V1_MULTIPROCESSING unset or 1 it runs in another process: `llm.llm_engine` then has no
  `model_executor` (v1/engine/llm_engine.py:LLMEngine.__init__). Shutting the engine down
  (`llm_engine.engine_core.shutdown()`) destroys the default process group, and fails if the trainer already
  destroyed it (distributed/parallel_state.py:cleanup_dist_env_and_memory).
- Weights: `collective_rpc(fn, args)` runs fn(worker, *args) in-process and `apply_model(fn)` fn(model)
  (serial_utils.py:run_method). `worker.reload_weights(weights_iterator=...)` calls the model's `load_weights`, which
  takes Hugging Face names: an unknown name raises ValueError, a tied `lm_head.weight` sent without
  `model.embed_tokens.weight` raises ValueError, a wrong shape raises AssertionError (models/utils.py:
  AutoWeightsLoader); it returns the names it wrote. A parameter no weight reached keeps its old value, with only a
  log line (model_loader/reload/layerwise.py:finalize_layerwise_processing).
- `sleep(level)`: 1 keeps the weights (offloaded), 2 drops them (here: overwritten with NaN) and the KV cache, and
  both reset the prefix cache (v1/engine/core.py:EngineCore.sleep). `wake_up(tags)` wakes "weights" and/or
  "kv_cache"; writing weights while they sleep, and generating before both are awake, fail here (vLLM would crash
  or wait forever).
- LoRA: `enable_lora`, `max_loras`, `max_lora_rank` are engine arguments; `llm_engine.add_lora(request)` reads peft's
  adapter files into an adapted copy of the model (W + (α/r)·B·A), refuses a rank above `max_lora_rank`
  (lora/peft_helper.py:validate_legal) and fails while the weights sleep (a level-1 sleep unmaps the LoRA buffers,
  verl#7434); `generate(..., lora_request=...)` samples with it, and `adapters_used` records each call's adapter.
  `model_executor.models.ModelRegistry.models` lists no architecture (the registry's lookup falls through), and
  `config.lora.MaxLoRARanks` is vLLM's list of ranks.
- Requests: `generate`, or `enqueue` then `llm_engine.step()` (every queued request ends within the step here; the
  real engine advances each by one token a step), outputs tagged with the external request id; a request left in the
  engine finishes into whichever step runs next, until `llm_engine.abort_request(external ids)` takes it out.
- Sampling: token-id prompts, per-request `SamplingParams` (temperature 0 = greedy, above 2 refused:
  sampling_params.py:SamplingParams._verify_args; top-p, `max_tokens`, `logprobs=N` = the top-N log-probs of the raw
  logits plus the sampled token with its true rank, `flat_logprobs`, stop strings kept with
  `include_stop_str_in_output=True`, a per-request seed that must fit an int64: v1/worker/gpu/sample/states.py),
  `finish_reason` "stop"/"length", `stop_reason` (the matched string, or None for EOS). Generation runs a
  transformers model token by token on the CPU; `device` records where the real engine would be. `stats` counts the
  log-prob positions returned (vLLM detokenises each).
"""
import os
import random
import sys
import typing
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace

import numpy as np
import torch

ENGINE_ARGS = {"enable_sleep_mode", "enable_prefix_caching", "max_model_len", "distributed_executor_backend",
               "max_num_seqs", "max_num_batched_tokens", "logprobs_mode", "data_parallel_size", "enforce_eager",
               "tensor_parallel_size", "dtype", "seed", "gpu_memory_utilization", "kv_cache_memory_bytes",
               "enable_chunked_prefill", "enable_lora", "max_loras", "max_lora_rank"}
INT64 = (-2**63, 2**63 - 1)


class _Platform:
    def __init__(self, kind: str):
        self.kind = kind

    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def is_sleep_mode_available(self) -> bool:
        return self.kind == "cuda"


platforms = ModuleType(__name__ + ".platforms")     # importable as <this module>.platforms, like vllm.platforms
platforms.current_platform = _Platform("cuda")
sys.modules[platforms.__name__] = platforms


def _submodule(name: str, **attributes) -> ModuleType:
    """<this module>.<name>, importable like the vllm submodule of that name."""
    module = ModuleType(f"{__name__}.{name}")
    module.__dict__.update(attributes)
    sys.modules[module.__name__] = module
    return module


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    load_inplace: bool = False


# vllm.lora.request, vllm.config.lora (the ranks max_lora_rank may take), vllm.model_executor.models (the registry:
# an architecture listed with supports_lora False cannot take an adapter; the tests' models are not listed)
_submodule("lora.request", LoRARequest=LoRARequest)
_submodule("config.lora", MaxLoRARanks=typing.Literal[1, 8, 16, 32, 64, 128, 256, 320, 512])
models = _submodule("model_executor.models", ModelRegistry=SimpleNamespace(models={}),
                    supports_lora=lambda cls: getattr(cls, "supports_lora", False))


def use_platform(kind: str) -> None:
    """'cuda' (the default) or 'cpu' (vLLM's CPU build)."""
    platforms.current_platform = _Platform(kind)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    repetition_penalty: float = 1.0     # on prompt and output tokens, as vLLM
    max_tokens: int = 16
    logprobs: int | None = None
    flat_logprobs: bool = False
    stop: list = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None

    def __post_init__(self):                # sampling_params.py:SamplingParams._verify_args
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")


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
    """What model_runner.get_model() returns: load_weights with vLLM's name rules, named_parameters, lm_head."""

    def __init__(self, llm):
        self.llm, self.hf = llm, llm.model
        self.lm_head = SimpleNamespace(weight=self.hf.lm_head.weight,
                                       quant_method=SimpleNamespace(process_weights_after_loading=llm.pack_head))

    def named_parameters(self, remove_duplicate=True):
        return self.hf.named_parameters(remove_duplicate=remove_duplicate)

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
        if not tied and "lm_head.weight" in loaded:   # the untied head is reloaded as a layer: re-packed
            self.llm.pack_head()
        return loaded


class _Worker:
    """The driver worker: its model runner, and vLLM's in-place reload (a missing weight is only logged)."""

    def __init__(self, llm):
        self.llm = llm
        model = _EngineModel(llm)
        self.model_runner = SimpleNamespace(get_model=lambda: model)

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        model = self.model_runner.get_model()
        model.load_weights(weights_iterator)
        self.llm.events.append("reload_weights")


class LLM:
    instances = []

    def __init__(self, model, **kwargs):
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        if kwargs.get("logprobs_mode", "raw_logprobs") != "raw_logprobs":
            raise NotImplementedError("the stand-in computes raw_logprobs only")
        self.platform = platforms.current_platform
        if kwargs.get("enable_sleep_mode") and not self.platform.is_sleep_mode_available():
            raise ValueError("Sleep mode is not supported on current platform.")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.kwargs, self.events, self.asleep = kwargs, [], set()
        self.in_process_group = False
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
                raise RuntimeError("external_launcher: torch.distributed must be initialised first")
            if torch.distributed.is_initialized():
                torch.distributed.barrier()          # vLLM's new_group calls: every rank builds together
                self.in_process_group = True
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            self.device, self.rank, multiprocess = f"cuda:{local_rank}", rank, False
        else:
            self.device, self.rank = "cuda:0", 0
            multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") not in ("0", "false", "False")
        if self.platform.is_cpu():
            self.device = "cpu"
        seed = kwargs.get("seed", 0)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        import inspect  # transformers renamed past_key_values -> cache in 5.2x
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.packed_head = None
        self.pack_head()
        self.stats = {"logprob_positions": 0}
        vocab = self.model.config.vocab_size
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: vocab),
                                          engine_core=SimpleNamespace(shutdown=self._shutdown),
                                          add_lora=self._add_lora, step=self._step,
                                          abort_request=self._abort_request)
        self.queued, self.request_counter = [], 0     # enqueue's requests until an engine step runs them
        self.aborted: list[str] = []
        self.adapted, self.lora_id, self.adapters_used = None, None, []      # the adapter of each generate call
        self.shut_down = False
        if not multiprocess:
            worker = _Worker(self)
            self.llm_engine.model_executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=worker))
        LLM.instances.append(self)

    def pack_head(self, layer=None):
        """process_weights_after_loading of the LM head: on the CPU build a packed copy the head computes with."""
        if self.platform.is_cpu():
            self.packed_head = self.model.lm_head.weight.detach().clone()

    def _shutdown(self):
        if self.shut_down:
            return
        if self.in_process_group and not torch.distributed.is_initialized():
            raise ValueError("Invalid process group specified")   # the trainer left its process group first
        self.shut_down = True
        self.events.append("shutdown")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def get_tokenizer(self):
        return self.tokenizer

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        worker = self.llm_engine.model_executor.driver_worker.worker
        return [method(worker, *args, **(kwargs or {}))]

    def apply_model(self, func):
        return [func(self.llm_engine.model_executor.driver_worker.worker.model_runner.get_model())]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.events.append("reset_prefix_cache")
        return True

    def sleep(self, level=1, mode="abort"):
        if not self.kwargs.get("enable_sleep_mode"):
            raise ValueError("Sleep mode is not enabled")
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
    def _add_lora(self, request):
        """llm_engine.add_lora: peft's adapter files read (lora/worker_manager.py:_load_adapter; a rank above
        max_lora_rank is refused, peft_helper.py:validate_legal) into the engine's adapted model, W + (α/r)·B·A; a
        known id is read again only with load_inplace (worker_manager.py:add_adapter). With the weights asleep it
        fails: a level-1 sleep unmaps the LoRA buffers (verl#7434)."""
        import copy
        import json
        from safetensors.torch import load_file
        if not self.kwargs.get("enable_lora"):
            raise ValueError("LoRA is not enabled")
        if "weights" in self.asleep:
            raise RuntimeError("add_lora while the weights sleep: the LoRA buffers are unmapped (verl#7434)")
        self.events.append("add_lora")
        if request.lora_int_id == self.lora_id and not request.load_inplace:
            return True                          # a known id without load_inplace: the loaded adapter stays
        cfg = json.loads(open(os.path.join(request.lora_path, "adapter_config.json")).read())
        if cfg["r"] > self.kwargs["max_lora_rank"]:
            raise ValueError(f"LoRA rank {cfg['r']} is greater than max_lora_rank {self.kwargs['max_lora_rank']}.")
        tensors = load_file(os.path.join(request.lora_path, "adapter_model.safetensors"))
        self.adapted = copy.deepcopy(self.model)
        params = dict(self.adapted.named_parameters())
        for key, a in tensors.items():
            if ".lora_A." in key:
                layer = key.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                params[f"{layer}.weight"] += cfg["lora_alpha"] / cfg["r"] * (b.float() @ a.float())
        self.lora_id = request.lora_int_id
        return True

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self._check(params, lora_request)
        self.events.append(f"generate:{len(prompts)}:T={params[0].temperature:g}")
        self.adapters_used.append(None if lora_request is None else lora_request.lora_int_id)
        model = self.model if lora_request is None else self.adapted
        return [self._one(p["prompt_token_ids"], sp, model) for p, sp in zip(prompts, params)]

    def enqueue(self, prompts, sampling_params, lora_request=None, priority=None, use_tqdm=True):
        """LLM.enqueue: the requests wait for the next llm_engine.step; returns vLLM's internal ids, the external id
        (a counter) with '-' and 8 random characters (v1/engine/input_processor.py:assign_request_id)."""
        self._check(sampling_params, lora_request)
        ids = []
        for prompt, sp in zip(prompts, sampling_params):
            self.queued.append((str(self.request_counter), prompt["prompt_token_ids"], sp, lora_request))
            ids.append(f"{self.request_counter}-{random.Random(self.request_counter).getrandbits(32):08x}")
            self.request_counter += 1
        return ids

    @torch.no_grad()
    def _step(self):
        """llm_engine.step: here every queued request runs to its end in one step, through `generate` (so a test that
        replaces generate replaces the engine; the real engine advances each request by a token a step); outputs
        carry the external request id, finished, one completion each (FINAL_ONLY)."""
        if self.asleep:
            raise RuntimeError(f"an engine step while {sorted(self.asleep)} sleep: vLLM 0.32 would wait forever")
        batch, self.queued = self.queued, []
        if not batch:
            return []
        lora = {"lora_request": batch[0][3]} if batch[0][3] is not None else {}
        outs = self.generate([{"prompt_token_ids": ids} for _, ids, _, _ in batch], [sp for _, _, sp, _ in batch],
                             use_tqdm=False, **lora)
        return [SimpleNamespace(request_id=request_id, finished=True, prompt_token_ids=ids, outputs=out.outputs)
                for (request_id, ids, _, _), out in zip(batch, outs)]

    def _abort_request(self, request_ids, internal=False):
        """llm_engine.abort_request: the requests of these external ids leave the engine (v1/engine/llm_engine.py)."""
        if internal:
            raise NotImplementedError("the stand-in aborts by external id only")
        self.aborted += list(request_ids)
        self.queued = [request for request in self.queued if request[0] not in set(request_ids)]

    def _check(self, params, lora_request):
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} sleep: vLLM 0.32 would wait forever")
        if lora_request is not None and lora_request.lora_int_id != self.lora_id:
            raise ValueError(f"adapter {lora_request.lora_int_id} was not added")
        for sp in params:
            if sp.seed is not None and not INT64[0] <= sp.seed <= INT64[1]:
                raise OverflowError("Python int too large to convert to C long")   # numpy int64 seed array

    def _logits(self, ctx, past, model):
        if self.packed_head is None:
            res = model(input_ids=ctx, use_cache=True, **{self._cache_arg: past})
            return res.logits[0, -1].float(), getattr(res, self._cache_arg)
        res = model.model(input_ids=ctx, use_cache=True, **{self._cache_arg: past})
        return (res.last_hidden_state[0, -1] @ self.packed_head.T).float(), getattr(res, self._cache_arg)

    def _one(self, ids, sp, model):
        gen = torch.Generator().manual_seed(sp.seed % 2**63 if sp.seed is not None else 0)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
        out_ids, logprobs, text = [], [], ""
        finish, stop_reason = "length", None
        ctx = torch.tensor([ids])
        past = None
        for _ in range(sp.max_tokens):
            logits, past = self._logits(ctx, past, model)
            lp = torch.log_softmax(logits, -1)                 # raw log-probs (logprobs_mode="raw_logprobs")
            if sp.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(ids) | set(out_ids)))
                z = logits[seen]
                logits = logits.clone()
                logits[seen] = torch.where(z > 0, z / sp.repetition_penalty, z * sp.repetition_penalty)
            if sp.temperature == 0:
                tok = int(logits.argmax())
            else:
                probs = torch.softmax(logits / sp.temperature, -1)
                sorted_p, order = probs.sort(descending=True)
                keep = sorted_p.cumsum(-1) - sorted_p < sp.top_p
                if sp.top_k > 0:
                    keep[sp.top_k:] = False
                sorted_p[~keep] = 0
                tok = int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
            if sp.logprobs:
                top = lp.topk(sp.logprobs)
                entry = {int(i): Logprob(float(v), r + 1) for r, (v, i) in enumerate(zip(top.values, top.indices))}
                if tok not in entry:
                    entry[tok] = Logprob(float(lp[tok]), int((lp > lp[tok]).sum()) + 1)
                logprobs.append(entry)
                self.stats["logprob_positions"] += 1
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
