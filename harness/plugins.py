"""Your own tools and reward: loaded from package.module:name or file.py:name, their JSON arguments, their prompt
(docs/tools.md)."""
from __future__ import annotations

import json

import tools
from harness.cli import UserError


def load_object(spec: str, flag: str):
    """The object `spec` names: package.module:attribute (imported as code beside the working directory is) or
    path/to/file.py:attribute. Anything wrong is one UserError naming the flag."""
    import importlib
    import importlib.util
    import os
    import sys
    where, _, attribute = spec.rpartition(":")
    if not where or not attribute.isidentifier():
        raise UserError(f"{flag} {spec!r}: expected package.module:name or file.py:name")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise UserError(f"{flag} {spec!r}: no file {where}")
            module_spec = importlib.util.spec_from_file_location(f"aepo_user_{os.path.basename(where)[:-3]}", where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 -- the user's module failing to import is one line naming it
        raise UserError(f"{flag} {spec!r}: importing {where} failed ({type(err).__name__}: {err})") from None
    if not hasattr(module, attribute):
        raise UserError(f"{flag} {spec!r}: {where} has no {attribute}")
    return getattr(module, attribute)


def plugin_tools(spec: str) -> list[tools.Tool]:
    """The tools a --tools package.module:factory gives: factory() returns a tools.Tool or a list of them."""
    factory = load_object(spec, "--tools")
    try:
        made = factory()
    except Exception as err:  # noqa: BLE001 -- the user's factory failing is one line naming it
        raise UserError(f"--tools {spec!r}: the factory raised {type(err).__name__}: {err}") from None
    made = list(made) if isinstance(made, (list, tuple)) else [made]
    for tool in made:
        if not isinstance(tool, tools.Tool) or not tool.name:
            raise UserError(f"--tools {spec!r}: the factory returned {type(tool).__name__}, not a tools.Tool with a name")
    if not made:
        raise UserError(f"--tools {spec!r}: the factory returned no tools")
    return made


def reward_function(spec: str, score):
    """score(text, golds) -> reward.score_response's dict, its "reward" replaced by --reward's
    function(response_text, golds) -> float (the format check, EM and F1 are still logged)."""
    function = load_object(spec, "--reward")
    if not callable(function):
        raise UserError(f"--reward {spec!r}: {type(function).__name__} is not a function")

    def scored(text: str, golds) -> dict:
        out = score(text, golds)
        value = function(text, list(golds))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise UserError(f"--reward {spec!r} returned {value!r}, not a number")
        return {**out, "reward": float(value)}
    return scored


def call_of(tool: tools.Tool, arguments) -> tools.ToolCall | tools.ToolError:
    """The call of `tool` with `arguments` (a dict, or its JSON text, parsed as data only): checked against the
    tool's schema (an object; its required keys present; no key it does not name), its argument text canonical (the
    text of a tool's one text parameter, else sorted JSON), else a ToolError."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as err:
            return tools.ToolError(f"the arguments of {tool.name} are not JSON ({err})")
    if not isinstance(arguments, dict):
        return tools.ToolError(f"the arguments of {tool.name} must be a JSON object, got {type(arguments).__name__}")
    properties = tool.parameters.get("properties", {})
    missing = [key for key in tool.parameters.get("required", []) if key not in arguments]
    unknown = [key for key in arguments if properties and key not in properties]
    if missing or unknown:
        return tools.ToolError(f"{tool.name} takes {tools.listed(tuple(properties)) or 'no arguments'}" +
                         (f"; missing {', '.join(missing)}" if missing else "") +
                         (f"; unknown {', '.join(unknown)}" if unknown else ""))
    key = tools.text_parameter(tool)
    if key is not None:
        if key not in arguments:
            return tools.ToolError(f"{tool.name} needs its argument {key}")
        if not isinstance(arguments[key], str):
            return tools.ToolError(f"{tool.name}'s {key} must be text, got {type(arguments[key]).__name__}")
        return tools.checked(tool, arguments[key].strip())
    return tools.checked(tool, json.dumps(arguments, sort_keys=True, ensure_ascii=False))


def arguments_of(tool: tools.Tool, argument: str) -> dict:
    """A checked call's arguments as a dict (the inverse of `call_of`'s canonical text)."""
    key = tools.text_parameter(tool)
    return {key: argument} if key is not None else json.loads(argument)


class OwnTags(tools.TagFormat):
    """The tags format for your own set of tools: a prompt that lists them (tag_prompt), and the JSON arguments of a
    tool of several checked against its schema (call_of)."""

    def __init__(self, tool_list: list[tools.Tool], as_data: bool = True):
        super().__init__(tool_list, tag_prompt(tool_list), as_data)
        self.by_name = {t.name: t for t in self.tools}

    def parse(self, segment_text: str) -> tools.ToolCall | tools.ToolError:
        call = super().parse(segment_text)
        if isinstance(call, tools.ToolCall) and tools.text_parameter(tool := self.by_name[call.tool]) is None:
            return call_of(tool, call.argument)
        return call


def tag_prompt(tool_list: list[tools.Tool]) -> str:
    """tools.SYSTEM_PROMPT's instructions for another set of tools, each listed with its description."""
    listed = "\n".join(f"  - <{t.name}> {tools.text_parameter(t) or '{JSON arguments}'} </{t.name}>: "
                       f"{t.description}".rstrip(": ") for t in tool_list)
    return ("You are a helpful assistant. Answer the user's question step by step, using tools when they help.\n"
            "- Think inside <think> </think>.\n"
            "- To call a tool, write its input between its tags (a JSON object of its arguments where it takes "
            "several):\n" + listed + "\n"
            "- Each tool result comes back inside <result> </result>. You can think and call tools again.\n"
            "- Finish with <answer> ... \\boxed{final answer} </answer>.")
