"""Run configuration files (``--config FILE``): one reviewed YAML file for a whole experiment.

The file has four sections, each optional::

    model: {path: smollm2-135m, tokenizer_path: null, max_new_tokens: 128}
    sparsity: {enabled: true, policy: h2o, kv_cache_limit: 2048, attention_topk: 16, token_pruning: true}
    extraction: {top_k: 16, min_score: 0.05, layers: auto}
    logging: {level: INFO, output_file: token_trace.jsonl, tier: 2, sample_rate: 1.0}

Every field maps onto a command-line flag (:meth:`RunFile.flag_values`); flags given on the command
line win over the file. Unknown keys, wrong types and impossible combinations raise
:class:`ConfigError` naming the key's path in the file and its line.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from sparseety.errors import ConfigError
from sparseety.run_file.checks import check_values
from sparseety.run_file.sections import ExtractionSection, LoggingSection, ModelSection, Section, SparsitySection
from sparseety.yaml_strict import line_of, load_yaml


class RunFile(Section):
    """A whole run configuration file."""

    model: ModelSection = Field(default_factory=ModelSection)
    sparsity: SparsitySection = Field(default_factory=SparsitySection)
    extraction: ExtractionSection = Field(default_factory=ExtractionSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)

    @classmethod
    def load(cls, path: str | Path) -> RunFile:
        """Read and validate ``path``; errors name the key path and its line in the file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        data = load_yaml(text, str(path))
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a config file holds one mapping of sections, got {type(data).__name__}")
        try:
            loaded = cls(**{str(key): value for key, value in data.items()})
        except ValidationError as exc:
            raise ConfigError(f"{path}: " + "; ".join(_problems(exc, text))) from None
        problem = check_values(loaded.sparsity, loaded.extraction, loaded.logging)
        if problem is not None:
            key, message = problem
            where = line_of(text, key.split("."))
            raise ConfigError(f"{path}: {key}: {message}" + (f" (line {where})" if where else ""))
        return loaded

    def flag_values(self, num_layers: int | None = None) -> dict[str, tuple[tuple[str, ...], Any]]:
        """What this file sets: ``{file key: (command parameter names that take it, value)}``.

        A key maps to the first of its parameter names that a command has (``serve`` calls the
        generation limit ``max_tokens``, ``run`` calls it ``max_new_tokens``).
        """
        m, s, e, g = self.model, self.sparsity, self.extraction, self.logging
        layers = ",".join(map(str, e.layers)) if isinstance(e.layers, list) else e.layers
        values: dict[str, tuple[tuple[str, ...], Any]] = {
            "model.path": (("model",), m.path),
            "model.tokenizer_path": (("tokenizer",), m.tokenizer_path),
            "model.max_new_tokens": (("max_new_tokens", "max_tokens"), m.max_new_tokens),
            "extraction.top_k": (("top_k",), e.top_k),
            "extraction.min_score": (("min_score",), e.min_score),
            "extraction.layers": (("layers",), layers),
            "extraction.importance": (("importance",), e.importance),
            "extraction.importance_weights": (("importance_weights",), e.importance_weights),
            "logging.tier": (("tier",), g.tier),
            "logging.sample_rate": (("sample_rate",), g.sample_rate),
            "logging.output_file": (("jsonl",), g.output_file),
        }
        if not s.enabled:
            values["sparsity.enabled"] = (("policy",), "dense")
        else:
            topk_policy = s.policy == "topk_attention"
            values.update({
                "sparsity.policy": (("policy", "policies"), s.policy),
                "sparsity.kv_cache_limit": (("budget",), None if topk_policy else s.kv_cache_limit),
                "sparsity.ratio": (("ratio", "ratios"), s.ratio),
                "sparsity.attention_topk": (("budget",) if topk_policy else ("attention_topk",), s.attention_topk),
                "sparsity.policy_opts": (("policy_opt",), [f"{k}={v}" for k, v in s.policy_opts.items()] or None),
                "sparsity.token_pruning": (("prune_schedule",), self.prune_schedule(num_layers)),
            })
        return {key: entry for key, entry in values.items() if entry[1] is not None}

    def prune_schedule(self, num_layers: int | None = None) -> str | None:
        """``token_pruning`` as a schedule string: a string as written; ``true`` as ``default`` (resolved
        against the model's depth once it is loaded), or as the schedule itself when ``num_layers`` is given."""
        pruning = self.sparsity.token_pruning
        if isinstance(pruning, str):
            return pruning
        if not pruning:
            return None
        from sparseety.prune_schedule import default_prune_schedule

        return "default" if num_layers is None else default_prune_schedule(num_layers)


def _problems(exc: ValidationError, text: str) -> list[str]:
    """One readable line per validation problem, with the key path and its line in the file."""
    out = []
    for err in exc.errors(include_url=False):
        loc = [str(part) for part in err["loc"] if not str(part).startswith(("function-", "literal[", "list[", "str", "bool", "int", "float"))]
        key = ".".join(loc)
        where = line_of(text, loc)
        at = f" (line {where})" if where else ""
        if err["type"] == "extra_forbidden":
            section = _section_model(loc[:-1])
            known = ", ".join(section.model_fields) if section else ""
            out.append(f"unknown key {key!r}{at}; known keys here: {known}")
        elif err["type"] == "value_error":
            message = str(err.get("ctx", {}).get("error", err["msg"]))
            out.append(f"{message}{at}")
        elif err["type"] == "ratio":  # the message says the range and the value
            out.append(f"{key} {err['msg']}{at}")
        else:
            allowed = err["msg"].replace("Input should be", "must be")
            out.append(f"{key or 'file'} {allowed}, got {err['input']!r}{at}")
    return list(dict.fromkeys(out))


def _section_model(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = RunFile
    for part in loc:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


F = TypeVar("F", bound=Callable[..., Any])


def with_run_file(fn: F) -> F:
    """Let a command take ``--config FILE``: values from the file fill every flag not given on the command line.

    The command must declare a ``config`` parameter and a ``typer.Context`` parameter. File keys the command has no flag for are reported
    on stderr, never dropped silently. ``logging.level`` sets the level of the ``sparseety`` logger.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        path = kwargs.get("config")
        if path is not None:
            run_file = RunFile.load(path)
            ctx = next((v for v in (*args, *kwargs.values()) if hasattr(v, "get_parameter_source")), None)
            if ctx is None:
                raise TypeError(f"{fn.__name__} takes --config but no typer.Context parameter")
            for key, (names, value) in run_file.flag_values().items():
                name = next((n for n in names if n in kwargs), None)
                if name is None:
                    print(f"note: {path}: {key} does not apply to `{ctx.info_name}`; ignored", file=sys.stderr)
                elif getattr(ctx.get_parameter_source(name), "name", None) not in ("COMMANDLINE", "ENVIRONMENT"):
                    # A list flag such as --policies or --ratios takes the single value as its text.
                    kwargs[name] = str(value) if isinstance(kwargs[name], str) and not isinstance(value, str) else value
            logging.getLogger("sparseety").setLevel(run_file.logging.level)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
