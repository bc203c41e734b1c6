"""A stand-in for the parts of vLLM's offline API that rollout.VLLMGenerator uses (vLLM has no CPU
install here). It mirrors vLLM's documented behaviour: token-id prompts (`inputs.TokensPrompt`),
per-request `SamplingParams` (temperature 0 = greedy, top-p, `max_tokens`, `logprobs=N` returning the
top-N log-probs of the raw logits plus the sampled token with its rank, `stop` strings kept in the
output with `include_stop_str_in_output=True`, a per-request seed), `finish_reason` "stop"/"length"
and `stop_reason` (the matched string, or None for EOS), and the engine hooks for weight sync,
prefix-cache reset and sleep/wake. Generation runs a transformers model token by token."""
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch


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


class _ModelHandle:
    def __init__(self, model):
        self.model = model

    def load_weights(self, weights):
        state = dict(weights)
        self.model.load_state_dict(state, strict=False)


class LLM:
    instances = []

    def __init__(self, model, enable_prefix_caching=False, seed=0, dtype="auto", gpu_memory_utilization=0.9,
                 enable_sleep_mode=False, **kw):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.model = AutoModelForCausalLM.from_pretrained(model).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.kwargs = dict(enable_prefix_caching=enable_prefix_caching, seed=seed, dtype=dtype,
                           enable_sleep_mode=enable_sleep_mode, **kw)
        self.events = []
        import inspect  # transformers renamed past_key_values -> cache in 5.2x
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        vocab = self.model.config.vocab_size
        runner = SimpleNamespace(model=_ModelHandle(self.model))
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(get_vocab_size=lambda: vocab),
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))))
        LLM.instances.append(self)

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")

    def sleep(self, level=1):
        self.events.append(f"sleep{level}")

    def wake_up(self):
        self.events.append("wake_up")

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
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
