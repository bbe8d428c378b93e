"""The sections of a run configuration file (:class:`sparseety.run_file.RunFile`), each a strict model of its keys."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from sparseety.config import MAX_TOKENS
from sparseety.errors import ConfigError
from sparseety.ratio import StrictRatio


class Section(BaseModel):
    """A part of the file: unknown keys are refused, values are frozen once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(Section):
    """Which model, which tokenizer, how long to generate."""

    path: StrictStr | None = None
    tokenizer_path: StrictStr | None = None
    max_new_tokens: StrictInt | None = Field(None, gt=0, le=MAX_TOKENS)


class SparsitySection(Section):
    """The KV policy and its budget, top-k attention and token pruning."""

    enabled: StrictBool = True
    policy: StrictStr | None = None
    kv_cache_limit: StrictInt | None = Field(None, gt=0, le=MAX_TOKENS)
    ratio: StrictRatio | None = None
    attention_topk: StrictInt | None = Field(None, gt=0, le=MAX_TOKENS)
    token_pruning: StrictBool | StrictStr = False
    policy_opts: dict[StrictStr, StrictStr | StrictInt | StrictFloat | StrictBool] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.kv_cache_limit is not None and self.ratio is not None:
            raise ValueError("sparsity.kv_cache_limit and sparsity.ratio both set: give one budget")
        if not self.enabled:
            set_keys = [k for k in ("policy", "kv_cache_limit", "ratio", "attention_topk") if getattr(self, k) is not None]
            if self.token_pruning:
                set_keys.append("token_pruning")
            if set_keys:
                raise ValueError(f"sparsity.enabled is false but sparsity.{set_keys[0]} is set")
        if self.policy is not None:
            from sparseety.policies.registry import get_policy_class

            try:
                get_policy_class(self.policy)
            except ConfigError as exc:
                raise ValueError(f"sparsity.policy: {exc}") from None
        if self.policy == "topk_attention" and self.attention_topk is not None and self.kv_cache_limit is not None \
                and self.attention_topk != self.kv_cache_limit:
            raise ValueError("policy topk_attention takes its k from sparsity.attention_topk; "
                             f"sparsity.kv_cache_limit ({self.kv_cache_limit}) contradicts it ({self.attention_topk})")
        return self


class ExtractionSection(Section):
    """How many important tokens, above which score, at which layers."""

    top_k: StrictInt | None = Field(None, gt=0, le=MAX_TOKENS)
    min_score: StrictFloat | None = Field(None, ge=0, lt=1, allow_inf_nan=False)
    layers: Literal["all", "auto"] | list[StrictInt] | StrictStr | None = None
    importance: Literal["attention", "value", "output", "learned"] | None = None  #: ``--importance``
    importance_weights: StrictStr | None = None  #: ``--importance-weights`` (``learned``)


class LoggingSection(Section):
    """Log level, a JSONL copy of each run, trace tier and sampling."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    output_file: StrictStr | None = None
    tier: StrictInt | None = Field(None, ge=0, le=3)
    sample_rate: StrictFloat | StrictInt | None = Field(None, ge=0, le=1, allow_inf_nan=False)
