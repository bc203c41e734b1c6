"""Peak GPU memory per rank of the paper's setting (FSDP2 over 8 GPUs, vLLM colocated), simulated on a CPU.

    python bench/memory_sim.py                             # Qwen3-14B, Qwen2.5-7B from configs/, 8 ranks (~5 min)
    python bench/memory_sim.py --check cuda --arch JSON    # simulated vs measured: bench/gpu_check.py runs it

How (prior art: torchtitan's memory estimator): the model is built from its configuration (ARCHS: the released
config.json's values, no weights) on the meta device, placed by `harness.run.policy.shard` (FSDP2, bf16 compute, float32
master weights) over a fake process group of 8 ranks and filled with fake tensors (FakeTensorMode: shapes only, nothing
allocated). Rank 0 runs a steady-state step under PyTorch's `FSDPMemTracker`, which counts every tensor's bytes as ops
create and free them: the old-policy pass on one micro-batch; one optimiser mini-batch (its first --micro_batches
micro-batches, then the gradient clip and AdamW's step: from the second micro-batch on, the state at each one's start
repeats); the weight sync (`full_named_parameters` gathered in bf16). The YAML's settings (bf16, fsdp, gradient
checkpointing, the LM head 1024 tokens at a time); every trajectory at the full prompt + response budget, all response
tokens scored, the MicroBatch tensors of all this rank's trajectories held throughout; micro-batches of 1, 4, 8, the
config's and verl's per-GPU budget of rows (ppo_max_token_len_per_gpu = 2 x (prompt + response), use_dynamic_bsz).

Attention as the GPU kernels allocate it: the model runs `flash_allocations_attention`, which allocates and saves
what FlashAttention-2 (SDPA's flash backend, taken by transformers' sdpa path for an unpadded causal batch) does: the
output (B, L, H, D) and a float32 log-sum-exp (B, H, L) in forward; dq, dk, dv, FA2's float32 dq accumulator
(B, L, H, D), softmax_d (B, H, L) and, with grouped KV heads, the expanded dk, dv (B, L, H, D) in backward. No
(L x L) tensor. A padded micro-batch takes sdpa's masked path instead (+ a (B, 1, L, L) boolean mask and its bf16
copy, 3·B·L² bytes, and K, V repeated to all heads): full-length rows have no padding. `StaticSelectPolicy` is
Policy.forward with the mask-1 positions as indices (a fake tensor has no nonzero count; tests/test_bench.py checks
it against Policy).

Phases on a GPU (train.rl_step, harness/generation/vllm.py): rollout (vLLM awake, gpu_memory_utilization x the GPU for
its weights, KV cache and activations, beside the trainer's float32 parameter and AdamW shards) -> sleep at level 2
(vLLM's weights and KV cache freed) -> old-policy pass and update (the trainer alone) -> update_weights (vLLM's
weights woken, every parameter gathered in bf16 and reloaded, then its KV cache woken; vLLM's layer-wise reload,
model_executor/model_loader/reload/layerwise.py:materialize_layer, builds a new copy of each layer it reloads and
copies it into the old storage: the largest parameter in bf16 is added to the sync). Not in the tracker: the CUDA
context, NCCL, a sleeping vLLM's CUDA graphs, fragmentation (NON_TORCH_GIB, an allowance), and vLLM's activations
within its share (the KV cache shown is an upper bound). FSDP2's stream overlap is not simulated (its ops run in order).
"""
import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import loss  # noqa: E402
from harness import config as config_mod, lora as lora_mod  # noqa: E402
from harness.run.policy import (MicroBatch, Policy, enable_gradient_checkpointing, generator_weights,  # noqa: E402
                                shard, trainable_parameters)
from train import OldPolicy  # noqa: E402

# huggingface.co/Qwen/Qwen3-14B and /Qwen/Qwen2.5-7B-Instruct, config.json (14.77B and 7.62B parameters)
ARCHS = {
    "Qwen/Qwen3-14B": ("qwen3", dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, head_dim=128,
                                     num_attention_heads=40, num_key_value_heads=8, vocab_size=151936,
                                     tie_word_embeddings=False)),
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                               tie_word_embeddings=False)),             # head_dim 3584 / 28 = 128
}
CONFIGS = ["configs/aepo_qwen3_14b.yaml", "configs/aepo_qwen25_7b.yaml"]
GPUS = {"80 GB": 81559 * 2**20, "141 GB": 143771 * 2**20}      # total memory nvidia-smi reports: H100 80GB, H200
SMALL_GPUS = {"24 GB": 24564 * 2**20, "48 GB": 49140 * 2**20}   # ... RTX 4090, RTX A6000
LORA_GPUS = {"Qwen/Qwen3-14B": ["80 GB", "141 GB"], "Qwen/Qwen2.5-7B-Instruct": ["24 GB", "48 GB", "80 GB", "141 GB"]}
LORA_CONFIG = "configs/lora.yaml"        # the LoRA rows: that overlay on each official config, one GPU
NON_TORCH_GIB = 2.0       # CUDA context, NCCL, a sleeping vLLM's CUDA graphs, fragmentation: an allowance
ATTENTION = "memsim_fa2_allocations"     # a name with "flash" in it makes transformers look for a kernel
GIB = 2**30
WORLD = 8                 # GPUs of the paper's runs (one node)
VERL_ROWS = 2             # verl's ppo_max_token_len_per_gpu = 2 x (prompt + response): two full-length rows


@dataclasses.dataclass
class Setting:
    """One rank's step: world ranks, micro-batches of `batch` rows of prompt + response tokens."""
    world: int
    batch: int
    prompt: int
    response: int
    trajectories: int                  # this rank's trajectories in the step (their MicroBatch tensors are held)
    micro_batches: int = 2             # micro-batches of the mini-batch simulated
    chunk: int = 1024                  # the LM head's chunk (harness/run/policy.Policy)
    lora: lora_mod.LoraSettings | None = None   # adapters on a frozen bfloat16 base (harness/lora.py)


# ---------------------------------------------------------------------------------------------------------------------
# Attention as FlashAttention-2 allocates it, the policy with static selection, the tracker


class _FlashAllocations(torch.autograd.Function):
    """The tensors FlashAttention-2 allocates and saves (see the module docstring); values are never computed."""

    @staticmethod
    def forward(ctx, query, key, value):
        b, h, length, d = query.shape                                  # (B, H, L, D), key/value (B, H_kv, L, D)
        out = query.new_empty(b, length, h, d)
        lse = query.new_empty(b, h, length, dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        (b, h, length, d), h_kv = query.shape, key.shape[1]
        dq_accum = query.new_empty(b, length, h, d, dtype=torch.float32)      # noqa: F841 (held until return)
        softmax_d = query.new_empty(b, h, length, dtype=torch.float32)        # noqa: F841
        grad_q = torch.empty_like(query)
        if h_kv == h:
            return grad_q, torch.empty_like(key), torch.empty_like(value)
        expanded = [query.new_empty(b, length, h, d) for _ in "kv"]           # dk, dv per query head, then summed
        return grad_q, *(e.view(b, length, h_kv, h // h_kv, d).sum(3).transpose(1, 2) for e in expanded)


def flash_allocations_attention(module, query, key, value, attention_mask, **kwargs):
    """A transformers attention function (causal, unpadded) for fake tensors only: returns (B, L, H, D), None."""
    if not isinstance(query, FakeTensor):
        raise RuntimeError("flash_allocations_attention computes no values: it is for fake tensors (memory_sim)")
    return _FlashAllocations.apply(query, key, value), None


class StaticSelectPolicy(Policy):
    """Policy.forward with the mask-1 positions as (rows, cols) index tensors, each (N,), instead of the (B, L-1) mask
    (whose nonzero count a fake tensor cannot give): the same (N, D) selection, chunked LM head and (B, L-1) outputs."""

    def forward(self, input_ids, attention_mask, index, temperature: float = 1.0, chunk_size: int = 1024):
        hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        with torch.autocast(hidden.device.type, enabled=False):      # the LM head in float32, as Policy.forward
            logp_sel, entropy_sel = loss.logprobs_and_entropy(
                hidden[:, :-1][index], self.lm.get_output_embeddings().weight, input_ids[:, 1:][index], temperature,
                chunk_size)
        logp = torch.zeros(shape, dtype=torch.float32, device=hidden.device).index_put(index, logp_sel)
        entropy = torch.zeros(shape, dtype=torch.float32, device=hidden.device).index_put(index, entropy_sel)
        return logp, entropy


_PROPAGATE = ShardingPropagator._propagate_tensor_meta_non_cached


class Tracker(FSDPMemTracker):
    """FSDPMemTracker without DTensor's sharding propagation: under FakeTensorMode DTensor infers an op's output shape
    by running it once on global-shape tensors in the same fake mode, which the tracker would count as allocations
    (an AdamW step read as 13x its state). While a Tracker is active those calls are marked and not counted."""
    propagating = 0

    def __enter__(self):
        ShardingPropagator._propagate_tensor_meta_non_cached = _marked_propagate
        return super().__enter__()

    def __exit__(self, *args):
        ShardingPropagator._propagate_tensor_meta_non_cached = _PROPAGATE
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if Tracker.propagating:
            return NotImplemented if any(t is DTensor for t in types) else func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _marked_propagate(self, op_schema):
    Tracker.propagating += 1
    try:
        return _PROPAGATE(self, op_schema)
    finally:
        Tracker.propagating -= 1


# ---------------------------------------------------------------------------------------------------------------------
# One rank's step


def build_policy(family: str, arch: dict, attention: str, lora=None) -> StaticSelectPolicy:
    """The LM on the meta device (float32; with LoRA a bfloat16 base and float32 adapters, as load_policy builds it),
    gradient checkpointing on, sharded by harness.run.policy.shard (bf16)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, Qwen2Config, Qwen3Config
    AttentionInterface.register(ATTENTION, flash_allocations_attention)
    config = {"qwen3": Qwen3Config, "qwen2": Qwen2Config}[family](**arch, attn_implementation=attention)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if lora else torch.float32)
    enable_gradient_checkpointing(lm)
    if lora:
        with torch.device("meta"):
            lm = lora_mod.add_adapters(lm, lora)
    return shard(StaticSelectPolicy(lm), bf16=True)


def step_inputs(setting: Setting, device) -> list:
    """This rank's micro-batches at the full budget: MicroBatch's (B, L) int64 and (B, L-1) float32 tensors, the
    old-policy pass's (train.OldPolicy: those a run without a reference model holds) and the index of the scored
    (response) positions."""
    b, length = setting.batch, setting.prompt + setting.response
    per_row = [f.name for f in dataclasses.fields(MicroBatch) if f.name not in ("input_ids", "attention_mask",
                                                                                  "reward")]
    rows = torch.arange(b, device=device).repeat_interleave(setting.response)
    cols = (setting.prompt - 1 + torch.arange(setting.response, device=device)).repeat(b)
    batches = []
    for _ in range(math.ceil(setting.trajectories / b)):
        mb = MicroBatch(torch.zeros(b, length, dtype=torch.long, device=device),
                        torch.ones(b, length, dtype=torch.long, device=device), None)
        for name in per_row:
            setattr(mb, name, torch.zeros(b, length - 1, device=device))
        old = OldPolicy(old_logp=torch.zeros(b, length - 1, device=device),
                        entropy=torch.zeros(b, length - 1, device=device), ref_logp=None,
                        adv_tilde=torch.zeros(b, length - 1, device=device))
        batches.append((mb, old, (rows, cols)))
    return batches


def surrogate_loss(logp, mb: MicroBatch, old: OldPolicy, n_valid: float):
    """loss.policy_loss's token-level tensors (it checks its inputs for non-finite values, which fake tensors cannot
    answer): r = exp(logp - old_logp) at mask-1 tokens, J = min(r·Ã, clip(r, 0.8, 1.2)·Ã), -Σ J·mask / N_valid."""
    ratio = torch.exp(torch.where(mb.mask.bool(), logp - old.old_logp, 0.0))
    j = torch.minimum(ratio * old.adv_tilde, ratio.clamp(0.8, 1.2) * old.adv_tilde)
    return -(j * mb.mask).sum() / n_valid


def run_step(policy, optimizer, batches, setting: Setting, phase) -> dict:
    """The steady-state step's trainer phases; phase(name, peaks) records the phase's peak bytes and yields a callback
    for between micro-batches. Returns {name: peak} and "resident" (what the trainer holds while vLLM generates)."""
    device = batches[0][0].input_ids.device
    for p in trainable_parameters(policy):             # AdamW's state exists from the first step on
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    peaks = {}
    mb, old, index = batches[0]
    with phase("old-policy pass", peaks):
        policy.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            old.old_logp, old.entropy = policy(mb.input_ids, mb.attention_mask, index, 1.0, setting.chunk)
    with phase("update", peaks) as between:
        policy.lm.train()
        n_valid = float(setting.response * setting.batch * setting.micro_batches)
        for mb, old, index in batches[:setting.micro_batches]:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logp, entropy = policy(mb.input_ids, mb.attention_mask, index, 1.0, setting.chunk)
            (surrogate_loss(logp, mb, old, n_valid) * setting.world).backward()
            del logp, entropy
            between()
        torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.grad is not None], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peaks["resident"] = peaks.pop("update:current")
    with phase("weight sync", peaks):          # every parameter gathered in bf16 (vLLM's dtype), or the adapters
        for _, full in generator_weights(policy, dtype=torch.bfloat16):
            del full
    return {key: value for key, value in peaks.items() if not key.endswith(":current")}


def tracker_phase(policy, optimizer, inputs):
    """phase() for a tracker run: a fresh FSDPMemTracker per phase, this rank's step tensors as its inputs."""
    @contextlib.contextmanager
    def phase(name, peaks):
        tracker = Tracker(policy, optimizer)
        tracker.track_inputs(tuple(t for mb, old, index in inputs
                                   for t in (*vars(mb).values(), *vars(old).values(), *index)
                                   if isinstance(t, torch.Tensor)))
        with tracker:
            yield tracker.reset_mod_stats                  # one root forward per micro-batch
        (categories,) = tracker.get_tracker_snapshot("peak").values()             # one device
        peaks[name], peaks[name + ":categories"] = categories["Total"], {
            getattr(key, "value", key): value for key, value in categories.items() if key != "Total"}
        peaks[name + ":current"] = sum(s["Total"] for s in tracker.get_tracker_snapshot("current").values())
    return phase


@contextlib.contextmanager
def cuda_phase(name, peaks):
    """phase() on a GPU: the caching allocator's own peak (torch.cuda.max_memory_allocated)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    yield lambda: None
    torch.cuda.synchronize()
    peaks[name], peaks[name + ":current"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()


def simulate(family: str, arch: dict, setting: Setting, device: str = "fake") -> dict:
    """Peak bytes per phase of rank 0. device: "fake" (fake tensors, fake process group of setting.world, the
    attention's allocations as FlashAttention-2's), or "cpu" / "cuda" (real tensors of unset values, one process,
    transformers' sdpa attention; measured by the tracker on the CPU, by the allocator on a GPU)."""
    if dist.is_initialized():
        raise RuntimeError("simulate needs its own process group: run it where none is initialised")
    fake = device == "fake"
    if not fake and setting.world != 1:
        raise ValueError("a real run is one process: world must be 1")
    if device == "cuda":
        torch.cuda.set_device(0)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group({"fake": "fake", "cpu": "gloo", "cuda": "nccl"}[device], rank=0, world_size=setting.world,
                            store=FakeStore() if fake else dist.HashStore())
    try:
        policy = build_policy(family, arch, ATTENTION if fake else "sdpa", setting.lora)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            policy.to_empty(device="cpu" if fake else device)
            optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=1e-6, weight_decay=0.01,
                                          foreach=True)  # CUDA's
            batches = step_inputs(setting, "cpu" if fake else device)
            phase = cuda_phase if device == "cuda" else tracker_phase(policy, optimizer, batches)
            peaks = run_step(policy, optimizer, batches, setting, phase)
            peaks["params"] = sum(p.numel() for p in policy.parameters())
            peaks["largest"] = max(p.numel() for p in policy.parameters())
            peaks["trained"] = sum(p.numel() for p in trainable_parameters(policy))
        return peaks
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# The paper's settings and the table


def paper_settings(config_path: str, world: int, micro_batches: int):
    """(cfg, [Setting]) of one rank's step per micro-batch size: the config's, verl's and 1, 4 and 8 rows."""
    cfg = config_mod.parse_config(["--config", str(ROOT / config_path)])
    if not (cfg.model in ARCHS and cfg.bf16 and cfg.parallel == "fsdp" and cfg.gradient_checkpointing
            and cfg.kl_coef == 0):
        raise ValueError(f"{config_path}: the simulation knows the models of ARCHS, with bf16, fsdp, gradient "
                         f"checkpointing and no reference model")
    per_rank, mini = cfg.questions_per_step * cfg.k // world, cfg.mini_batch_size * cfg.k // world
    return cfg, [Setting(world, b, cfg.max_prompt_tokens, cfg.max_response_tokens, per_rank,
                         min(micro_batches, math.ceil(mini / b)), 1024)
                 for b in sorted({1, cfg.micro_batch_size, VERL_ROWS, 4, 8})]


def report(cfg, arch, results: list[tuple[Setting, dict]]) -> tuple[list, list, list]:
    """Rows of the fits table (a phase's trainer peak, vLLM's memory, the total and verdict per GPU), of the settings
    that fit per GPU, and lines of the update peak's categories."""
    setting1, peaks1 = results[0]
    u, length, name = cfg.vllm_gpu_memory_utilization, setting1.prompt + setting1.response, cfg.model.split("/")[-1]
    head_dim = arch.get("head_dim") or arch["hidden_size"] // arch["num_attention_heads"]
    kv_token = 2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * head_dim * 2      # K and V, bf16
    weights, allowance = 2 * peaks1["params"], NON_TORCH_GIB * GIB                            # vLLM's, bf16
    reload = 2 * peaks1["largest"]           # vLLM's layer-wise reload: a new bf16 copy of the layer it reloads
    phases = [(f"rollout (vLLM awake at {u})", "—", peaks1["resident"], lambda g: u * g)]
    for setting, peaks in results:
        rows = f"{setting.batch} x {length:,}"
        phases += [("old-policy pass (vLLM asleep)", rows, peaks["old-policy pass"], lambda g: 0),
                   (f"update: {setting.micro_batches} micro-batch(es) + AdamW (vLLM asleep)", rows, peaks["update"],
                    lambda g: 0)]
    phases.append(("weight sync (vLLM weights awake, + a reloaded layer)", "—", peaks1["weight sync"],
                   lambda g: weights + reload))
    fits = []
    for phase, rows, trainer, vllm in phases:
        totals = [trainer + vllm(g) + allowance for g in GPUS.values()]
        verdicts = [f"{t / GIB:.1f}: {'fits' if t <= g else '**does not fit**'}" for t, g in zip(totals, GPUS.values())]
        fits.append([name, str(setting1.world), phase, rows, f"{trainer / GIB:.1f}",
                     " / ".join(f"{vllm(g) / GIB:.1f}" for g in GPUS.values()), *verdicts])
    settings = []
    for label, g in GPUS.items():
        most_rows = max((s.batch for s, p in results if max(p["old-policy pass"], p["update"]) + allowance <= g),
                        default=0)
        u_min = (weights + kv_token * length) / g                               # vLLM's floor: one full sequence
        u_max = (g - peaks1["resident"] - allowance) / g if weights + reload + peaks1["weight sync"] + allowance <= g \
            else 0.0
        kv = u * g - weights
        settings.append([name, label, f"{most_rows} x {length:,} ({most_rows * length:,} tokens)" if most_rows > 0
                         else "none", f"{math.ceil(u_min * 100) / 100:.2f}–{math.floor(u_max * 100) / 100:.2f}"
                         if u_min <= u_max else "none",
                         f"{kv / GIB:.1f} GiB = {kv / kv_token / length:.1f} trajectories" if kv > 0 else "none"])
    breakdown = [f"{name} {setting.batch} x {length:,}: update peak {peaks['update'] / GIB:.1f} GiB = " + " + ".join(
        f"{key} {value / GIB:.1f}" for key, value in peaks["update:categories"].items() if value >= 0.05 * GIB)
        for setting, peaks in results]
    return fits, settings, breakdown


def lora_settings(config_path: str, micro_batches: int):
    """(cfg, [Setting]) of configs/lora.yaml over an official config on one GPU: every trajectory of the step on it,
    micro-batches of 1 row, the config's and verl's."""
    cfg = config_mod.parse_config(["--config", str(ROOT / config_path), "--config", str(ROOT / LORA_CONFIG)])
    lora = lora_mod.LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, tuple(cfg.lora_target_modules))
    per_gpu, mini = cfg.questions_per_step * cfg.k, cfg.mini_batch_size * cfg.k
    return cfg, [Setting(1, b, cfg.max_prompt_tokens, cfg.max_response_tokens, per_gpu,
                         min(micro_batches, math.ceil(mini / b)), 1024, lora)
                 for b in sorted({1, cfg.micro_batch_size, VERL_ROWS})]


def lora_report(cfg, arch, results: list[tuple[Setting, dict]]) -> list[list[str]]:
    """Rows of the LoRA table: per GPU of LORA_GPUS and micro-batch, the trainer's phases, whether it fits without
    vLLM (the transformers backend: its generation's KV cache is not simulated) and the
    --vllm_gpu_memory_utilization range that fits with vLLM colocated (its bf16 base weights and KV cache in its
    share while it generates; asleep at level 1, weights offloaded to the CPU, while the trainer updates; its weights
    back for the adapter's sync)."""
    name = cfg.model.split("/")[-1]
    length = results[0][0].prompt + results[0][0].response
    head_dim = arch.get("head_dim") or arch["hidden_size"] // arch["num_attention_heads"]
    kv_token = 2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * head_dim * 2      # K and V, bf16
    allowance, gpus = NON_TORCH_GIB * GIB, {**SMALL_GPUS, **GPUS}
    rows = []
    for label in LORA_GPUS[cfg.model]:
        g = gpus[label]
        for setting, peaks in results:
            weights = 2 * (peaks["params"] - peaks["trained"])                  # vLLM's copy of the base, bf16
            training = max(peaks["old-policy pass"], peaks["update"])
            alone = max(training, peaks["weight sync"], peaks["resident"]) + allowance
            u_min = (weights + kv_token * length) / g
            u_max = (g - peaks["resident"] - allowance) / g
            ok = training + allowance <= g and peaks["weight sync"] + weights + allowance <= g and u_min <= u_max
            kv = u_max * g - weights
            rows.append([name, label, f"{setting.batch} x {length:,}",
                         " / ".join(f"{peaks[k] / GIB:.1f}" for k in ("resident", "old-policy pass", "update",
                                                                       "weight sync")),
                         f"{alone / GIB:.1f}: " + ("fits" if alone <= g else "**does not fit**"),
                         f"{math.ceil(u_min * 100) / 100:.2f}–{math.floor(u_max * 100) / 100:.2f} (KV cache up to "
                         f"{kv / GIB:.1f} GiB = {kv / kv_token / length:.1f} trajectories)" if ok
                         else "**does not fit**"])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def check(device: str, arch: dict, quick: bool) -> dict:
    """Simulated (fake tensors) vs measured (real tensors on `device`) peaks per phase, one process, a Qwen3 of `arch`:
    {phase: {"simulated", "measured", "ratio" (measured / simulated)}}."""
    setting = Setting(world=1, batch=2, prompt=64 if quick else 1024, response=192 if quick else 3072, trajectories=4,
                      chunk=64 if quick else 1024)
    fake, real = simulate("qwen3", arch, setting, "fake"), simulate("qwen3", arch, setting, device)
    return {key: {"simulated": fake[key], "measured": real[key], "ratio": real[key] / fake[key]}
            for key in ("old-policy pass", "update", "resident", "weight sync")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro_batches", type=int, default=2, help="micro-batches of the mini-batch simulated")
    parser.add_argument("--check", choices=["cpu", "cuda"], help="simulated vs measured peaks on a small model")
    parser.add_argument("--arch", help="--check: the Qwen3 shape as JSON (bench/gpu_check.py passes its model's)")
    parser.add_argument("--quick", action="store_true", help="--check: short sequences and a small vocabulary")
    parser.add_argument("--only", choices=["paper", "lora"], help="only the paper's setting (8 GPUs) or the LoRA rows")
    args = parser.parse_args()
    if args.check:
        if not args.arch:
            parser.error("--check needs --arch")
        arch = {"tie_word_embeddings": True, "vocab_size": 4096 if args.quick else 151936, **json.loads(args.arch)}
        print(json.dumps(check(args.check, arch, args.quick)))
        return
    t0, tables = time.time(), ([], [], [])
    if args.only != "lora":
        paper_tables(args, tables, t0)
    if args.only != "paper":
        lora_table(args, t0)
    print(f"\n{time.time() - t0:.0f} s")


def simulate_all(cfg, runs: list[Setting], t0: float, label: str = "") -> list[tuple[Setting, dict]]:
    """(setting, simulate's peaks) of each of a config's settings, a progress line each."""
    family, arch = ARCHS[cfg.model]
    results = []
    for setting in runs:
        results.append((setting, simulate(family, arch, setting)))
        print(f"[memory_sim] {label}{cfg.model}, {setting.batch} x {setting.prompt + setting.response}: "
              f"{time.time() - t0:.0f} s", flush=True)
    return results


def lora_table(args, t0) -> None:
    """configs/lora.yaml over each official config on one GPU, printed."""
    rows = []
    for path in CONFIGS:
        cfg, runs = lora_settings(path, args.micro_batches)
        rows += lora_report(cfg, ARCHS[cfg.model][1], simulate_all(cfg, runs, t0, "LoRA "))
    print(f"\nLoRA (configs/lora.yaml: rank {cfg.lora_rank} on {', '.join(cfg.lora_target_modules)}; a bfloat16 base)"
          f" on one GPU at the official token budgets; totals add {NON_TORCH_GIB} GiB; 24 GB = "
          f"{SMALL_GPUS['24 GB'] / GIB:.1f} GiB, 48 GB = {SMALL_GPUS['48 GB'] / GIB:.1f} GiB:\n")
    print(markdown(["model", "GPU", "micro-batch", "trainer GiB: rollout / old-policy pass / update / sync",
                    "without vLLM: peak GiB", "with vLLM: --vllm_gpu_memory_utilization that fits"], rows))


def paper_tables(args, tables, t0) -> None:
    """The paper's setting: each official config over 8 GPUs (FSDP2), printed."""
    for path in CONFIGS:
        cfg, runs = paper_settings(path, WORLD, args.micro_batches)
        for table, rows in zip(tables, report(cfg, ARCHS[cfg.model][1], simulate_all(cfg, runs, t0))):
            table += rows
    print(markdown(["model", "GPUs", "phase", "micro-batch", "trainer peak / rank GiB", "vLLM GiB (80 / 141 GB)",
                    "total GiB on 80 GB", "total GiB on 141 GB"], tables[0]))
    print(f"\nTotals add {NON_TORCH_GIB} GiB not in PyTorch's tracker (CUDA context, NCCL, fragmentation); 80 GB = "
          f"{GPUS['80 GB'] / GIB:.1f} GiB, 141 GB = {GPUS['141 GB'] / GIB:.1f} GiB.\n")
    print(markdown(["model", "GPU", "largest simulated micro-batch that fits",
                    "--vllm_gpu_memory_utilization that fits", "vLLM's KV cache at the config's (at most)"],
                   tables[1]))
    print("\n" + "\n".join(tables[2]))


if __name__ == "__main__":
    main()
