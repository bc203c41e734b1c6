"""The surface a copier and a reader rely on, held to the documents that state it.

docs/reference.md's "The copy surface" lists, once, the names a copier of the paper's files uses; this test reads that
section: every listed name imports (a function or class is callable, a keyword is in its signature, and the keywords
of policy_loss and LossSettings are all listed), loss.py and advantage.py have no public function or class the list
leaves out, an unknown keyword is a TypeError, every alias of the renames gives its successor with one
DeprecationWarning naming it (none the second time), and every name that moved into the harness is there and gone
from the paper file. The README's sentence on the four ablation switches names where each is read: each named
function's code reads it.
"""
import ast
import importlib
import inspect
import re
import textwrap
import warnings
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


NAMES, RENAMES = SECTION.split("**Renames.**", 1)
LISTED = {row[0].strip("`").replace("` ", " "): re.findall(r"`(\w+)`", row[1]) for row in table_rows(NAMES)}
FILES = {label: names for label, names in LISTED.items() if label.endswith(".py")}
RENAMED = [(row[0].strip("`"), row[1].strip("`"), row[2]) for row in table_rows(RENAMES)]


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


def deprecations(call):
    """(call(), the messages of the DeprecationWarnings it emitted)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = call()
    return value, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


# ---------------------------------------------------------------------------------------------------------------------
# The names


def test_the_section_lists_the_paper_files_and_the_loss_keywords():
    assert set(FILES) == {"loss.py", "advantage.py", "rollout.py", "sampler.py", "tools.py", "reward.py"}
    assert {"loss.policy_loss keywords", "loss.LossSettings keywords"} <= set(LISTED)
    assert all(names for names in LISTED.values()) and RENAMED


@pytest.mark.parametrize("label", sorted(FILES))
def test_every_listed_name_imports(label):
    """A listed name is a current one (no alias's warning), and a function or class is callable."""
    module = importlib.import_module(label.removesuffix(".py"))
    for name in FILES[label]:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            value = getattr(module, name)
        assert name.isupper() or callable(value), f"{label}: {name} is not callable"


@pytest.mark.parametrize("label", ["loss.policy_loss keywords", "loss.LossSettings keywords"])
def test_the_listed_keywords_are_the_signatures(label):
    parameters = inspect.signature(resolve(label.split()[0])).parameters
    named = [name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert sorted(LISTED[label]) == sorted(named)


@pytest.mark.parametrize("module_name", ["loss", "advantage"])
def test_every_public_function_and_class_of_the_math_is_listed(module_name):
    tree = ast.parse((ROOT / f"{module_name}.py").read_text(encoding="utf-8"))
    public = {node.name for node in tree.body
              if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")}
    assert public <= set(FILES[f"{module_name}.py"]), public - set(FILES[f"{module_name}.py"])


def test_an_unknown_keyword_is_a_type_error_naming_it():
    import loss
    z = torch.zeros(1, 2)
    with pytest.raises(TypeError, match="sg_clipp.*its keywords are ref_logp, entropy, n_seqs, weights and settings"):
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


def loss_and_gradient(**kw):
    """policy_loss's value and gradient on fixed inputs (with a reference, an entropy and two sequences)."""
    import loss
    torch.manual_seed(0)
    logp = (torch.randn(2, 5) * 0.4).requires_grad_()
    old, adv, ref, entropy = torch.randn(2, 5) * 0.4, torch.randn(2, 5), torch.randn(2, 5) * 0.4, torch.rand(2, 5)
    value, _ = loss.policy_loss(logp, old, adv, torch.ones(2, 5), 10, ref_logp=ref, entropy=entropy, n_seqs=2, **kw)
    return value.detach(), *torch.autograd.grad(value, logp)


@pytest.mark.parametrize("old, new, how", RENAMED, ids=[old for old, _, _ in RENAMED])
def test_every_rename_holds(old, new, how):
    """An alias gives its successor (an old keyword: the settings it names) with one DeprecationWarning naming it, and
    none the second time; a name that moved into the harness is there, and gone from the paper's file."""
    if how.startswith("moved"):
        assert resolve(new) is not None
        with pytest.raises(AttributeError):
            resolve(old)
        return
    assert how.startswith("alias"), how
    module = importlib.import_module(old.split(".")[0])
    module._warned.clear()                                   # once per process: this test starts afresh
    called = call_parts(old)
    if called is None:                                        # a name
        get = lambda: resolve(old)                            # noqa: E731
        value, said = deprecations(get)
        assert value == resolve(new)
        assert len(said) == 1 and new in said[0], said
    else:                                                     # a keyword: the settings it names
        function, keywords = called
        settings_cls, settings_kw = call_parts(new)
        if function is settings_cls:
            get = lambda: function(**keywords)                # noqa: E731
            value, said = deprecations(get)
            assert value == settings_cls(**settings_kw)
        else:
            get = lambda: loss_and_gradient(**keywords)       # noqa: E731
            value, said = deprecations(get)
            want = loss_and_gradient(settings=settings_cls(**settings_kw))
            assert all(torch.equal(a, b) for a, b in zip(value, want))
        assert len(said) == 1 and all(key in said[0] for key in settings_kw), said
    assert deprecations(get)[1] == []


def test_the_old_parse_tool_call_still_parses():
    import tools
    tools._warned.discard("parse_tool_call")
    call, said = deprecations(lambda: tools.parse_tool_call("<think> x </think> <search> capital of France </search>"))
    assert call == tools.ToolCall("search", "capital of France")
    assert said == ["tools.parse_tool_call is now tools.TAGS.parse"]
    assert isinstance(tools.parse_tool_call("<python> print(1) </python>"), tools.ToolCall)


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
