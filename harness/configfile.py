"""The command line's settings before the parser: the YAML files that hold them (--config files, a run's config.yaml and
config_history.yaml) read strictly (UTF-8, valid YAML, each key once, a mapping at the top, aliases that expand it to
no more than MAX_VALUES values; anything else is one line naming the file and the line), the same bound on the YAML of
every flag's value, flags that went refused, and the alias --set KEY=VALUE spelled out as the flag --KEY=VALUE."""
from __future__ import annotations

import difflib
from collections.abc import Hashable
from pathlib import Path

import yaml

from harness.cli import UserError


MAX_VALUES = 10_000       # values a document's aliases may expand it to; a run's settings are a few hundred


class _KeyTwice(yaml.YAMLError):
    def __init__(self, key, line: int, first: int):
        super().__init__(f"line {line}: key {key!r} is given twice (first on line {first}); give each key once")


class _AliasBomb(yaml.YAMLError):
    """A document whose aliases (*name) repeat values past MAX_VALUES, or name a value they are inside of."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last value),
    and so is a document whose aliases would expand it past MAX_VALUES values (`expanded_size`)."""

    def compose_document(self):
        node = super().compose_document()
        sizes: dict[int, tuple | None] = {}
        total = expanded_size(node, sizes)
        if total > MAX_VALUES and total > len(sizes):         # more values than it holds: aliases repeat them
            size, line = min((size, n.start_mark.line + 1) for n, size in sizes.values() if size > MAX_VALUES)
            raise _AliasBomb(f"line {line}: its aliases (*name) expand this value to {size:,} values, more than the "
                             f"{MAX_VALUES:,} any settings need (an alias bomb); write the values out")
        return node

    def construct_mapping(self, node, deep=False):
        first = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":      # `<<: *base` merges another mapping: not a key
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):                  # the base class says what is wrong with it
                continue
            if key in first:
                raise _KeyTwice(key, key_node.start_mark.line + 1, first[key])
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def expanded_size(node, sizes: dict) -> int:
    """How many values (scalars, lists and mappings, keys included) the composed YAML `node` holds once every alias
    under it is written out, as a parser that copies the values (jsonargparse does) would build them. Counted on the
    composed graph, where an alias is the node it names, so each node is counted once and a "billion laughs" of a few
    hundred bytes is measured, never built. `sizes` collects (node, size) by id(node). An alias inside the value it
    names (which never ends when written out) is an error."""
    if id(node) in sizes:
        if sizes[id(node)] is None:
            raise _AliasBomb(f"line {node.start_mark.line + 1}: an alias (*name) inside the value it names repeats it "
                             "without end; write the values out")
        return sizes[id(node)][1]
    sizes[id(node)] = None                                    # open: an alias reaching it now is a loop
    if isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    size = 1 + sum(expanded_size(child, sizes) for child in children)
    sizes[id(node)] = (node, size)
    return size


def check_values(argv: list[str]) -> None:
    """The values the parser reads as YAML (each flag's value, and the text of a --config that names no file) within
    MAX_VALUES once their aliases are written out, else a UserError naming the flag. (A --config file is checked
    when it is read: load_all.)"""
    flag = ""
    for item in argv:
        if item.startswith("--"):
            flag, equals, item = item.partition("=")
            if not equals:
                continue
        try:
            yaml.compose(item, Loader=StrictLoader)
        except _AliasBomb as err:
            raise UserError(f"{flag}: {err}") from None
        except yaml.YAMLError:                                # not YAML: the parser says what is wrong
            continue


def load_all(path, where: str) -> list:
    """Every document of the YAML file `path`, read with StrictLoader. `where` names the file in the UserError that a
    file that cannot be read, is not UTF-8 or is not valid YAML (a key given twice included) becomes."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UserError(f"{where}: cannot be read ({err.strerror or err})") from None
    try:
        text = raw.decode("utf-8-sig")                          # a byte-order mark is not data
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise UserError(f"{where}: line {line} is not UTF-8 text (byte {raw[err.start]:#04x}); save the file as "
                        "UTF-8") from None
    try:
        return list(yaml.load_all(text, Loader=StrictLoader))
    except (_KeyTwice, _AliasBomb) as err:
        raise UserError(f"{where}: {err}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        raise UserError(f"{where}: not valid YAML: line {mark.line + 1}, column {mark.column + 1}: {err.problem}") \
            from None
    except yaml.YAMLError as err:
        raise UserError(f"{where}: not valid YAML ({' '.join(str(err).split())})") from None


def load_settings(path, where: str) -> dict | None:
    """The settings of the YAML file `path` (load_all): its one document, a mapping; None when it holds nothing
    (empty, or only comments)."""
    documents = [doc for doc in load_all(path, where) if doc is not None]
    if len(documents) > 1:
        raise UserError(f"{where}: {len(documents)} YAML documents (--- lines) in it; a settings file holds one")
    if documents:
        check_mapping(documents[0], where)
    return documents[0] if documents else None


def check_mapping(document, where: str) -> None:
    """A UserError naming `where` unless `document` is a mapping (setting: value)."""
    if not isinstance(document, dict):
        kind = {"list": "a list", "str": "a plain string", "int": "a number", "float": "a number",
                "bool": "true/false"}.get(type(document).__name__, type(document).__name__)
        raise UserError(f"{where}: its top level is {kind}, not a mapping of settings (one 'name: value' per line)")


def config_files(argv: list[str]) -> list[tuple[int, int, dict | None]]:
    """Each `--config FILE` (2 items) or `--config=FILE` (1) of argv that names a file, as (its index, its items, its
    settings: load_settings, None when it holds nothing). A --config that names no file is left to the parser (it
    reports a missing file, or reads the text itself as YAML)."""
    out = []
    for i, item in enumerate(argv):
        path = item.split("=", 1)[1] if item.startswith("--config=") else \
            argv[i + 1] if item == "--config" and i + 1 < len(argv) else None
        if path is not None and _is_file(path):
            out.append((i, 1 if item.startswith("--config=") else 2, load_settings(path, f"--config {path}")))
    return out


def where_given(argv: list[str], key: str) -> str:
    """'--config FILE: line N: ' for the first --config file of argv whose top level gives `key`, '' when none does:
    where a message about the key points."""
    for i, n, settings in config_files(argv):
        if settings and key in settings:
            path = argv[i].split("=", 1)[1] if n == 1 else argv[i + 1]
            top = yaml.compose(Path(path).read_text(encoding="utf-8-sig"), Loader=StrictLoader)
            lines = [key_node.start_mark.line + 1 for key_node, _ in top.value if key_node.value == key]
            return f"--config {path}: " + (f"line {lines[0]}: " if lines else "")
    return ""


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):                # a name too long for a file, a NUL byte: YAML text, if anything
        return False


def without_empty_configs(argv):
    """argv (None: sys.argv[1:]) without the `--config FILE` / `--config=FILE` pairs whose YAML holds nothing."""
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    empty = {i: n for i, n, loaded in config_files(argv) if loaded is None}
    out, i = [], 0
    while i < len(argv):
        if i not in empty:
            out.append(argv[i])
        i += empty.get(i, 1)
    return out


def check_flags(argv, renamed: dict) -> None:
    """A flag of `renamed` (an old one) on the command line or in a --config file is a UserError naming what replaced
    it."""
    argv = list(argv)
    keys = [item[2:].split("=", 1)[0] for item in argv if item.startswith("--")]
    for _, _, loaded in config_files(argv):
        keys += list(loaded) if isinstance(loaded, dict) else []
    for key in keys:
        if key in renamed:
            raise UserError(f"--{key} is gone: use {renamed[key]}")


def expand_set(argv: list[str], settings: list[str], prog: str) -> list[str]:
    """argv with each `--set KEY=VALUE [KEY=VALUE ...]` (or `--set=KEY=VALUE`) written as `--KEY=VALUE` in its place,
    for the parser to type as it types the flag (later items still win): --set is an alias of the flags. `settings`:
    the keys it takes, every setting of the command `prog`; another key (the closest names suggested) or an item
    without '=' is a UserError."""
    out, i = [], 0
    while i < len(argv):
        item = argv[i]
        i += 1
        if item != "--set" and not item.startswith("--set="):
            out.append(item)
            continue
        pairs = [item.split("=", 1)[1]] if item != "--set" else []
        while item == "--set" and i < len(argv) and not argv[i].startswith("--"):
            pairs.append(argv[i])
            i += 1
        if not pairs:
            raise UserError(f"--set needs KEY=VALUE, an alias of the flag --KEY VALUE (python {prog} --help)")
        for pair in pairs:
            key, equals, value = pair.partition("=")
            if not equals:
                raise UserError(f"--set {pair}: not KEY=VALUE, an alias of the flag --KEY VALUE (python {prog} --help)")
            if key not in settings:
                close = difflib.get_close_matches(key, settings, n=3)
                hint = f"did you mean {', '.join(close)}? " if close else ""
                raise UserError(f"--set {pair}: no such setting {key!r} ({hint}python {prog} --help lists them)")
            out.append(f"--{key}={value}")
    return out


def read_saved(run_dir: Path, flag: str) -> dict:
    """The settings a run last started with: the newest document of its config_history.yaml, else its config.yaml.
    A folder with neither (not a training run) or with either damaged (not YAML, not a mapping) is a UserError
    naming `flag` (--resume, eval.py's --run) and the file."""
    history, first = Path(run_dir) / "config_history.yaml", Path(run_dir) / "config.yaml"
    if not first.is_file():
        raise UserError(f"{flag} {run_dir}: no config.yaml there (not a training run folder)")
    where = f"{flag} {run_dir}: its {{}} (the run's settings) is damaged"
    if history.is_file():
        documents = [doc for doc in load_all(history, where.format(history.name)) if doc is not None]
        for doc in documents:
            check_mapping(doc, where.format(history.name))
        if documents:
            return documents[-1]
    saved = load_settings(first, where.format(first.name))
    if saved is None:
        raise UserError(f"{where.format(first.name)}: it is empty")
    return saved
