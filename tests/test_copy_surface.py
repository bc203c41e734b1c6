"""The surface a copier and a reader rely on, held to the documents that state it.

docs/reference.md's "The copy surface" lists, once, the names a copier of the paper's files uses; this test reads that
section: every listed name imports (a function or class is callable, a keyword is in its signature, and the keywords of
policy_loss and LossSettings are all listed), loss.py and advantage.py have no public function or class the list leaves
out, an unknown keyword is a TypeError, and every row of the renames (the changelog) holds: its successor works, and the
old name is gone (an AttributeError, an old keyword a TypeError, the error naming it). The README's sentence on the four
ablation switches names where each is read: each named function's code reads it.
"""
import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SECTION = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8").split("\n## The copy surface\n", 1)[1] \
    .split("\n## ", 1)[0]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the markdown tables in `text`, header rows and rulers left out."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not set(line.strip()) <= set("|-")]
    return [row for row in rows if row[0] not in ("file", "old")]


NAMES, RENAMES = SECTION.split("**Renames (the changelog).**", 1)
LISTED = {row[0].strip("`").replace("` ", " "): re.findall(r"`(\w+)`", row[1]) for row in table_rows(NAMES)}
FILES = {label: names for label, names in LISTED.items() if label.endswith(".py")}
RENAMED = [(row[0].strip("`"), row[1].split("`")[1], row[2]) for row in table_rows(RENAMES)]   # (old, now, since)


def resolve(path: str):
    """The object a dotted path names: its longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[i:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(path)


# ---------------------------------------------------------------------------------------------------------------------
# The names


def test_the_section_lists_the_paper_files_and_the_loss_keywords():
    assert set(FILES) == {"loss.py", "advantage.py", "rollout.py", "sampler.py", "tools.py", "reward.py"}
    assert {"loss.policy_loss keywords", "loss.LossSettings keywords"} <= set(LISTED)
    assert all(names for names in LISTED.values()) and RENAMED


@pytest.mark.parametrize("label", sorted(FILES))
def test_every_listed_name_imports(label):
    """A listed name is there, and a function or class is callable."""
    module = importlib.import_module(label.removesuffix(".py"))
    for name in FILES[label]:
        value = getattr(module, name)
        assert name.isupper() or callable(value), f"{label}: {name} is not callable"


@pytest.mark.parametrize("label", ["loss.policy_loss keywords", "loss.LossSettings keywords"])
def test_the_listed_keywords_are_the_signatures(label):
    parameters = inspect.signature(resolve(label.split()[0])).parameters
    assert sorted(LISTED[label]) == sorted(parameters)


@pytest.mark.parametrize("module_name", ["loss", "advantage"])
def test_every_public_function_and_class_of_the_math_is_listed(module_name):
    tree = ast.parse((ROOT / f"{module_name}.py").read_text(encoding="utf-8"))
    public = {node.name for node in tree.body
              if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")}
    assert public <= set(FILES[f"{module_name}.py"]), public - set(FILES[f"{module_name}.py"])


def test_an_unknown_keyword_is_a_type_error_naming_it():
    import loss
    z = torch.zeros(1, 2)
    with pytest.raises(TypeError, match="sg_clipp"):
        loss.policy_loss(z, z, z, torch.ones(1, 2), 2, sg_clipp=False)
    with pytest.raises(TypeError, match="sg_clipp"):
        loss.LossSettings(sg_clipp=False)


# ---------------------------------------------------------------------------------------------------------------------
# The renames


def call_parts(text: str):
    """`module.name(keyword=value, ...)` -> (its callable, {keyword: value}); None for a plain dotted name."""
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call):
        return None
    return resolve(ast.unparse(node.func)), {k.arg: ast.literal_eval(k.value) for k in node.keywords}


def policy_loss_with(**kw):
    """loss.policy_loss on fixed (2, 5) inputs, with the keywords `kw`."""
    import loss
    z = torch.zeros(2, 5)
    return loss.policy_loss(z, z, z, torch.ones(2, 5), 10, **kw)


@pytest.mark.parametrize("old, new, since", RENAMED, ids=[old for old, _, _ in RENAMED])
def test_every_rename_holds(old, new, since):
    """What replaced a name works (a keyword: the settings it names are built), and the old name is gone: an
    AttributeError naming it, an old keyword a TypeError naming it (`surrogate="ppo"`, a value, a ValueError)."""
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", since), since
    replaced = call_parts(new)
    if replaced is None:
        assert resolve(new) is not None
    else:
        settings_cls, settings_kw = replaced
        settings_cls(**settings_kw)
    called = call_parts(old)
    if called is None:                                        # a name
        with pytest.raises(AttributeError, match=f"'{old.rsplit('.', 1)[1]}'"):
            resolve(old)
        return
    function, keywords = called                               # a keyword
    import loss
    with pytest.raises((TypeError, ValueError)) as raised:
        if function is loss.policy_loss:
            policy_loss_with(**keywords)
        else:
            function(**keywords)
    if raised.type is ValueError:
        assert all(repr(v) in str(raised.value) for v in keywords.values()), raised.value
    else:
        assert any(f"'{key}'" in str(raised.value) for key in keywords), raised.value


def test_an_old_name_is_gone():
    """The aliases went on 2026-12-07: an old name is Python's plain AttributeError, with no warning and no value."""
    import loss
    import reward
    import rollout
    import tools
    import train
    for module, name in [(tools, "parse_tool_call"), (rollout, "finish_reason"), (reward, "TOOL_TAGS"),
                         (train, "split_micro_batches")]:
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(module, name)
    for module in (tools, rollout, reward, train, loss):
        assert not hasattr(module, "__getattr__") and not hasattr(module, "_warned"), module.__name__


# ---------------------------------------------------------------------------------------------------------------------
# Where the README says each ablation switch is read


def switch_places() -> dict[str, list[str]]:
    """{switch: the places the README's sentence on the ablation switches names for it}, from its
    `--name` (off: ...; `file.py:function`, ...) items."""
    paragraph = " ".join(README.split("AEPO's four ablation switches", 1)[1].split("\n\n", 1)[0].split())
    items = re.findall(r"`--(\w+)` \(off: [^()]*?; ((?:`[\w/]+\.py:[\w.]+`(?:, )?)+)\)", paragraph)
    return {name: re.findall(r"`([\w/]+\.py:[\w.]+)`", places) for name, places in items}


def reads(place: str, name: str) -> bool:
    """Whether `file.py:qualname` is a function or method whose code (its docstring and comments aside) reads an
    attribute `name`: where the switch acts, not a class that holds or checks it."""
    path, qualname = place.split(":")
    found = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    for part in qualname.split("."):
        found = getattr(found, part)
    if not inspect.isfunction(found):
        return False
    tree = ast.parse(textwrap.dedent(inspect.getsource(found)))
    return any(isinstance(node, ast.Attribute) and node.attr == name for node in ast.walk(tree))


def test_the_readme_names_where_each_ablation_switch_is_read():
    places = switch_places()
    assert set(places) == {"dynamic_budget", "entropy_branching", "sg_clip", "entropy_advantage"}
    for switch, where in places.items():
        assert where, switch
        for place in where:
            assert reads(place, switch), f"the README says --{switch} is read in {place}, whose code does not read it"
