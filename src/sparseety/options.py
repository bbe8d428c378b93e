"""``GenerationOptions``: what one generation is asked to do, with every default written once.

Every door builds this one frozen object: the command line (``run``, ``compare``, batch lines), run
configuration files (through the flags they fill), the server (its configuration's defaults plus each
request body) and the Python API (:meth:`sparseety.engine.SparseEngine.generate` keywords,
:func:`sparseety.load`). The engine receives it whole. It is validated once, here, in
``__post_init__``; what needs the model (layer numbers against its depth, a ``default`` pruning
schedule, learned head weights against its fingerprint) is checked by the engine when the run starts.
Every refusal is an :class:`OptionError` (an ``InputError``) naming its field, a refusal of the policy
registry or the pruning-schedule parser too (:class:`OptionRefusal`, which stays the ``ConfigError`` they
raise). A number is an ``int`` or ``float`` that is not a ``bool`` (:func:`is_int`, :func:`is_number`).

This module sits on the ground floor: it imports nothing from the engine, the CLI or the server, and no
torch at import time, so the CLI reads its defaults without loading a model stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from sparseety.errors import ConfigError, InputError
from sparseety.errors import shown as _shown

if TYPE_CHECKING:
    from sparseety.policies.base import Policy
    from sparseety.prune_schedule import PruneSchedule

ImportanceMode = Literal["attention", "value", "output", "learned"]
#: what importance records (:mod:`sparseety.extract.scoring` describes each)
IMPORTANCE_MODES: tuple[str, ...] = ("attention", "value", "output", "learned")
#: the faithful mode (``sparseety bench faithfulness``: see the README's table), the default from every door
DEFAULT_IMPORTANCE: ImportanceMode = "value"
#: the command-line flag of a field where it is not ``--`` plus the field with dashes
FLAGS: Mapping[str, str] = MappingProxyType({"policy_opts": "--policy-opt", "prune": "--prune-schedule",
                                             "prune_opts": "--prune-opt"})


class OptionError(InputError, ValueError):
    """A refused option; ``str()`` names the Python field, :meth:`flag_error` the command-line flag.

    A ``ValueError`` too, so a pydantic model that builds the options (the server's configuration)
    reports it as one of its validation errors.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem

    def flag_error(self) -> InputError:
        """The same refusal naming the flag (``--importance must be one of ...``)."""
        return InputError(f"{flag_of(self.field)} {self.problem}")


class OptionRefusal(OptionError, ConfigError):
    """A value refused by the check a field is handed to (the policy registry, the pruning-schedule parser, the
    engine's checks against the model), with ``field`` set to the field it came in. Its message is that check's
    own, which names the value already (``budget must be a positive integer, got 0``, ``streaming: unknown option
    'bogus'``), so every door says the same; an :class:`OptionError` (an ``InputError``) like every refused
    option, and still the ``ConfigError`` the check raised, for code that catches that."""

    def __init__(self, field: str, refusal: ConfigError) -> None:
        InputError.__init__(self, str(refusal))
        self.field, self.problem = field, str(refusal)

    def flag_error(self) -> InputError:
        """The message names the flag already where it names one (``policy 'h2o' needs --budget N``)."""
        return self


@contextlib.contextmanager
def refused(field: str) -> Iterator[None]:
    """Inside the block, a :class:`ConfigError` that is not already an :class:`OptionError` is re-raised as
    the :class:`OptionRefusal` of ``field``."""
    try:
        yield
    except OptionError:
        raise
    except ConfigError as exc:
        raise OptionRefusal(field, exc) from None


def is_int(value: Any) -> bool:
    """A whole number: an ``int`` that is not a ``bool`` (``True`` is no budget, ``"16"`` no number)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or a ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flag_of(field: str) -> str:
    """The command-line flag that sets ``field``."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """Everything one generation is asked besides its input; frozen, validated once.

    Attributes
    ----------
    policy, budget, ratio, policy_opts : the KV policy: its name (``sparseety policies list``), slots kept per
        layer and KV head or the fraction of the context removed (kvpress's ``compression_ratio``; not both),
        and its options (``{"window": 8}``; strings are converted to each option's type). A
        :class:`~sparseety.policies.base.Policy` object handed to the engine beside the options wins over these.
    max_new_tokens : generation length limit.
    tier : 0 nothing, 1 counts and timings, 2 tokens, events and importance, 3 per-step vectors.
    top_k : important tokens per layer (tier >= 2).
    min_score : important-token records scoring below this share of their ranking's maximum are dropped.
    layers : layers recording importance: ``"all"``, ``"auto"``, ``"0,15,29"`` or layer numbers (checked
        against the model when the run starts).
    importance : what importance records: ``attention``, ``value`` (the default), ``output`` or ``learned``.
    importance_weights : ``learned``: head weights (a :class:`~sparseety.extract.head_weights.HeadWeights` or
        its file; None: the weights shipped for the model).
    speculative : draft this many tokens per step by prompt lookup (one sequence at a time).
    attention_topk : while decoding, attend only to this many highest-scoring held slots per KV head.
    prune, prune_opts : token pruning of the prompt forward: a
        :class:`~sparseety.prune_schedule.PruneSchedule`, or its text (``"8:0.3,16:0.5"`` or ``"default"``,
        resolved against the model's depth) with options (``keep_recent``, ``sinks``, ``window``).
    seed : seed for seeded policies.
    """

    policy: str = "dense"
    budget: int | None = None
    ratio: float | None = None
    policy_opts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_new_tokens: int = 64
    tier: int = 2
    top_k: int = 16
    min_score: float = 0.0
    layers: str | Sequence[int] | None = "all"
    importance: ImportanceMode = DEFAULT_IMPORTANCE
    importance_weights: Any = None
    speculative: int | None = None
    attention_topk: int | None = None
    prune: PruneSchedule | str | None = None
    prune_opts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):
            raise OptionError("policy", f"must be a policy name (sparseety policies list), got {_shown(self.policy)}")
        for name in ("policy_opts", "prune_opts"):
            if not isinstance(getattr(self, name), Mapping):
                raise OptionError(name, f"must be a mapping of option names to values, got {_shown(getattr(self, name))}")
        object.__setattr__(self, "policy_opts", MappingProxyType(dict(self.policy_opts)))
        object.__setattr__(self, "prune_opts", MappingProxyType(dict(self.prune_opts)))
        if self.budget is not None:
            _whole(self.budget, "budget")
        if self.ratio is not None and not is_number(self.ratio):
            raise OptionError("ratio", f"must be a number in [0, 1), got {_shown(self.ratio)}")
        if not is_number(self.min_score):
            raise OptionError("min_score", f"must be a number in [0, 1), got {_shown(self.min_score)}")
        if self.importance not in IMPORTANCE_MODES:
            raise OptionError("importance", f"must be one of {', '.join(IMPORTANCE_MODES)}, got {self.importance!r}")
        if self.importance_weights is not None and self.importance != "learned":
            raise OptionError("importance_weights", f"need importance 'learned' (importance is {self.importance!r})")
        _whole(self.tier, "tier")
        if self.tier not in (0, 1, 2, 3):
            raise OptionError("tier", f"must be 0, 1, 2 or 3, got {self.tier}")
        for name in ("max_new_tokens", "top_k"):
            if _whole(getattr(self, name), name) <= 0:
                raise OptionError(name, f"must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.min_score < 1.0:
            raise OptionError("min_score", f"must be in [0, 1), got {self.min_score}")
        if self.speculative is not None and _whole(self.speculative, "speculative") <= 0:
            raise OptionError("speculative", f"must be a positive number of draft tokens, got {self.speculative}")
        if self.attention_topk is not None and _whole(self.attention_topk, "attention_topk") <= 0:
            raise OptionError("attention_topk", f"must be a positive number of slots, got {self.attention_topk}")
        if _whole(self.seed, "seed") < 0:
            raise OptionError("seed", f"must be 0 or more, got {self.seed}")
        if not isinstance(self.layers, (str, Sequence)) and self.layers is not None and \
                type(self.layers).__name__ != "LayerSelection":
            raise OptionError("layers", f"must be all, auto or layer numbers, got {self.layers!r}")
        self._check_policy()
        self._check_prune()

    def _check_policy(self) -> None:
        """The registry's checks, in its order, each refusal naming the field it is about."""
        from sparseety.policies.base import BudgetTooSmall
        from sparseety.policies.registry import build_policy, get_policy_class, policy_kwargs, resolve_budget

        with refused("policy"):
            cls = get_policy_class(self.policy)
        with refused("policy_opts"):
            options = policy_kwargs(self.policy, dict(self.policy_opts))
        sized = self._sized_by()
        # both refused; a ratio is checked against a large context, the real budget comes from the input (policy_for)
        with refused(sized):
            budget = resolve_budget(self.budget, self.ratio, 1 << 20)
        try:
            build_policy(self.policy, budget, options)
        except BudgetTooSmall as exc:
            raise OptionRefusal(sized, exc) from None
        except ConfigError as exc:  # a missing budget, or the policy's own check of its options against the budget
            missing = budget is None and cls.needs_budget(options)
            raise OptionRefusal(sized if missing or not options else "policy_opts", exc) from None

    def _sized_by(self) -> str:
        """The field that sizes the policy: ``ratio`` when only a ratio is given, else ``budget``."""
        return "ratio" if self.ratio is not None and self.budget is None else "budget"

    def _check_prune(self) -> None:
        from sparseety.prune_schedule import PruneSchedule, parse_prune_schedule

        if isinstance(self.prune, str):  # its syntax, then its options; its layers are checked against the model
            with refused("prune"):
                parse_prune_schedule(self.prune)
            with refused("prune_opts"):
                parse_prune_schedule(self.prune, dict(self.prune_opts))
        elif self.prune is not None and not isinstance(self.prune, PruneSchedule):
            raise OptionError("prune", f"must be a schedule such as '8:0.3,16:0.5' or 'default', a PruneSchedule or "
                                       f"None, got {_shown(self.prune)}")
        elif self.prune_opts:
            raise OptionError("prune_opts", "need a pruning schedule given as text (prune)")

    def replace(self, **changes: Any) -> GenerationOptions:
        """A copy with ``changes`` (validated again); ``self`` when there are none."""
        return dataclasses.replace(self, **changes) if changes else self

    def policy_for(self, context_len: int) -> Policy:
        """The policy with its budget resolved on ``context_len`` tokens (what ``ratio`` removes from).

        ``dense`` with a budget or ratio is refused here, where the options build their own policy (the Python
        API, batch lines): dense keeps every token, and the run would report a budget it never applied. (The
        command line and the server build their policy themselves; the server's budget is also the default of
        requests that name another policy.)"""
        from sparseety.policies.registry import sized_policy

        sized = self._sized_by()
        if self.policy == "dense" and (self.budget is not None or self.ratio is not None):
            raise OptionError(sized, f"{_shown(getattr(self, sized))} is refused: policy 'dense' keeps every token, "
                                     "so it takes no budget or ratio")
        with refused(sized):  # a ratio that leaves fewer slots than the policy must hold
            return sized_policy(self.policy, self.budget, self.ratio, context_len, dict(self.policy_opts))

    def prune_schedule(self, num_layers: int = 30) -> PruneSchedule | None:
        """The pruning schedule (text, ``default`` included, resolved against ``num_layers``), or None."""
        if self.prune is None or not isinstance(self.prune, str):
            return self.prune
        from sparseety.prune_schedule import parse_prune_schedule

        with refused("prune"):  # ``default`` resolved against the model's depth
            return parse_prune_schedule(self.prune, dict(self.prune_opts), num_layers)


def default_of(field: str) -> Any:
    """The default of one :class:`GenerationOptions` field (what each door shows as its default)."""
    spec = GenerationOptions.__dataclass_fields__[field]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def options_from(options: GenerationOptions | None = None, **fields: Any) -> GenerationOptions:
    """``options`` (default: all defaults) with ``fields`` set; unknown field names are refused by name."""
    if options is not None and not isinstance(options, GenerationOptions):
        raise InputError(f"options must be a GenerationOptions or None, got {_shown(options)}")
    unknown = sorted(set(fields) - set(GenerationOptions.__dataclass_fields__))
    if unknown:
        raise InputError(f"unknown generation option(s) {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(GenerationOptions.__dataclass_fields__)}")
    return (options or GenerationOptions()).replace(**fields)


def _whole(value: Any, field: str) -> int:
    if not is_int(value):
        raise OptionError(field, f"must be a whole number, got {_shown(value)}")
    return value
