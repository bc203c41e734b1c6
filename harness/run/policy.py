"""The policy LM as one torch module, loaded and placed on 1..N processes (DDP or FSDP2).

The training side (paper §3.3; algorithm.md §1) needs log π(y_t) of every policy-sampled token (the ratio of
algorithm.md §4) and the token entropy H_t over the full vocabulary (the entropy-aware advantage of algorithm.md §3b).
`Policy.forward` computes both in one pass, only at those tokens, through `loss.logprobs_and_entropy` (chunked,
float32), so data-parallel hooks fire on every pass.

Placement: one process holds the whole model; DDP replicates it; FSDP2 (`fully_shard` per decoder layer, the rest in
the root group) shards parameters, gradients and optimiser state. A sharded model is built on the meta device and
filled from rank 0's copy of the checkpoint (`broadcast_from_rank0`), read in the checkpoint's own dtype (bfloat16
for released models), so no rank but 0 ever holds the full model. Parameters stay float32 (the optimiser's master
weights); `--bf16` computes in bfloat16 (FSDP2 mixed precision, autocast elsewhere). With LoRA (harness/lora.py) the
model carries peft's adapters, the only trained (float32) parameters, over a frozen base. Also here: the inputs' layout
(`MicroBatch`, `tensorize`: padded ids and the loss mask), the cold start's forward/backward over a mini-batch's
micro-batches (`backward_micro_batches`; `located` says where an error happened) and the optimiser step
(gradient-norm clip over shards).

Deviations from the paper / official code (algorithm.md §8): D41 (under FSDP2 every micro-batch reduce-scatters its
gradients: only DDP skips the sync until the last, since skipping it under FSDP2 keeps whole unsharded float32
gradients on every rank).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import loss
from harness import packing
from harness.run import parallel, watchdog
from harness.cli import UserError
from harness.lora import ADAPTER, LoraSettings, adapter_weights, add_adapters, is_lora, merged_weights
from harness.models import load_lm


class Policy(torch.nn.Module):
    """Wraps a causal LM. forward(input_ids (B, L), attention_mask (B, L), mask (B, L-1)) -> (logp, entropy),
    both (B, L-1) float32: log π(input_ids[:, t+1] | input_ids[:, :t+1]) and the token entropy H_t (algorithm.md §1) at
    positions where mask is 1, 0 elsewhere. Only masked positions go through the LM head (loss.logprobs_and_entropy,
    chunked), so prompts and tool results cost no (T, V) logits. packed (asked for, and decided here once: where
    packing.supported, its attention registered with transformers now): every forward runs the decoder on the rows'
    real tokens in one row, each trajectory attending to itself only and each prefix the rows share computed once
    (harness/packing.py; share_prefixes=False: none), the same values up to rounding with no padding computed; else
    on the padded rows. `self.packed` says which."""

    def __init__(self, lm, packed: bool = False, share_prefixes: bool = True):
        super().__init__()
        self.lm, self.share_prefixes = lm, share_prefixes
        self.packed = packed and packing.supported(lm.get_decoder().config)
        if self.packed:
            packing.use_packed_attention(lm.get_decoder())

    def forward(self, input_ids, attention_mask, mask, temperature: float = 1.0, chunk_size: int = 1024):
        decoder, sel = self.lm.get_decoder(), mask.bool()
        if self.packed:
            ids, position_ids, layout = packing.pack_shared(input_ids, attention_mask, share=self.share_prefixes)
            hidden = decoder(input_ids=ids, position_ids=position_ids, attention_mask=torch.ones_like(ids),
                             **layout.kwargs()).last_hidden_state
            hidden_sel = layout.unpack(hidden, sel)
        else:
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            hidden_sel = hidden[:, :-1][sel]
        with torch.autocast(hidden.device.type, enabled=False):      # the LM head in float32 (algorithm.md §1)
            logp_sel, entropy_sel = loss.logprobs_and_entropy(
                hidden_sel, self.lm.get_output_embeddings().weight, input_ids[:, 1:][sel], temperature, chunk_size)
        logp = torch.zeros(sel.shape, dtype=torch.float32, device=hidden.device).masked_scatter(sel, logp_sel)
        entropy = torch.zeros(sel.shape, dtype=torch.float32, device=hidden.device).masked_scatter(sel, entropy_sel)
        return logp, entropy


def unwrap(policy) -> Policy:
    return policy.module if isinstance(policy, torch.nn.parallel.DistributedDataParallel) else policy


def is_sharded(policy) -> bool:
    """Placed by FSDP2 (its parameters are DTensors), on any number of processes."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(unwrap(policy), FSDPModule)


@contextlib.contextmanager
def params_on_meta():
    """Modules built inside get their parameters on the meta device (no memory) and their buffers for real (rotary
    frequencies are computed in __init__ and are in no checkpoint)."""
    register = torch.nn.Module.register_parameter

    def to_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def shard(policy: Policy, bf16: bool) -> Policy:
    """FSDP2: every decoder layer its own shard group, the rest (embeddings, final norm, LM head) in the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    lm = policy.lm
    block_names = set(getattr(lm, "_no_split_modules", None) or [])
    blocks = [m for m in lm.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"fsdp: found no decoder layers in {type(lm).__name__} (its _no_split_modules is empty)")
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(policy, mp_policy=mp)
    return policy


def load_policy(path: str, world: int, device, parallel: str = "ddp", bf16: bool = False, rank: int = 0,
                gradient_checkpointing: bool = False, lora: LoraSettings | None = None, seed: int = 0,
                packed: bool = False):
    """The Policy around the model at `path`, float32 parameters, placed for `world` processes: no process group ->
    plain; ddp -> DistributedDataParallel (each rank loads the whole model; plain with one process); fsdp with a
    process group (also of one process: `torchrun --nproc_per_node=1`) -> FSDP2-sharded, built on the meta device and
    filled from rank 0's copy (read in the checkpoint's dtype), so only rank 0 ever reads the weights file. A
    collective under FSDP2: every rank calls it. gradient_checkpointing: recompute activations in backward. lora:
    adapters on the model (harness/lora.py; A drawn with `seed`) in float32, the model's own weights frozen, and in
    bfloat16 with bf16 (nothing updates them: they need no float32 master copy). packed: the padding-free forward
    where the model supports it (Policy; decided here, once)."""
    base_dtype = torch.bfloat16 if lora and bf16 else torch.float32
    if parallel == "ddp" or not torch.distributed.is_initialized():
        lm = load_lm(path, device, base_dtype)
        if gradient_checkpointing:
            enable_gradient_checkpointing(lm)
        policy = Policy(add_adapters(lm, lora, seed) if lora else lm, packed).eval()   # peft: dropout in train mode
        if world == 1:
            return policy
        return torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device.index] if device.type == "cuda"
                                                         else None)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as err:
        raise UserError(f"could not load the model {path}: {' '.join(str(err).split())[:200]}") from None
    with params_on_meta():
        lm = AutoModelForCausalLM.from_config(config, dtype=base_dtype)
    try:                                         # from_config derives one from config.json (Qwen3: 1 EOS id of 2)
        lm.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass                                     # the model has none: keep the derived one
    if gradient_checkpointing:
        enable_gradient_checkpointing(lm)
    if lora:
        with params_on_meta():
            lm = add_adapters(lm, lora, seed)
    buffers = {name: b.clone() for name, b in lm.named_buffers()}
    policy = shard(Policy(lm, packed), bf16)
    policy.to_empty(device=device)               # this rank's shards; buffers need their values again
    with torch.no_grad():
        for name, b in policy.lm.named_buffers():
            b.copy_(buffers[name])
    full = {}
    if rank == 0:                                 # the checkpoint's own dtype: bf16 for most released models
        full_lm = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
        full = {f"lm.{k}": v for k, v in (add_adapters(full_lm, lora, seed) if lora else full_lm).state_dict().items()}
    set_model_state_dict(policy, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    return policy.eval()


@dataclass
class MicroBatch:
    """The trajectories of one forward/backward, right-padded to the longest. `tensorize` builds it (input_ids,
    attention_mask: (b, L); mask: (b, L-1), 1 where the *next* token was sampled by the policy, i.e. is scored; adv:
    (b, L-1) the per-token outcome advantage A; reward: (b,) R_j; gen_logp: (b, L-1) the generator's log-probs,
    nan where it has none). What the old-policy pass computes of it is its own (train.old_policy_pass returns a
    train.OldPolicy per micro-batch). misfit: rows whose generator log-probs had another length than the response
    (left nan, counted)."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor | None = None
    reward: torch.Tensor | None = None
    gen_logp: torch.Tensor | None = None
    misfit: int = 0


def tensorize(items: list[tuple[list[int], list[int], list[int]]], pad_id: int, device, adv=None,
              reward=None, gen_logp=None) -> MicroBatch:
    """items: (prompt_ids, response_ids, loss_mask) per trajectory -> a MicroBatch on `device`. adv: (b, W >= L-1)
    per-token advantages in the layout of a wider tensorize of the same trajectories (cut to this one's width);
    reward: (b,); gen_logp: per trajectory the generator's log-prob of each response token, or None (nan then)."""
    width = max(len(p) + len(r) for p, r, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    mask = torch.zeros((len(items), width - 1), dtype=torch.float32)
    gen = torch.full((len(items), width - 1), float("nan"), dtype=torch.float32)
    misfit = 0
    for i, (p, r, m) in enumerate(items):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = 1
        mask[i, len(p) - 1:len(p) - 1 + len(r)] = torch.tensor(m, dtype=torch.float32)
        if gen_logp is not None and gen_logp[i]:       # None or [] : the generator gave none
            if len(gen_logp[i]) == len(r):
                gen[i, len(p) - 1:len(p) - 1 + len(r)] = torch.tensor(gen_logp[i], dtype=torch.float32)
            else:                                # a generator bug: counted (mismatch/misfit_rows) and warned
                misfit += 1
    return MicroBatch(ids.to(device), attn.to(device), mask.to(device),
                      adv=None if adv is None else adv[:, :width - 1].to(device),
                      reward=None if reward is None else reward.to(device),
                      gen_logp=None if gen_logp is None else gen.to(device), misfit=misfit)


def micro_batches(trajectories, adv: torch.Tensor, rewards: torch.Tensor, n_minibatches: int, cfg, pad_id: int,
                  device, packed: bool = False):
    """This rank's trajectories (ordered by question) in n_minibatches mini-batches of whole questions, each in
    micro-batches (`split_micro_batches`) with their (N, W) per-token advantages A (outcome_advantages) and (N,)
    rewards. Every rank gets as many micro-batches as the rank with the most, in each mini-batch (`even_out`; a
    collective): FSDP2 runs collectives in every pass, so unequal counts would leave ranks waiting for ever.
    packed: the forward runs padding-free (token budgets count real tokens). Returns a list (per mini-batch) of lists
    of MicroBatch."""
    per_mini = len(trajectories) // n_minibatches
    splits = []
    for j in range(n_minibatches):
        chunk = list(range(j * per_mini, (j + 1) * per_mini))
        lengths = [len(trajectories[i].prompt_ids) + len(trajectories[i].response_ids) for i in chunk]
        splits.append(split_micro_batches(chunk, lengths, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch,
                                          packed))
    counts = parallel.all_reduce_max(torch.tensor([len(groups) for groups in splits])).tolist()
    out = []
    for groups, count in zip(splits, counts):
        mbs = []
        for idx in even_out(groups, count):
            items = [(trajectories[i].prompt_ids, trajectories[i].response_ids, trajectories[i].loss_mask) for i in idx]
            mbs.append(tensorize(items, pad_id, device, adv=adv[idx], reward=rewards[idx],
                                 gen_logp=[trajectories[i].gen_logp for i in idx]))
        out.append(mbs)
    return out


def even_out(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` made `count` long: the micro-batch with the most trajectories is halved (its first half keeps the
    shorter ones, as split_micro_batches sorted them) until there are `count`. Every rank holds as many trajectories
    per mini-batch (whole questions of k each), so the count of any rank is reachable. Smaller micro-batches stay
    within any token budget; N_valid, the loss and the gradient are unchanged."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        at = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[at]) < 2:
            raise ValueError(f"{sum(map(len, groups))} trajectories cannot fill the {count} micro-batches of another "
                             f"rank (every rank needs as many trajectories per mini-batch)")
        half = len(groups[at]) // 2
        groups[at:at + 1] = [groups[at][:half], groups[at][half:]]
    return groups


def pad_share(batches: list[list], packed: bool = False) -> float:
    """The share of the positions the forward and backward passes compute that are padding, over all ranks: rows ×
    the longest row per micro-batch, or with packed (the padding-free forward ran: Policy.packed) the real ones only."""
    sums = torch.tensor([[mb.attention_mask.sum().item() if packed else mb.attention_mask.numel(),
                          mb.attention_mask.sum().item()] for mbs in batches for mb in mbs], dtype=torch.float64).sum(0)
    total, real = parallel.all_reduce_sum(sums).tolist()
    return 1.0 - real / total if total else 0.0


def split_micro_batches(indices: list[int], lengths: list[int], size: int, max_tokens: int,
                        packed: bool = False) -> list[list[int]]:
    """A mini-batch's trajectories in micro-batches: `size` at a time in their order, or (max_tokens > 0) sorted by
    length and packed greedily so that the tokens a forward computes stay within max_tokens: rows × the longest row's
    length, or with packed (the padding-free forward) their real tokens, verl's rule (a trajectory longer than that is
    a micro-batch of its own). The loss divides by the mini-batch's global token count (D18), so the
    split changes no gradient beyond rounding, only the padding a forward pass computes."""
    if max_tokens <= 0:
        return [indices[s:s + size] for s in range(0, len(indices), size)]
    out, current, longest, total = [], [], 0, 0
    for length, i in sorted(zip(lengths, indices)):
        cost = total + length if packed else (len(current) + 1) * max(longest, length)
        if current and cost > max_tokens:
            out.append(current)
            current, longest, total = [], 0, 0
        current.append(i)
        longest, total = max(longest, length), total + length
    return out + ([current] if current else [])


@contextlib.contextmanager
def located(where: str):
    """Where the block is, said twice: a ValueError raised inside (non-finite inputs in loss.py, a bad shape) reads
    `where: ...`, and the watchdog names it if it lasts (a forward and backward whose FSDP2 all-gathers and
    reduce-scatters wait for a rank that is elsewhere). A UserError (a user's mistake) goes on as it is, one line
    (cli.run_cli), not a bug."""
    try:
        with watchdog.activity(f"in {where} (under FSDP2 every pass all-gathers the weights with the other ranks)"):
            yield
    except UserError:
        raise
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


def backward_micro_batches(policy, mbs: list[MicroBatch], world: int, amp, temperature: float, loss_of,
                           where: str = "") -> dict:
    """Forward and backward over the micro-batches of one optimiser mini-batch, accumulating gradients (DDP syncs
    them on the last): the cold start's loop (the RL update writes its own out, train.accumulate_gradients).
    loss_of(mb, logp, entropy) -> (loss 0-d, metrics): a sum over the micro-batch divided by the mini-batch's global
    normaliser, so ×world undoes the ranks' gradient average. Returns the metrics summed."""
    sums: dict[str, float] = {}
    for i, mb in enumerate(mbs):
        with no_grad_sync(policy, last=i == len(mbs) - 1), located(f"{where}, micro-batch {i}"):
            with amp():
                logp, entropy = policy(mb.input_ids, mb.attention_mask, mb.mask, temperature)
            value, metrics = loss_of(mb, logp, entropy)
            loss.check_finite("the loss", value)
            (value * world).backward()
        for key, v in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(v)
    return sums


def optimizer_step(policy, optimizer, grad_clip: float) -> float:
    """Clip the gradient norm (over all ranks' shards), step, zero the gradients; returns the norm before clipping."""
    with watchdog.activity("in the optimiser step (the gradient norm's all-reduce over the shards)"):
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.grad is not None], grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite gradient norm {grad_norm.item()}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def enable_gradient_checkpointing(lm) -> None:
    """Recompute each decoder layer's activations in backward (transformers 5 renamed the method; 4.x has the old
    name). Takes effect in train mode only."""
    (getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable)()


def no_grad_sync(policy, last: bool):
    """Gradient accumulation under DDP: reduce gradients only on the last micro-batch of a mini-batch. FSDP2 always
    reduce-scatters (D41); one process has nothing to sync."""
    if isinstance(policy, torch.nn.parallel.DistributedDataParallel) and not last:
        return policy.no_sync()
    return contextlib.nullcontext()


def full_named_parameters(policy, dtype=None, trainable: bool = False):
    """(name, full tensor) of the LM's parameters (trainable: only those the optimiser updates) one at a time,
    gathering FSDP2 shards (a collective: every rank iterates to the end), in `dtype` if given: each shard is cast
    before the gather, so a bfloat16 sync moves and holds half the bytes of the float32 master weights. Peak extra
    memory: one full parameter in `dtype` (and its shard)."""
    for name, p in unwrap(policy).lm.named_parameters():
        if trainable and not p.requires_grad:
            continue
        local = p.detach() if dtype is None else p.detach().to(dtype)      # a DTensor stays sharded
        yield name, local.full_tensor() if hasattr(local, "full_tensor") else local


def generator_weights(policy, merged: bool = False, dtype=None):
    """What a generator takes after an optimiser step, one full tensor at a time (a collective under FSDP2): every
    parameter (full fine-tuning), gathered in `dtype` (the generator's `weight_dtype`; None: the trainer's); with
    LoRA the adapters' tensors, or (merged) W + (α/r)·B·A in the base model's names, for a generator that cannot
    take an adapter (harness/lora.py)."""
    lm = unwrap(policy).lm
    if not is_lora(lm):
        return full_named_parameters(policy, dtype)
    if merged:
        config = lm.peft_config[ADAPTER]
        return merged_weights(full_named_parameters(policy), config.lora_alpha / config.r)
    return adapter_weights(full_named_parameters(policy, trainable=True))


def trainable_parameters(policy) -> list:
    """The parameters the optimiser updates: all of them, or with LoRA the adapters'."""
    return [p for p in policy.parameters() if p.requires_grad]
