"""A config dataclass as a command line: each field a setting with its meaning and valid values (`arg`, `expert`,
checked by `check_valid`), --help's groups, and the parser that fills the fields from flags, `--set KEY=VALUE` and
--config YAML files, turning every mistake into one line. harness.config's Config (train.py) and eval.py's EvalConfig
are built this way; harness.config holds what is train.py's own (its settings, the flags that went, the checks)."""
from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from dataclasses import field

from harness import configfile
from harness.cli import UserError


def arg(default, help: str, valid: str = "", **metadata):
    """A setting: its default, a one-line meaning and, where not every value of its type makes sense, the values it
    may take (`check_valid`): an interval "[1, inf)", "(0, 1]" (inf bounds open, and every value finite) or choices
    "ddp | fsdp"; group="title": this field opens --help's group of that title (the fields after it join it);
    expert=True (`expert`): rarely changed, listed in --help's last group instead. --help, docs/reference.md's tables
    and the check all read them from here."""
    metadata = {"help": help, "valid": valid, **metadata}
    return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata) \
        if isinstance(default, (dict, list)) else field(default=default, metadata=metadata)


def expert(default, help: str, valid: str = "", **metadata):
    """A setting users rarely change (`arg` with expert=True): a flag like any other, listed in --help's last group."""
    return arg(default, help, valid, expert=True, **metadata)


_INTERVAL = re.compile(r"([\[(])\s*([^,]+?)\s*,\s*([^\])]+?)\s*([\])])")


def within(value, valid: str) -> bool:
    """Whether `value` is one of `valid`'s choices or lies in its interval (see `arg`)."""
    interval = _INTERVAL.fullmatch(valid)
    if interval is None:
        return value in [choice.strip() for choice in valid.split("|")]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    opening, low, high, closing = interval.groups()
    low, high = float(low), float(high)
    return (low < value or (opening == "[" and low == value)) and (value < high or (closing == "]" and value == high))


def check_valid(settings) -> None:
    """Every setting of a config dataclass (Config, eval.py's EvalConfig) within its valid values, else a UserError
    naming the flag, its value and what it may be."""
    for f in dataclasses.fields(settings):
        valid, value = f.metadata.get("valid"), getattr(settings, f.name)
        if valid and not within(value, valid):
            what = "one of " + valid if _INTERVAL.fullmatch(valid) is None else "in " + valid
            raise UserError(f"--{f.name} {value!r} is out of range: it must be {what}")


RARELY_CHANGED = "rarely changed settings"         # the title of --help's last group


def expert_keys(cls) -> list[str]:
    """The settings of the config dataclass `cls` users rarely change (metadata expert): --help's last group."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("expert")]


def help_groups(cls) -> list[tuple[str, list[dataclasses.Field]]]:
    """--help's groups of the config dataclass `cls` as (title, fields), in field order: each field in the group the
    last field with metadata "group" opened, except the rarely changed ones (expert_keys), which form the last group,
    RARELY_CHANGED. The tables of docs/reference.md follow the same groups."""
    groups: dict[str, list[dataclasses.Field]] = {}
    title = ""
    for f in dataclasses.fields(cls):
        title = f.metadata.get("group", title)
        if not f.metadata.get("expert"):
            groups.setdefault(title, []).append(f)
    rare = [f for f in dataclasses.fields(cls) if f.metadata.get("expert")]
    return [*groups.items(), *([(RARELY_CHANGED, rare)] if rare else [])]


def build_parser(cls, prog: str = "train.py", description: str = "AEPO training (arXiv:2510.14545)"):
    """A parser with one flag per field of the dataclass `cls` (harness.config.Config, eval.py's EvalConfig), its help
    the field's meaning and valid values, in --help's groups (help_groups: the fields' own groups in their order, the
    rarely changed last); `--config FILE.yaml` fills any of them, `--set KEY=VALUE ...` is an alias of the flags
    (parse_args spells it out), and boolean flags also take their bare form (`--resume`)."""
    import argparse
    from jsonargparse import ActionConfigFile, ArgumentParser
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False, allow_abbrev=False,
                            print_config=None)              # no --print_config: a run saves its settings, config.yaml
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file of settings, each a plain key (later "
                                                                  "flags override it)")
    parser.add_argument("--set", metavar="KEY=VALUE", nargs="+", default=argparse.SUPPRESS,
                        help="an alias of the flags below: --set a=1 b=2 is --a 1 --b 2 (typed and checked the same)")
    types = typing.get_type_hints(cls)
    for title, fields in help_groups(cls):
        group = parser.add_argument_group(title)
        for f in fields:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            is_bool = types[f.name] is bool or bool in typing.get_args(types[f.name])
            bare = {"nargs": "?", "const": True} if is_bool else {}
            valid = f" (valid: {f.metadata['valid']})" if f.metadata.get("valid") else ""
            group.add_argument(f"--{f.name}", type=types[f.name], default=default, help=f.metadata["help"] + valid,
                               **bare)
    return parser


def parse_args(parser, argv, prog: str, cls, renamed: dict) -> dict:
    """The values of `parser` (build_parser(cls)) as a dict; a malformed command line becomes a
    UserError naming the flag. `--set KEY=VALUE` is parsed as the flag `--KEY=VALUE` in its place; a flag that went
    (a key of `renamed`) is a UserError saying what to give instead. A --config file that holds nothing (empty, or only
    comments) is an empty overlay; one that is not UTF-8, not valid YAML, gives a key twice or is not a mapping is a
    UserError naming it (configfile.load_settings)."""
    from jsonargparse import ArgumentError
    argv = configfile.without_empty_configs(argv)
    configfile.check_flags(argv, renamed)
    settings = [f.name for f in dataclasses.fields(cls)]
    expanded = configfile.expand_set(argv, settings, prog)
    configfile.check_values(expanded)                       # no alias bomb reaches the parser
    try:
        values = parser.parse_args(expanded).as_dict()
    except ArgumentError as err:
        message = " ".join(str(err).split())
        unknown = re.match(r"Option '([^']+)' is not accepted", message)        # a key of a --config file
        where = configfile.where_given(argv, unknown.group(1)) if unknown else ""
        raise UserError(f"{where}{message} (python {prog} --help lists every flag)") from None
    if "set" in values:                                     # only a --config file can give it: --set was spelled out
        raise UserError(f"{configfile.where_given(argv, 'set')}'set:' is not a setting: a --config file gives every "
                        f"setting as a plain key (e.g. {settings[0]}: ...)")
    return values
