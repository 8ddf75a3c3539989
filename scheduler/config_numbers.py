"""`NoBoolNumbers`: a pydantic base for config models that refuses a boolean where a number goes.

Pydantic's lax mode reads `true`/`false` (YAML's `yes`/`no` too) as 1 and 0 in an int or float field, so a
config with `gateway: {port: false}` served on a random port, `slo: {ttft_ms: true}` held TTFT to 1 ms and
`replicas: yes` started one worker, all without a word. Strict mode would refuse these, but also the strings
YAML gives enums and paths: only booleans are refused here, where the type says a number (a field, optional
or not, or a mapping's values or a list's items). Pure: no I/O.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ValidationInfo, field_validator


def is_number_type(annotation: Any) -> bool:
    """int or float, possibly Optional, Annotated or a union of them (not bool, not a union with str)."""
    if annotation in (int, float):
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return is_number_type(get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return bool(members) and all(is_number_type(a) for a in members)
    return False


def boolean_number(annotation: Any, value: Any) -> bool | None:
    """The boolean `value` holds where `annotation` wants a number (itself, a mapping's value or a list's item,
    as `routing.weights: {cost: true}`), or None."""
    if isinstance(value, bool):
        return value if is_number_type(annotation) else None
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return boolean_number(args[0], value)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        return boolean_number(members[0], value) if len(members) == 1 else None
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        items: Any = value.values()
        inner = args[1]
    elif origin in (list, tuple) and args and isinstance(value, list | tuple):
        items, inner = value, args[0]
    else:
        return None
    return next((b for v in items if (b := boolean_number(inner, v)) is not None), None)


class NoBoolNumbers(BaseModel):
    """Inherit it (with the model's own `model_config`): every number refuses a boolean, in a field of its
    own or as a mapping's value or a list's item."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is not None and isinstance(value, bool | dict | list | tuple):
            field = cls.model_fields.get(info.field_name)
            found = None if field is None else boolean_number(field.annotation, value)
            if found is not None:
                raise ValueError(f"Input should be a number, not a boolean ({str(found).lower()})")
        return value
