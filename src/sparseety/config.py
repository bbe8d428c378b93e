"""Typed, validated configuration models; every invalid value raises :class:`ConfigError`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

from sparseety.errors import ConfigError
from sparseety.yaml_strict import line_of, load_yaml

MAX_TOKENS = 1 << 20
"""The most tokens any setting may name (a budget, a top-k, a generation length): past any model's context."""


class _Invalid(ConfigError):
    """A :class:`ConfigError` that keeps pydantic's errors, so a file loader can add each key's line."""

    def __init__(self, message: str, validation: ValidationError) -> None:
        super().__init__(message)
        self.validation = validation


class ValidatedConfig(BaseModel):
    """Base of SparSEEty's configs: frozen, unknown keys refused, errors raised as :class:`ConfigError`.

    Construct with keyword arguments, :meth:`from_mapping` or :meth:`from_yaml`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _Invalid(_describe(type(self), exc), exc) from None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Self:
        """Build from a mapping of field names to values."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{cls.__name__} must be a mapping of field names, got {type(data).__name__}")
        return cls(**{str(key): value for key, value in data.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> Self:
        """Load from a YAML file holding one mapping (an empty file gives the defaults)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        data = load_yaml(text, str(path))
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: {cls.__name__} must be a mapping of field names, got {type(data).__name__}")
        try:
            return cls(**{str(key): value for key, value in data.items()})
        except _Invalid as exc:
            raise ConfigError(f"{path}: {_describe(cls, exc.validation, text)}") from None
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


def _describe(model: type[BaseModel], exc: ValidationError, text: str | None = None) -> str:
    """One line per problem, each naming the field and what it accepts (and its line in ``text``)."""
    problems = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(part) for part in err["loc"])
        where = line_of(text, [str(part) for part in err["loc"]]) if text is not None and field else None
        at = f" (line {where})" if where else ""
        if err["type"] == "extra_forbidden":
            known = ", ".join(model.model_fields)
            problems.append(f"unknown key {field!r}{at} (known keys: {known})")
        elif not field or err["type"] == "value_error":  # a cross-field check, or a validator's own message
            problems.append(str(err.get("ctx", {}).get("error", err["msg"])))
        else:
            allowed = err["msg"].replace("Input should be", "must be")
            problems.append(f"{field} {allowed}, got {err['input']!r}{at}")
    return f"invalid {model.__name__}: " + "; ".join(problems)


class ExtractionConfig(ValidatedConfig):
    """How :func:`sparseety.extract.extract` turns a signal into ranked token records.

    Attributes
    ----------
    score_type : ``attention`` (weights ``[batch, heads, query, key]`` in some layout), ``route``
        (MoE router ``[tokens, experts]``) or ``activation`` (hidden states ``[tokens, hidden]``).
    layout : axis names of an attention tensor: ``bhqk``, ``hqk``, ``qk`` or the transposed ``bhkq``,
        ``hkq``, ``kq``; None picks ``bhqk``/``hqk``/``qk`` by rank. Attention only.
    batch_index : which batch row to use when the batch axis is longer than 1.
    head_reduce : ``mean`` or ``max`` over heads, or ``none`` for one ranking per head.
    query_reduce : how the attention key *j* receives from the query rows folds into one score:
        ``sum``, ``mean``, ``max`` or ``last`` (the last query row only). Applied before ``head_reduce``.
    route_input : whether route signals hold ``probs`` or ``logits`` (soft-maxed over experts).
    experts_k : how many top experts each route record lists, and each token counts towards the load.
    activation_reduce : ``maxabs``, ``l2`` or ``nonzero_frac`` (share of ``|a| > zero_eps``) over hidden.
    zero_eps : threshold of ``nonzero_frac``.
    normalize : ``l2``, ``l1`` or ``max`` (divide by the largest absolute score), or ``none``; applied
        to each per-token score vector before ``top_k`` and ``min_score``.
    top_k : most records per ranking.
    min_score : a token is kept when its (normalized) score is at least this; in ``[0, 1)``.
    token_offset : how many leading tokens are absent from the signal (e.g. a trimmed BOS).
    exclude_special : drop tokens whose id is in ``special_ids`` from the rankings.
    special_ids : ids of special tokens; they get ``token_type`` ``special``.
    exclude_positions : positions left out of the rankings (attention sinks, see
        :func:`sparseety.extract.scoring.find_sinks`).
    """

    score_type: Literal["attention", "route", "activation"] = "attention"
    layout: Literal["bhqk", "hqk", "qk", "bhkq", "hkq", "kq"] | None = None
    batch_index: StrictInt | None = Field(None, ge=0, le=MAX_TOKENS)
    head_reduce: Literal["mean", "max", "none"] = "mean"
    query_reduce: Literal["sum", "mean", "max", "last"] = "sum"
    route_input: Literal["probs", "logits"] = "probs"
    experts_k: StrictInt = Field(2, gt=0, le=4096)
    activation_reduce: Literal["maxabs", "l2", "nonzero_frac"] = "maxabs"
    zero_eps: float = Field(1e-6, ge=0, le=1e6, strict=True, allow_inf_nan=False)
    normalize: Literal["l2", "l1", "max", "none"] = "max"
    top_k: StrictInt = Field(16, gt=0, le=MAX_TOKENS)
    min_score: float = Field(0.05, ge=0, lt=1, strict=True)
    token_offset: StrictInt = Field(0, ge=0, le=MAX_TOKENS)
    exclude_special: StrictBool = False
    special_ids: tuple[Annotated[StrictInt, Field(ge=0, le=1 << 31)], ...] = ()
    exclude_positions: tuple[Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS)], ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.layout is not None and self.score_type != "attention":
            raise ValueError(f"layout {self.layout!r} applies to attention only, but score_type is {self.score_type!r}")
        if self.exclude_special and not self.special_ids:
            raise ValueError("exclude_special is set but special_ids is empty: give the special token ids")
        return self
