"""Your own tools and reward, named on the command line as package.module:name or file.py:name (docs/tools.md)."""
from __future__ import annotations

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
            module_spec = importlib.util.spec_from_file_location(f"aepo_user_{abs(hash(where))}", where)
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
        raise UserError(f"--tools {spec}: the factory raised {type(err).__name__}: {err}") from None
    made = list(made) if isinstance(made, (list, tuple)) else [made]
    for tool in made:
        if not isinstance(tool, tools.Tool) or not tool.name:
            raise UserError(f"--tools {spec}: the factory returned {type(tool).__name__}, not a tools.Tool with a name")
    if not made:
        raise UserError(f"--tools {spec}: the factory returned no tools")
    return made


def reward_function(spec: str, score):
    """score(text, golds) -> reward.score_response's dict, its "reward" replaced by --reward's
    function(response_text, golds) -> float (the format check, EM and F1 are still logged)."""
    function = load_object(spec, "--reward")
    if not callable(function):
        raise UserError(f"--reward {spec}: {type(function).__name__} is not a function")

    def scored(text: str, golds) -> dict:
        out = score(text, golds)
        value = function(text, list(golds))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise UserError(f"--reward {spec} returned {value!r}, not a number")
        return {**out, "reward": float(value)}
    return scored
