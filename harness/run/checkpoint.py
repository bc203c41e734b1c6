"""Checkpoints: sharded trainer state (torch.distributed.checkpoint) plus a save_pretrained export, written atomically.

A checkpoint `runs/<name>/checkpoints/step_NNNNNN/` holds
- the exported model at its top level (config.json, generation_config.json, model.safetensors, tokenizer files):
  `from_pretrained(dir)` and `vllm.LLM(dir)` load it as is; float32, or bfloat16 with `--bf16` (what vLLM generates
  with), and config.json says which;
- `trainer/`: every rank's shard of the float32 model and of the AdamW state, written and read by each rank itself
  (`torch.distributed.checkpoint`, so no rank gathers the optimiser state and another world size can read it);
- `trainer_state.pt`: step, every rank's RNG states (the step fixes the data order: dataset.step_questions); `config.yaml`, `run_info.json`.
With LoRA (harness/lora.py) the export is the merged model, `adapter/` holds the adapter in peft's files, and `trainer/`
only the adapters and their moments (the base is loaded from where RL started).
Size per parameter: 4 B model shard + 8 B AdamW moments + 4 B (2 B with --bf16) export = 16 B (14 B); with
`--save_trainer_state false` only the export and trainer_state.pt are written (4 B / 2 B per parameter) and a
resume restarts the AdamW moments. Everything is written into `.tmp_step_NNNNNN/` and renamed when complete, so a
crash mid-write keeps the previous checkpoint intact.

Deviations from the paper / official code (algorithm.md §8): D42 (every checkpoint also exports the model in
save_pretrained form, which evaluation, vLLM and the cold-start cache read).
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from harness import lora, models
from harness.run import parallel
from harness.run import policy as policy_mod
from harness.cli import RunFailure, UserError, stop_requested


def _trained_only():
    """The state-dict options of the trainer state: the parameters the optimiser updates (every one; with LoRA the
    adapters', whose base model is loaded from where RL started); loading one leaves the frozen ones as they are
    (every trained key is there: the checkpoint read fails on a missing one)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _trained_state(policy, optimizer=None) -> tuple[dict, dict | None]:
    """This rank's shards of the trained parameters and (with an optimiser) of its state (views, no copies). A frozen
    weight tied to another (an LM head tied to a frozen embedding) is left out too: ignore_frozen_params sees only the
    first name of a shared parameter. Without an optimiser it is not touched (get_state_dict would initialise a fresh
    one's state with a step of zero gradients, step = 1)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(policy, options=_trained_only()), None
    else:
        model_sd, optim_sd = get_state_dict(policy, optimizer, options=_trained_only())
    frozen = {name.removeprefix("module.") for name, p in policy.named_parameters(remove_duplicate=False)
              if not p.requires_grad}
    return {key: value for key, value in model_sd.items() if key not in frozen}, optim_sd


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / "trainer_state.pt").exists()) if root.exists() else []


def run_checkpoint(run_dir: Path, step: int) -> Path:
    """The run's latest complete checkpoint, or that of `step` (eval.py --run, --step); a clear error if none."""
    every = checkpoint_dirs(run_dir)
    ckpts = [c for c in every if c.name == f"step_{step:06d}"] if step else every
    if not ckpts:
        have = ", ".join(c.name for c in every) or "none"
        raise UserError(f"--run {run_dir}: no checkpoint" + (f" of step {step}" if step else "") + f" (have: {have})")
    return ckpts[-1]


@contextlib.contextmanager
def one_process_quietly():
    """torch.distributed.checkpoint warns on every save and load without a process group; one process is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _write_export(policy, tokenizer, out: Path, rank: int, dtype) -> None:
    """save_pretrained of the full model at `out`: parameters gathered one at a time, only rank 0 keeps them (on the
    CPU, in `dtype`); with LoRA the merged model, and the adapter in peft's files under `out/adapter`. A collective
    under FSDP2: every rank calls it."""
    lm = policy_mod.unwrap(policy).lm
    state = {}
    for name, full in policy_mod.generator_weights(policy, merged=True):
        if rank == 0:
            state[name] = full.to("cpu", dtype=dtype, copy=True)
    if lora.is_lora(lm):
        adapter = [(name, full.to("cpu", copy=True)) for name, full in policy_mod.generator_weights(policy)]
        if rank == 0:
            lora.write_adapter(out / "adapter", adapter, lm.peft_config[lora.ADAPTER])
        lm = lm.get_base_model()
    if rank == 0:
        models.save_here(lm, out, state_dict=state)
        config = copy.deepcopy(lm.config)        # save_pretrained writes the float32 master model's dtype
        config.dtype = dtype
        config.save_pretrained(out)              # so `dtype="auto"` loaders (vLLM, --resume) read the export's
        tokenizer.save_pretrained(out)


def export_model(policy, tokenizer, out: Path, rank: int, dtype=torch.float32) -> None:
    """The policy's weights in save_pretrained format at `out`, atomically (the cold-start cache), written by the
    processes whose `rank` is 0 (each node's first process, given its local rank). Several processes may save the same
    cache at once: the first complete one wins and is never deleted."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _write_export(policy, tokenizer, tmp, rank, dtype)
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists() and not (out / "config.json").exists():
            shutil.rmtree(out, ignore_errors=True)   # an incomplete leftover; a complete one is never deleted
        try:
            os.replace(tmp, out)                     # atomic; fails if another process saved the same model first
        except OSError:
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    parallel.barrier()


def save(run_dir: Path, step: int, policy, optimizer, tokenizer, *, rank: int, keep: int, config_yaml: str,
         info: dict, export_dtype=torch.float32, trainer_state: bool = True) -> Path:
    """Write checkpoint `step` (every rank calls it), then delete all but the newest `keep` (keep <= 0: none).
    A checkpoint that cannot be written (disk full, no permission) removes its partial files, keeps the previous
    checkpoint, and raises a RunFailure naming the directory, the space it needs and the space free."""
    final = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(f".tmp_{final.name}")
    failure = None
    from torch.distributed.checkpoint.api import CheckpointException      # a BaseException: the writers' errors
    try:
        _write(tmp, step, policy, optimizer, tokenizer, rank, config_yaml, info, export_dtype, trainer_state)
    except (OSError, RuntimeError, CheckpointException) as err:   # torch's C++ writers: RuntimeError on a full disk
        if stop_requested():
            raise KeyboardInterrupt from None        # Ctrl-C mid-write: the previous checkpoint stays as it was
        failure = err
    failures = [f for f in parallel.gather(None if failure is None else _reason(failure)) if f]
    if failures:
        needed = _bytes_needed(run_dir, policy, export_dtype, trainer_state)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        parallel.barrier()
        if not isinstance(failure, OSError) and shutil.disk_usage(final.parent).free >= needed:
            raise failure                                  # not the disk: a bug, with its traceback
        previous = checkpoint_dirs(run_dir)
        kept = (f"the previous checkpoint ({previous[-1].name}) is intact: --resume continues from it" if previous else
                "there is no earlier checkpoint, so this run cannot be resumed: free space and start it again")
        raise RunFailure(f"could not write checkpoint {final.name} in {final.parent}: {failures[0]}; it needs about "
                         f"{_size(needed)} and {_size(shutil.disk_usage(final.parent).free)} is free there (free "
                         f"space, or use --keep_checkpoints 1 or --save_trainer_state false); {kept}") from None
    if rank == 0:
        if final.exists():                           # re-saving a step: move the old one aside first
            os.replace(final, final.with_name(f".old_{final.name}"))
        os.replace(tmp, final)
        shutil.rmtree(final.with_name(f".old_{final.name}"), ignore_errors=True)
        for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    parallel.barrier()
    return final


def _write(tmp, step, policy, optimizer, tokenizer, rank, config_yaml, info, export_dtype, trainer_state) -> None:
    """Everything of a checkpoint, into the temporary directory `tmp` (every rank its own shard)."""
    from torch.distributed.checkpoint import save as dcp_save
    rngs = parallel.gather(_rng_state())
    parallel.on_rank0(lambda: shutil.rmtree(tmp, ignore_errors=True) or tmp.mkdir(parents=True))   # errors: all ranks
    adapters = lora.is_lora(policy_mod.unwrap(policy).lm)          # LoRA: the trained weights are the adapters'
    if trainer_state or adapters:
        model_sd, optim_sd = _trained_state(policy, optimizer if trainer_state else None)
        with one_process_quietly():                                      # raises on every rank if one fails
            dcp_save({"model": model_sd, **({"optim": optim_sd} if trainer_state else {})},
                     checkpoint_id=str(tmp / "trainer"), no_dist=not torch.distributed.is_initialized())
    _write_export(policy, tokenizer, tmp, rank, export_dtype)         # collectives first, then rank 0 writes
    if rank == 0:
        torch.save({"step": step, "rng": rngs, "trainer_state": trainer_state, "adapters": adapters},
                   tmp / "trainer_state.pt")
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "run_info.json").write_text(json.dumps(info, indent=2))


def _damaged(path: Path, err: BaseException) -> UserError:
    """The one line of a checkpoint file that cannot be read back (truncated by a full disk, a missing shard, another
    model's): which file, why, and what to do."""
    earlier = [c.name for c in checkpoint_dirs(path.parent.parent) if c.name < path.parent.name]
    then = (f"move {path.parent} out of the way to resume from {earlier[-1]}" if earlier else
            "it is the run's only checkpoint, so the run must start again")
    return UserError(f"--resume: {path} cannot be read ({type(err).__name__}: {_reason(err)}); the checkpoint is "
                     f"damaged: {then}")


def _reason(err: Exception) -> str:
    return err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split())[:160]


def _bytes_needed(run_dir: Path, policy, export_dtype, trainer_state: bool) -> int:
    """The size of the newest complete checkpoint, else 4 (model shard) + 8 (AdamW) + export bytes per parameter."""
    previous = checkpoint_dirs(run_dir)
    if previous:
        return sum(p.stat().st_size for p in previous[-1].rglob("*") if p.is_file())
    n = sum(p.numel() for p in policy_mod.unwrap(policy).lm.parameters())
    trained = sum(p.numel() for p in policy_mod.trainable_parameters(policy))
    adapters = lora.is_lora(policy_mod.unwrap(policy).lm)          # their trainer/ shard is written either way
    per_trained = 12 if trainer_state else 4 if adapters else 0
    return trained * per_trained + n * torch.empty((), dtype=export_dtype).element_size()


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def load(ckpt: Path, policy, optimizer, rank: int) -> int:
    """Restore the trainer state of checkpoint `ckpt` into an already built policy and optimiser (each rank reads its
    own shards) and this rank's RNG states; returns the step. A checkpoint saved without trainer state leaves the
    weights as loaded from its export and the optimiser fresh (with a warning)."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    try:
        state = torch.load(Path(ckpt) / "trainer_state.pt", map_location="cpu", weights_only=False)
        state["step"], state["rng"]                  # noqa: B018 -- a dict with both, else damaged
    except MemoryError:
        raise
    except Exception as err:                     # truncated, overwritten, another file: pickle's errors are many
        if isinstance(err, torch.OutOfMemoryError):
            raise
        raise _damaged(Path(ckpt) / "trainer_state.pt", err) from None
    with_optim, adapters = state.get("trainer_state", True), state.get("adapters", False)
    if adapters != lora.is_lora(policy_mod.unwrap(policy).lm):
        raise UserError(f"--resume: {ckpt} was saved {'with' if adapters else 'without'} LoRA adapters, and this "
                        f"run has {'none' if adapters else 'them'}: --lora_rank must be the run's")
    if with_optim or adapters:
        model_sd, optim_sd = _trained_state(policy, optimizer if with_optim else None)
        shards = {"model": model_sd, **({"optim": optim_sd} if with_optim else {})}
        from torch.distributed.checkpoint.api import CheckpointException      # a BaseException: the readers' errors
        try:
            with one_process_quietly():
                dcp_load(shards, checkpoint_id=str(Path(ckpt) / "trainer"),
                         no_dist=not torch.distributed.is_initialized())
        except (CheckpointException, OSError, RuntimeError, ValueError, KeyError) as err:
            if isinstance(err, torch.OutOfMemoryError):  # not the checkpoint's fault
                raise
            raise _damaged(Path(ckpt) / "trainer", err) from None
        if with_optim:
            set_state_dict(policy, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optim"],
                           options=_trained_only())
        else:
            set_model_state_dict(policy, shards["model"], options=_trained_only())
    if not with_optim and rank == 0:
        print(f"warning: {ckpt} was saved with --save_trainer_state false: the weights come from its "
              f"{'adapters' if adapters else 'export'} and the AdamW moments restart from zero", file=sys.stderr)
    rngs = state["rng"]
    rng = rngs[rank] if rank < len(rngs) else rngs[0]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(state["step"])
