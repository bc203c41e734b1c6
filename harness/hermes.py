"""The hermes tool-call format (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in
the policy's text, each result rendered by the tokenizer's chat template as a tool turn (D45).

The policy's own tokens are never re-tokenised: after a call the trajectory gets the tokens that the chat template
puts between that assistant text and the next assistant turn (the end of the turn, the tool turn, the assistant
header), the result's text inside them tokenised as data (special-token text in it stays text). That is only right
when the template renders a conversation as the prefix it already was plus the new turns, so `HermesFormat` checks
it at start-up on a conversation with two tool calls (Qwen3's template, which drops earlier turns' <think>, fails).
The call's JSON is parsed as data only (json.loads); anything malformed is an error observation.
"""
from __future__ import annotations

import json
import re

import tools
from harness.cli import UserError
from harness.plugins import arguments_of, call_of

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>\s*$", re.DOTALL)

INSTRUCTIONS = """You are a helpful assistant. Answer the user's question step by step, using tools when they help.
- Think inside <think> </think>.
- Call a tool with <tool_call>{"name": <tool name>, "arguments": <JSON object of its arguments>}</tool_call>; its
  result comes back in the next turn. You can think and call tools again.
- Finish with <answer> ... \\boxed{final answer} </answer>."""


def schema(tool: tools.Tool) -> dict:
    """A tool as chat templates and the hermes prompt list it (OpenAI's function format)."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


class HermesFormat:
    """Calls as `<tool_call>` JSON, results as the chat template's tool turn; generation stops at `</tool_call>` or
    `</answer>`. Built from the run's tokenizer and tools; a template that cannot render a tool turn, or that is not
    prefix-preserving across one, is a UserError naming the model."""
    name = "hermes"
    stop_strings = ("</tool_call>", "</answer>")
    as_data = True                               # results are data (D46): tools.as_data, special tokens split
    format_tags = {"tool_call": r'\s*\{\s*"name"\s*:\s*"([\w.-]+)"'}   # the reward's tag; a call's JSON names its tool

    def __init__(self, tokenizer, tool_list: list[tools.Tool], model: str = "the model"):
        self.tools = list(tool_list)
        self.by_name = {t.name: t for t in self.tools}
        template = tokenizer.chat_template or ""
        # a template that lists tools itself (Qwen's) gets them as `tools=`; for another, the prompt lists them
        self.template_tools = [schema(t) for t in self.tools] if "tools" in template else None
        self.template_kw = {"tools": self.template_tools} if self.template_tools else {}
        self.system_prompt = INSTRUCTIONS if self.template_tools else INSTRUCTIONS + "\n\nThe tools:\n<tools>\n" + \
            "\n".join(json.dumps(schema(t), ensure_ascii=False) for t in self.tools) + "\n</tools>"
        self.tokenizer = tokenizer
        self.turn_end, self.before, self.after = self._check(tokenizer, model)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.template_kw)

    def _check(self, tokenizer, model: str) -> tuple[str, str, str]:
        """(the text after an assistant turn's content, the tool turn's text before the result, after it) read off
        the template, checked to rebuild a two-call conversation exactly."""
        name = self.tools[0].name
        calls = [f'<think> step {i} </think>\n<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'
                 for i in (1, 2)]
        results = ["RESULT-ONE", "RESULT-TWO"]
        head = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": "QUESTION"}]
        turns = lambda n: [m for i in range(n) for m in ({"role": "assistant", "content": calls[i]},  # noqa: E731
                                                         {"role": "tool", "content": results[i]})]
        where = f"--tool_format hermes: the chat template of {model}"
        try:
            prompt = self._render(head, True)
            answered = self._render(head + turns(1)[:1], False)
            one = self._render(head + turns(1), True)
            two = self._render(head + turns(2), True)
        except Exception as err:  # noqa: BLE001 -- jinja raises anything; one line names it
            raise UserError(f"{where} cannot render a tool turn ({type(err).__name__}: {err})") from None
        if not answered.startswith(prompt + calls[0]):
            raise UserError(f"{where} does not render an assistant turn as the prompt followed by the policy's text "
                            f"(it renders {answered[len(prompt):][:80]!r})")
        turn_end = answered[len(prompt) + len(calls[0]):]
        if not one.startswith(answered) or one.count(results[0]) != 1:
            raise UserError(f"{where} cannot render a tool turn after an assistant turn without changing it")
        before, after = one[len(answered):].split(results[0])
        rebuilt = prompt + "".join(c + turn_end + before + r + after for c, r in zip(calls, results))
        if two != rebuilt:
            at = next((i for i, (a, b) in enumerate(zip(two, rebuilt)) if a != b), min(len(two), len(rebuilt)))
            ctx = max(0, at - 12)
            raise UserError(f"{where} is not prefix-preserving across a tool turn: rendering the conversation after "
                            f"a second tool call changes character {at} ({rebuilt[ctx:at + 30]!r} became "
                            f"{two[ctx:at + 30]!r}); a template that keeps earlier turns as written is needed")
        return turn_end, before, after

    def parse(self, segment_text: str) -> tools.ToolCall | tools.ToolError:
        """The call a segment ends with: `<tool_call>` JSON {"name": a tool, "arguments": an object, or its JSON text},
        parsed as data; anything else is a ToolError naming what was wrong."""
        m = _CALL.search(segment_text.rstrip()) if isinstance(segment_text, str) else None
        if m is None:
            return tools.ToolError('no tool call found; write <tool_call>{"name": ..., "arguments": {...}}'
                                   '</tool_call>')
        try:
            call = json.loads(m.group(1))
        except ValueError as err:
            return tools.ToolError(f"the tool call is not JSON ({err})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return tools.ToolError('a tool call is a JSON object {"name": ..., "arguments": {...}}')
        tool = self.by_name.get(call["name"])
        if tool is None:
            return tools.ToolError(f"unknown tool {call['name']!r}; available tools: "
                                   f"{', '.join(repr(n) for n in self.by_name)}")
        return call_of(tool, call.get("arguments", {}))

    def observation_ids(self, tokenizer, text: str) -> list[int]:
        """The tokens after a call (loss mask 0): the template's end of turn and tool-turn head, the result as data
        (no special token can come from it), the template's tool-turn end and assistant header."""
        data = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return tokenizer.encode(self.turn_end + self.before, add_special_tokens=False) + list(data) + \
            tokenizer.encode(self.after, add_special_tokens=False)

    def build_prompt(self, tokenizer, question: str) -> list[int]:
        return self.prompt_ids(tokenizer, [{"role": "system", "content": self.system_prompt},
                                           {"role": "user", "content": question}])

    def prompt_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        """Chat-template ids of `messages` up to the assistant header, the tools given as the template lists them."""
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, **self.template_kw))

    def response_text(self, tokenizer, response_ids: list[int], loss_mask: list[int], observations: list[str]) -> str:
        """A response as the reward reads it: the policy's text, each tool turn shown as a <result> block
        (tools.format_result: no text of the tool can close it, D47)."""
        parts, start, results = [], 0, iter(observations)
        for i in range(1, len(loss_mask) + 1):
            if i == len(loss_mask) or loss_mask[i] != loss_mask[start]:
                parts.append(tokenizer.decode(response_ids[start:i]) if loss_mask[start] else
                             tools.format_result(next(results, "")))
                start = i
        return "".join(parts)

    def call_text(self, tool: str, argument: str) -> str:
        """How the policy writes a call (the cold start's demonstrations)."""
        arguments = arguments_of(self.by_name[tool], argument)
        return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False) + \
            "\n</tool_call>"
