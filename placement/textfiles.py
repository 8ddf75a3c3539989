"""Reading the text files users hand the CLI and the gateway (configs, fleets, catalogs, profiles): each
problem is one line in the caller's error type — unreadable, a directory, not UTF-8, not valid YAML — never
a traceback. Callers keep their own wording for the file (`cannot read fleet file F: ...`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` that reads `1e3`, `1.5e3` and `2.5E-1` as floats, as YAML 1.2 (and JSON) do.

    PyYAML follows YAML 1.1, whose floats need a dot and a signed exponent: `cost_per_hour: 1.5e3` came back
    as the string "1.5e3", which a strict number check then refused and a lax one silently converted."""


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
    """`yaml.safe_load(text)`, reading exponents as YAML 1.2 does (`_Loader`); `error(not_valid + " at line N")`
    on a syntax error (PyYAML's own message spans several lines with a caret drawing; the line number is
    what a user needs)."""
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise error(f"{not_valid}{f' at line {mark.line + 1}' if mark is not None else ''}") from None
