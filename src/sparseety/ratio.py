"""A compression ratio (the share of the prompt a policy removes, kvpress's ``compression_ratio``): one
check and one message wherever a ratio is given (``--ratio``, ``--ratios``, batch lines, the server's
``sparsity.ratio``, run configuration files)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StrictFloat
from pydantic_core import PydanticCustomError

from sparseety.errors import ConfigError


def ratio_problem(value: float) -> str | None:
    """What is wrong with ``value`` as a ratio (``"must be a finite number in [0, 1), got nan"``,
    ``"must be in [0, 1), got 1.5"``), or None for a good one."""
    if not math.isfinite(value):
        return f"must be a finite number in [0, 1), got {value}"
    if not 0.0 <= value < 1.0:
        return f"must be in [0, 1), got {value}"
    return None


def check_ratio(value: float, name: str = "ratio") -> float:
    """``value`` when it is a ratio, else :class:`ConfigError` naming ``name``: ``"ratio must be a finite
    number in [0, 1), got nan"``."""
    problem = ratio_problem(value)
    if problem is not None:
        raise ConfigError(f"{name} {problem}")
    return value


def _validate(value: Any) -> Any:
    problem = ratio_problem(value)
    if problem is not None:  # the field's name is put in front by whoever reports the error
        raise PydanticCustomError("ratio", problem)
    return value


_SCHEMA = Field(json_schema_extra={"minimum": 0, "exclusiveMaximum": 1})  # documented, checked by _validate
Ratio = Annotated[float, AfterValidator(_validate), _SCHEMA]
"""A pydantic field type: a ratio (an int or a numeric string is taken as a float); the error's type is
``ratio`` and its message :func:`ratio_problem`'s, so a report reads ``sparsity.ratio: must be ...``."""
StrictRatio = Annotated[StrictFloat, AfterValidator(_validate), _SCHEMA]
"""As :data:`Ratio`, but only a JSON/YAML number is accepted (no string)."""
