"""The generation flags that ``run`` and ``compare`` share, declared once, and the decorator that gives them.

:data:`GENERATION_FLAGS` lists the flags in their ``--help`` order; :func:`generation_flags` adds them to
a command's signature (what Typer reads), gathers the ones that are :class:`RunInputs` fields into one
``inputs: RunInputs`` argument and hands the others (``model``, ``trace_dir``, ``as_json``) to the
command by name. Adding a generation flag to both commands is one ``*_OPT`` in
:mod:`sparseety.cli.run_inputs`, one :class:`RunInputs` field and one line here.

The decorator goes under :func:`~sparseety.cli.app.user_errors` and
:func:`~sparseety.run_file.with_run_file`, so those see every flag by its parameter name (the range
check, ``--config`` keys) exactly as if the command had declared it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sparseety.cli import run_inputs as opt
from sparseety.cli.run_inputs import RunInputs

#: (parameter, type, option) of every shared flag, in ``--help`` order
GENERATION_FLAGS: tuple[tuple[str, Any, Any], ...] = (
    ("model", str, opt.MODEL_OPT),
    ("prompt", str | None, opt.PROMPT_OPT),
    ("prompt_file", Path | None, opt.PROMPT_FILE_OPT),
    ("context_file", Path | None, opt.CONTEXT_FILE_OPT),
    ("question", str | None, opt.QUESTION_OPT),
    ("chat", bool | None, opt.CHAT_OPT),
    ("policy", str, opt.POLICY_OPT),
    ("budget", int | None, opt.BUDGET_OPT),
    ("ratio", float | None, opt.RATIO_OPT),
    ("policy_opt", list[str], opt.POLICY_OPT_OPT),
    ("max_new_tokens", int, opt.MAX_NEW_TOKENS_OPT),
    ("tier", int, opt.TIER_OPT),
    ("top_k", int, opt.TOP_K_OPT),
    ("min_score", float, opt.MIN_SCORE_OPT),
    ("importance", str, opt.IMPORTANCE_OPT),
    ("importance_weights", Path | None, opt.IMPORTANCE_WEIGHTS_OPT),
    ("speculative", int | None, opt.SPECULATIVE_OPT),
    ("prune_schedule", str | None, opt.PRUNE_SCHEDULE_OPT),
    ("prune_opt", list[str], opt.PRUNE_OPT_OPT),
    ("attention_topk", int | None, opt.ATTENTION_TOPK_OPT),
    ("layers", str, opt.LAYERS_OPT),
    ("trace_dir", Path, opt.TRACE_DIR_OPT),
    ("seed", int, opt.SEED_OPT),
    ("as_json", bool, opt.JSON_OPT),
)
#: the shared flags gathered into ``inputs`` (every :class:`RunInputs` field); the rest go to the command by name
INPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RunInputs) if f.init)
_UNDECLARED = sorted(set(INPUT_FIELDS) - {name for name, _, _ in GENERATION_FLAGS})
if _UNDECLARED:
    raise TypeError(f"RunInputs fields without a shared flag in GENERATION_FLAGS: {_UNDECLARED}")

F = TypeVar("F", bound=Callable[..., Any])


def generation_flags(command: F) -> F:
    """Give ``command`` the shared flags in place of its ``inputs: RunInputs`` parameter.

    ``command`` declares ``inputs`` and, by name with no default, each shared flag that is not a
    :class:`RunInputs` field; ``--help`` lists its Context and ``--config`` first, then
    :data:`GENERATION_FLAGS`, then the command's own flags in its order.

    Raises
    ------
    TypeError
        At import, when ``command`` lacks ``inputs`` or a shared flag it must take by name.
    """
    body = inspect.signature(command, eval_str=True)
    by_name = {name for name, _, _ in GENERATION_FLAGS} - set(INPUT_FIELDS)
    missing = sorted(({"inputs"} | by_name) - set(body.parameters))
    if missing:
        raise TypeError(f"{command.__name__} takes the generation flags but has no parameter {', '.join(missing)}")
    own = [p for name, p in body.parameters.items() if name != "inputs" and name not in by_name]
    lead = [p for p in own if p.default is p.empty or p.name == "config"]
    shared = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option, annotation=kind)
              for name, kind, option in GENERATION_FLAGS]
    exposed = body.replace(parameters=[*lead, *shared, *(p for p in own if p not in lead)])

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        inputs = RunInputs(**{name: kwargs.pop(name) for name in INPUT_FIELDS})
        return command(*args, inputs=inputs, **kwargs)

    wrapper.__signature__ = exposed  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in exposed.parameters.values()}
    wrapper.__annotations__["return"] = exposed.return_annotation
    return wrapper  # type: ignore[return-value]
