"""A tool of your own in AEPO's rollout: a calculator, and a reward to go with it (docs/tools.md).

    python train.py --tools '[search, docs/examples/calculator.py:calculator]'
    python train.py --tools '[search, docs/examples/calculator.py:calculator]' --tool_format hermes
    python train.py --reward docs/examples/calculator.py:exact_reward

The policy calls it as `<calculate> 2 * (3 + 4) </calculate>` (tags) or
`<tool_call>{"name": "calculate", "arguments": {"expression": "2 * (3 + 4)"}}</tool_call>` (hermes); the pre-monitor
and the branching after uncertain tool calls treat it as they treat search and python.
"""
import ast
import operator

import reward
import tools

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


class Calculator(tools.Tool):
    name = "calculate"
    description = "Evaluates an arithmetic expression (numbers, + - * / % ** and parentheses) and returns its value."
    parameters = {"type": "object", "required": ["expression"],
                  "properties": {"expression": {"type": "string", "description": "e.g. 2 * (3 + 4)"}}}
    timeout_s = 5.0                      # the round waits this long for a run() of one call
    max_chars = 200

    def run(self, calls: list[dict]) -> list:
        return [self.evaluate(call["expression"]) for call in calls]

    @staticmethod
    def evaluate(expression: str):
        """The value as text, or ("Error: ...", "error"): the expression is parsed, never executed."""
        def value(node):
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and \
                    not isinstance(node.value, bool):
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
                left, right = value(node.left), value(node.right)
                if isinstance(node.op, ast.Pow) and abs(right) > 64:
                    raise ValueError("exponent too large")
                return _OPS[type(node.op)](left, right)
            if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
                return _OPS[type(node.op)](value(node.operand))
            raise ValueError(f"{type(node).__name__} is not arithmetic")
        try:
            return str(value(ast.parse(expression, mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
            return f"Error: cannot evaluate {expression!r}: {err}", "error"


def calculator():
    """The factory --tools names: a tools.Tool, or a list of them."""
    return Calculator()


def exact_reward(response_text: str, golds: list[str]) -> float:
    """A reward of your own: 1 when the \\boxed answer matches a gold answer exactly (after SQuAD normalisation),
    else 0 -- no format penalty, no F1."""
    return reward.exact_match(reward.extract_boxed(response_text), golds)
