"""`NoBoolNumbers`: a pydantic base for config models that refuses a boolean where a number goes.

Pydantic's lax mode reads `true`/`false` (YAML's `yes`/`no` too) as 1 and 0 in an int or float field, so a
config with `gateway: {port: false}` served on a random port, `slo: {ttft_ms: true}` held TTFT to 1 ms and
`replicas: yes` started one worker, all without a word. Strict mode would refuse these, but also the strings
YAML gives enums and paths: only booleans are refused here, in fields whose type is a number (optional or
not; not inside lists or mappings). Pure: no I/O.
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


class NoBoolNumbers(BaseModel):
    """Inherit it (with the model's own `model_config`): every number field refuses a boolean."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and is_number_type(field.annotation):
                raise ValueError(f"Input should be a number, not a boolean ({str(value).lower()})")
        return value
