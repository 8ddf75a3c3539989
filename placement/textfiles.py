"""Reading the text files users hand the CLI and the gateway (configs, fleets, catalogs, profiles): each
problem is one line in the caller's error type — unreadable, a directory, not UTF-8, not valid YAML — never
a traceback. Callers keep their own wording for the file (`cannot read fleet file F: ...`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` that reads `1e3`, `1.5e3` and `2.5E-1` as floats, as YAML 1.2 (and JSON) do, and
    refuses a key given twice in one mapping.

    PyYAML follows YAML 1.1, whose floats need a dot and a signed exponent: `cost_per_hour: 1.5e3` came back
    as the string "1.5e3", which a strict number check then refused and a lax one silently converted. It also
    keeps the last of two equal keys without a word: a second `limits:` block dropped the first's settings
    (YAML 1.2 requires keys to be unique)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:  # the mapping's own keys: what `<<:` merges in may be overridden
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    if key in seen:
                        raise DuplicateKeyError(key, key_node.start_mark)
                    seen.add(key)
        return super().construct_mapping(node, deep=deep)


class DuplicateKeyError(yaml.MarkedYAMLError):
    def __init__(self, key: Any, mark: yaml.Mark) -> None:
        super().__init__(problem=f"key {key!r} given twice", problem_mark=mark)
        self.key = key


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_text(path: Path, error: type[ValueError], cannot_read: str) -> str:
    """The file's text; `error(cannot_read + reason)` when it cannot be read or is not UTF-8.

    `cannot_read` is the caller's message head, e.g. "cannot read fleet file f.yaml: "."""
    try:
        return path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise error(f"{cannot_read}is a directory") from None
    except OSError as exc:
        raise error(f"{cannot_read}{exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{cannot_read}not UTF-8 text (byte {exc.start})") from None


def parse_yaml(text: str, error: type[ValueError], not_valid: str) -> Any:
    """`yaml.safe_load(text)`, reading exponents and refusing repeated keys as YAML 1.2 does (`_Loader`);
    `error(not_valid + " at line N")` on a syntax error (PyYAML's own message spans several lines with a caret drawing; the line number is
    what a user needs)."""
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        if isinstance(exc, DuplicateKeyError):
            raise error(f"{not_valid}{at}: key {exc.key!r} is given twice in one mapping") from None
        raise error(f"{not_valid}{at}") from None
    except RecursionError:
        raise error(f"{not_valid}: nested too deeply") from None
    except ValueError as exc:  # an integer past Python's 4300-digit conversion limit
        raise error(f"{not_valid}: {exc}") from None


class _RepeatedJsonKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedJsonKey(key)
        out[key] = value
    return out


def parse_json(text: str, error: type[ValueError], not_valid: str) -> Any:
    """`json.loads(text)`, refusing a key given twice in one object as `parse_yaml` does (`json` keeps the
    last without a word); `error(not_valid + ": reason")` on any problem, including nesting too deep to
    parse and integers too long to convert."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except _RepeatedJsonKey as exc:
        raise error(f"{not_valid}: key {exc.key!r} is given twice in one mapping") from None
    except RecursionError:
        raise error(f"{not_valid}: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and the int conversion limit (4300 digits)
        raise error(f"{not_valid}: {exc}") from None
