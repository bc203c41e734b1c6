"""Test doubles for the rollout: a character-level tokenizer, a scripted generator whose tool calls
and segment entropies the test controls, and a tool runner that needs no search index."""
import random


class CharTokenizer:
    """One token per character (ids = code points), so text positions equal token positions."""
    eos_token_id = 0
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids if i != 0)


class ScriptedGenerator:
    """Emits `<think>…</think><search> q… </search>` until the context holds `n_tools(rng)` results,
    then `<answer>\\boxed{…}</answer>`. Segment entropy is `entropy(step)` where step = number of
    tool results already in the context (0 = the first segment)."""
    vocab_size = 1000

    def __init__(self, n_tools=2, entropy=lambda step: 1.0, tool="search"):
        self.n_tools = n_tools if callable(n_tools) else (lambda rng: n_tools)
        self.entropy, self.tool = entropy, tool
        self.calls = []  # (n_contexts, seed) per generate call

    def generate(self, contexts, max_new_tokens, seed):
        from rollout import Segment
        self.calls.append((len(contexts), seed))
        tok = CharTokenizer()
        out = []
        for i, (ctx, limit) in enumerate(zip(contexts, max_new_tokens)):
            text = tok.decode(ctx)
            step = text.count("<result>")
            rng = random.Random(f"{seed}/{i}/{len(ctx)}")
            budget_rng = random.Random(text.split("<|assistant|>")[0] + str(seed // 7919) + str(i))
            if step < self.n_tools(budget_rng):
                seg = f"<think>t{rng.randint(0, 999)}</think> <{self.tool}> q{step} {rng.randint(0, 99)} </{self.tool}>"
                reason = "tool"
            else:
                seg = f"<think>done</think> <answer>\\boxed{{{rng.randint(0, 9)}}}</answer>"
                reason = "answer"
            ids = tok.encode(seg)
            if len(ids) > limit:
                ids, reason = ids[:limit], "length"
            out.append(Segment(ids, reason, float(self.entropy(step)), tok.decode(ids)))
        return out


class EchoTools:
    """Tool runner: the observation names the call; counts like tools.Tools."""

    def __init__(self):
        self.rounds = []

    def run(self, calls):
        import tools
        self.rounds.append(list(calls))
        obs = [f"doc about {c.argument}" if isinstance(c, tools.ToolCall) else f"Error: {c.message}"
               for c in calls]
        return obs, {"search/calls": len(calls)}
