"""The documents stay true to the code: the reference's flag tables are the Config and EvalConfig dataclasses (names,
defaults, meanings) and --help's groups, the flag counts the documents state are --help's, every metric
train.py logs has a row in its metrics table, every `file.py:name` the documents cite resolves to a function or class
in that file, every § citation in the code and documents resolves to a heading of docs/algorithm.md (or names another
paper's section), every deviation is cited by a D<n> that exists, the paper's files open with the paper and their
deviations and harness modules with one line of what they do, every module stays within one sitting (<= 340 lines of code),
no test module imports another nor asserts on elapsed time, the top level holds the paper's files and entry points
only, and the README stays a reader's guide (<= 350 lines of <= 120 characters)."""
import ast
import dataclasses
import io
import json
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

import eval as evaluation
from harness import config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
REFERENCE = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
ALGORITHM = (ROOT / "docs" / "algorithm.md").read_text(encoding="utf-8")
MODULES = sorted([*ROOT.glob("*.py"), *(p for p in ROOT.glob("harness/**/*.py") if p != ROOT / "harness/__init__.py")])
PAPER_FILES = {"rollout.py", "loss.py", "advantage.py", "reward.py", "tools.py", "train.py", "eval.py"}


def flag_tables(section: str) -> list[tuple[str, dict[str, tuple[str, str, str]]]]:
    """The tables under the reference's heading `section`, each as (its bold title, {flag: (default, valid values,
    meaning)}), in order."""
    text = REFERENCE.split(section, 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^\*\*(.+?)\*\*$", text, flags=re.M)
    tables = []
    for title, body in zip(parts[1::2], parts[2::2]):
        rows = {}
        for line in body.splitlines():
            m = re.fullmatch(r"\| `--(\w+)` \| `(.*?)` \| (.*?) \| (.*) \|", line)
            if m:
                rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
        tables.append((title, rows))
    return tables


def help_flags(cls) -> list[str]:
    """The flags `--help` of the command whose config dataclass is `cls` lists, in order (--config and --set too)."""
    return re.findall(r"^  --(\w+)", config.build_parser(cls).format_help(), re.M)


@pytest.mark.parametrize("section, cls", [("## `train.py` flags", config.Config),
                                          ("## `eval.py` flags", evaluation.EvalConfig)], ids=["train", "eval"])
def test_flag_tables_are_the_configs(section, cls):
    """One table per group of --help, titled as the group, its rows the group's flags in --help's order; together
    every field of the dataclass, each row with its field's default, valid values and meaning."""
    tables = flag_tables(section)
    groups = config.help_groups(cls)
    assert [title for title, _ in tables] == [title for title, _ in groups]
    assert [list(rows) for _, rows in tables] == [[f.name for f in fields] for _, fields in groups]
    flags = {name: row for _, rows in tables for name, row in rows.items()}
    assert help_flags(cls) == ["config", "set", *flags]                        # the tables in --help's order
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert list(flags) == [f.name for _, group in groups for f in group] and set(flags) == set(fields)
    defaults = cls()
    for name, (default, valid, meaning) in flags.items():
        assert default == repr(getattr(defaults, name)), name
        assert valid == (fields[name].metadata.get("valid", "").replace("|", "/") or "—"), name
        assert meaning == fields[name].metadata["help"].replace("|", "/"), name


def test_the_flag_counts_the_documents_state_are_the_help():
    """Where a document says how many flags a command has (and how many of them --help's last group, the rarely
    changed settings, holds), the numbers are its --help's."""
    counts = {"train.py": config.Config, "eval.py": evaluation.EvalConfig}
    said = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md",
                 ROOT / "bench" / "README.md"]:
        text = " ".join(path.read_text(encoding="utf-8").split())
        for script, flags, lines, rare in re.findall(r"python (\w+\.py) --help` lists the (\d+) flags \((\d+) lines "
                                                     r"with `--config` and `--set`\), (\d+) of them in its last group",
                                                     text):
            listed, expert = help_flags(counts[script]), config.expert_keys(counts[script])
            said.append(script)
            assert (int(flags), int(lines), int(rare)) == (len(listed) - 2, len(listed), len(expert)), \
                f"{path.relative_to(ROOT)} says {script} has {flags} flags ({lines} lines), {rare} rarely changed; " \
                f"its --help has {len(listed) - 2} ({len(listed)}), {len(expert)}"
    assert sorted(set(said)) == ["eval.py", "train.py"]


def test_the_readme_hyperparameter_table_is_the_first_flag_group():
    """The README's hyperparameter table names exactly the flags of --help's first group (the paper's), in order."""
    table = README.split("## Hyperparameters and algorithms", 1)[1].split("\n\n", 2)[1]
    in_table = re.findall(r"`--(\w+)`", table)
    fields = dataclasses.fields(config.Config)
    second = next(i for i, f in enumerate(fields) if i and f.metadata.get("group"))
    first_group = [f.name for f in fields[:second]]
    assert fields[0].metadata["group"].startswith("the paper's") and sorted(in_table) == sorted(first_group)
    help_text = config.build_parser().format_help().split("\noptions:", 1)[1]          # past the usage block
    later = fields[second:]
    assert help_text.index(fields[0].metadata["group"]) < min(help_text.index(f"--{f.name} ") for f in later)


def test_every_flag_that_went_is_named_with_its_replacement():
    section = REFERENCE.split("## `train.py` flags", 1)[1].split("\n## ", 1)[0]
    for old, new in config.RENAMED.items():
        assert f"`--{old}` → {new.replace('|', '/')}" in section, old


def test_every_logged_metric_is_defined():
    """Every key of a real run's metrics.jsonl (the golden run's) is named in the metrics table; tools/… and time/…
    keys by their family."""
    table = REFERENCE.split("## The step line and `metrics.jsonl`", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w/…]+)`", table))
    keys = json.loads((ROOT / "tests" / "golden" / "tiny_two_steps.jsonl").read_text().splitlines()[0])
    keys = set(keys) | {"time/rollout", "time/old_logp", "time/update", "time/sync", "time/step", "update_tokens_per_s",
                        "time/rollout_slowest", "time/rollout_imbalance", "mismatch/k1", "mismatch/k3",
                        "mismatch/log_ppl_diff", "mismatch/ratio_p01", "mismatch/ratio_p50", "mismatch/ratio_p99",
                        "mismatch/out_2x", "probe_entropy", "memory/rollout", "memory/old_logp",
                        "memory/update", "memory/sync"}
    for key in keys:
        family = key.split("/")[0] + "/…"
        assert key in named or (key.startswith(("tools/", "type/")) and family in named), key


def cited_functions() -> set[tuple[str, str]]:
    return set(re.findall(r"`([\w/]+)\.py:(\w+)`", README + REFERENCE + ALGORITHM))


def test_cited_functions_exist():
    cited = cited_functions()
    assert len(cited) >= 15
    for module, name in sorted(cited):
        tree = ast.parse((ROOT / f"{module}.py").read_text(encoding="utf-8"))
        names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert name in names, f"the documents cite {module}.py:{name}, which does not exist"


def texts() -> dict[str, str]:
    """Every tracked text file that can cite the algorithm (code, documents, configs, scripts)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {f: (ROOT / f).read_text(encoding="utf-8") for f in files
            if f.endswith((".py", ".md", ".yaml", ".sh")) and (ROOT / f).exists()}


def test_every_section_citation_resolves():
    """A § citation names a section of docs/algorithm.md unless it follows `paper ` (arXiv:2510.14545's own sections)
    or another paper's arXiv id; every one of the algorithm's must be a heading there."""
    headings = set(re.findall(r"^#+ §(\w+)", ALGORITHM, re.M))
    assert {"1", "2a", "2b", "3b", "4", "7", "8"} <= headings
    for path, text in texts().items():
        for m in re.finditer(r"§(\w+)", text):
            before = text[max(0, m.start() - 24):m.start()]
            if re.search(r"(paper |arXiv:\d{4}\.\d{5},? )$", before):
                continue
            assert m.group(1) in headings, f"{path}: §{m.group(1)} is not a section of docs/algorithm.md"
        spec = "S" + "PEC"                       # the steering document, which is not in the repository
        assert spec not in text.replace(spec + "IAL", ""), f"{path} cites the {spec}"


def test_every_deviation_number_exists():
    listed = set(re.findall(r"^- (D\d+)\. ", ALGORITHM, re.M))
    assert listed == {f"D{i}" for i in range(1, len(listed) + 1)}
    for path, text in texts().items():
        for number in re.findall(r"\b(D\d+)\b", text):
            assert number in listed, f"{path} cites deviation {number}, which docs/algorithm.md does not list"


def test_the_top_level_is_the_paper_and_the_entry_points():
    """The paper's files and the entry points, and sampler.py and rounds.py: the rollout's side of a generation backend
    and the trees' rounds on it, which copy with rollout.py (README: Files and the paper)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    top = {f for f in files if "/" not in f and f.endswith(".py")}
    assert top == PAPER_FILES | {"sampler.py", "rounds.py"}


def test_the_readme_is_a_readers_guide():
    assert len(README.splitlines()) <= 350
    long = [i for i, line in enumerate(README.splitlines(), 1) if len(line) > 120]
    assert not long, f"README lines over 120 characters: {long}"
    assert "PLACEHOLDER" not in README


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_docstring_and_size(path):
    """A paper file opens with the paper and its deviations; a harness module with one line saying what it does, and
    no filler ("No equation lives here", "Deviations ...: None"). Every module stays within one sitting."""
    text = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(text)) or ""
    if path.name in PAPER_FILES and path.parent == ROOT:
        assert "arXiv:2510.14545" in doc and "Deviations from the paper / official code" in doc, path.name
    else:
        assert doc and len(doc.splitlines()[0]) > 20, f"{path.name}: no first line saying what it does"
        assert "No equation lives here" not in doc, path.name
        assert not re.search(r"Deviations from the paper[^\n]*: None", doc), path.name
    assert code_lines(text) <= CODE_LINES, f"{path.name}: {code_lines(text)} lines of code"


CODE_LINES = 340        # a module read in one sitting: its code, with docstrings and comments free to explain it


def code_lines(text: str) -> int:
    """Lines that hold code: not blank, not only a comment, not a module's, class's or function's docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                docstrings |= set(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines |= set(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_counts_code_only():
    text = '"""Doc\n\nstring."""\n# a comment\n\ndef f(x):\n    """Its doc."""\n    return (x +  # why\n            1)\n'
    assert code_lines(text) == 3                 # def, return, the continuation
    assert code_lines(text + "y = '''a\nb'''\n") == 5      # a string that is not a docstring is code


def test_deviation_references_are_d_numbers():
    """A deviation is cited by its D-number only: no "deviation <number>" or numbered local lists, which go stale."""
    for path, text in texts().items():
        assert not re.search(r"\bdeviation \d+", text, re.I), f"{path} cites a deviation by a local number"
        assert not re.search(r"Deviations from the paper[^\n]*:\s*\n\s*\d+\.", text), f"{path}: a numbered list"


def test_no_test_module_imports_another():
    """Shared fixtures and doubles live in tests/conftest.py and tests/fakes.py; a test module imports neither
    another test module nor its helpers."""
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        imports = re.findall(r"^\s*(?:from|import) tests\.(test_\w+)", path.read_text(encoding="utf-8"), re.M)
        assert not imports, f"{path.name} imports {imports}"


# a clock read in an assert statement, a measured duration bounded, a clock difference bounded
TIMED = [re.compile(r"\btime\.(monotonic|time|perf_counter)\(\)"),
         re.compile(r"\b(elapsed|seconds|duration|took)\w*\s*<"), re.compile(r"-\s*(start|started|t0)\b\s*<")]


def timed_assertions(text: str, name: str) -> list[str]:
    """`name:line` of every assert statement of the Python source `text` that asserts on elapsed time (TIMED)."""
    return [f"{name}:{node.lineno}" for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Assert)
            and any(pattern.search(ast.get_source_segment(text, node)) for pattern in TIMED)]


def test_no_test_asserts_on_elapsed_time():
    """A test asserts what a call returned or did, never how long it took (a loaded machine fails it; bench/ measures
    time). A polling helper's deadline only bounds a wait that would otherwise hang: past it the helper fails with
    "X never happened", not with an assert on the clock. Every Python file under tests/ is read."""
    old_mcp_test = ("def test_a_call_past_the_timeout_is_an_observation(server):\n    start = time.monotonic()\n"
                    "    assert tool(server, 'sleep').run([{'seconds': 30}]) == [('timed out', 'timeout')]\n"
                    "    assert time.monotonic() - start < 10\n")
    assert timed_assertions(old_mcp_test, "test_mcp.py") == ["test_mcp.py:4"]        # the detector detects
    found = [hit for path in sorted((ROOT / "tests").rglob("*.py"))
             for hit in timed_assertions(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not found, f"assertions on elapsed time: {', '.join(found)}"


def test_the_readmes_deviation_range_is_the_lists():
    """The README's "(D1-Dn)" names the last deviation algorithm.md lists, and the list runs D1, D2, ... in order."""
    listed = [int(n) for n in re.findall(r"^- D(\d+)\.", ALGORITHM, re.M)]
    assert listed == list(range(1, len(listed) + 1)), "algorithm.md's deviations out of number order"
    assert re.search(r"\(D1-D(\d+)\)", README).group(1) == str(max(listed)), "README's deviation range"
