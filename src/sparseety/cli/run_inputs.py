"""The input and policy flags of ``sparseety run``, shared by ``compare`` and ``tune`` with the same validation.

Each ``*_OPT`` constant is a Typer option used as a parameter default in every command that takes the
flag, so the flags, their help and their defaults are defined once. :class:`RunInputs` gathers the
values and does the checks that need no model (before the model loads) and those that do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer

from sparseety.cli.output_opts import output_dir
from sparseety.errors import InputError
from sparseety.models.registry import DEFAULT_MODEL
from sparseety.options import DEFAULT_IMPORTANCE, GenerationOptions, ImportanceMode, OptionError, default_of
from sparseety.request_json import check_text_size

if TYPE_CHECKING:
    from sparseety.engine import EncodedInput
    from sparseety.policies import Policy
    from sparseety.prune_schedule import PruneSchedule

MODEL_OPT = typer.Option(DEFAULT_MODEL, "--model", help="Built-in name, local directory or Hugging Face id.")
PROMPT_OPT = typer.Option(None, "--prompt", help="Prompt text.")
PROMPT_FILE_OPT = typer.Option(None, "--prompt-file", help="Read the prompt from a file.")
CONTEXT_FILE_OPT = typer.Option(None, "--context-file", help="Long document, compressed by the policy.")
QUESTION_OPT = typer.Option(None, "--question", help="Question about --context-file, never compressed.")
CHAT_OPT = typer.Option(None, "--chat/--no-chat", help="Chat template (default: on for chat models).")
POLICY_OPT = typer.Option(default_of("policy"), "--policy", help="KV policy (see `sparseety policies list`).")
BUDGET_OPT = typer.Option(None, "--budget", help="Tokens kept per layer and KV head.")
RATIO_OPT = typer.Option(None, "--ratio", help="Fraction of the context removed (kvpress compression_ratio).")
POLICY_OPT_OPT = typer.Option([], "--policy-opt", help="Policy option key=value (repeatable).")
MAX_NEW_TOKENS_OPT = typer.Option(default_of("max_new_tokens"), "--max-new-tokens", help="Generation length limit.")
TIER_OPT = typer.Option(default_of("tier"), "--tier", help="0 nothing, 1 counts, 2 tokens and events, 3 per-step vectors.")
TOP_K_OPT = typer.Option(default_of("top_k"), "--top-k", help="Important tokens per layer.")
SPECULATIVE_OPT = typer.Option(None, "--speculative", help="Draft N tokens per step by prompt lookup.")
TRACE_DIR_OPT = typer.Option(Path("traces"), "--trace-dir", help="Where traces are written.", parser=output_dir,
                             metavar="DIR")
SEED_OPT = typer.Option(default_of("seed"), "--seed", help="Seed for seeded policies.")
JSON_OPT = typer.Option(False, "--json", help="Print exactly one JSON object.")
CONFIG_OPT = typer.Option(None, "--config", help="Run configuration YAML (see examples/run.yaml); flags override it.")
PRUNE_SCHEDULE_OPT = typer.Option(
    None, "--prune-schedule",
    help="Token pruning, layer:fraction pairs: 8:0.3,16:0.5 drops 0.3 of the prompt tokens after layer 8, "
         "then 0.5 of those left after layer 16; 'default' = 0.3 at a quarter of the depth, 0.5 at half.")
PRUNE_OPT_OPT = typer.Option([], "--prune-opt", help="Pruning option key=value: keep_recent, sinks, window.")
LAYERS_OPT = typer.Option(default_of("layers"), "--layers", help="Layers recording important tokens: all, auto or a list such as 0,15,29.")
ATTENTION_TOPK_OPT = typer.Option(
    None, "--attention-topk", help="While decoding, attend only to the k highest-scoring held slots (any policy).")
THREADS_OPT = typer.Option(None, "--threads", help="Torch threads running the model (default: cores - 1, at least 1).")
MIN_SCORE_OPT = typer.Option(default_of("min_score"), "--min-score", help="Drop important tokens scoring below this share of the top one.")
IMPORTANCE_OPT = typer.Option(
    DEFAULT_IMPORTANCE, "--importance", help="Important-token score: attention (α), value (α·‖v‖, attention sinks left out), "
    "output (α·‖W_O v‖, sinks left out) or learned (learned per-head weights, see --importance-weights). "
    f"Default {DEFAULT_IMPORTANCE}: see the README's faithfulness table.")
IMPORTANCE_WEIGHTS_OPT = typer.Option(
    None, "--importance-weights", help="With --importance learned: head weights from `sparseety learn-importance` "
    "(default: the weights shipped for the model).")


def read_text(path: Path, what: str) -> str:
    """Read a UTF-8 text file named by a flag, with a clear error."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {what} {path}: {exc}") from None


@dataclass
class RunInputs:
    """The values of the shared flags.

    ``check()`` validates everything that needs no model; ``encode()`` and ``policy_for()`` finish
    the job once the tokenizer is loaded.
    """

    prompt: str | None = None
    prompt_file: Path | None = None
    context_file: Path | None = None
    question: str | None = None
    chat: bool | None = None
    policy: str = default_of("policy")
    budget: int | None = None
    ratio: float | None = None
    policy_opt: list[str] = field(default_factory=list)
    tier: int = default_of("tier")
    top_k: int = default_of("top_k")
    prune_schedule: str | None = None
    prune_opt: list[str] = field(default_factory=list)
    layers: str = default_of("layers")
    attention_topk: int | None = None
    min_score: float = default_of("min_score")
    importance: str = DEFAULT_IMPORTANCE
    importance_weights: Path | None = None  #: ``--importance-weights`` (``learned``)
    max_new_tokens: int = default_of("max_new_tokens")
    seed: int = default_of("seed")
    speculative: int | None = None
    options: dict[str, Any] = field(default_factory=dict, init=False)  #: ``--policy-opt`` parsed

    def check(self, *, need_source: bool = True) -> None:
        """Validate sources and every generation option (:meth:`generation_options`) before the model loads."""
        from sparseety.policies import parse_policy_opts

        sources = sum(x is not None for x in (self.prompt, self.prompt_file, self.context_file))
        if need_source and sources != 1:
            raise InputError("give exactly one of --prompt, --prompt-file or --context-file")
        if (self.context_file is None) != (self.question is None):
            raise InputError("--context-file and --question go together")
        self.options = parse_policy_opts(self.policy_opt)
        self._check_sparsity_extras()
        self.generation_options()

    def generation_options(self, **changes: Any) -> GenerationOptions:
        """The flags as :class:`~sparseety.options.GenerationOptions` (with ``changes``); a refused value is an
        error naming its flag."""
        from sparseety.policies import parse_policy_opts
        from sparseety.prune_schedule import parse_prune_opts

        try:
            return GenerationOptions(
                policy=self.policy, budget=self.budget, ratio=self.ratio, policy_opts=parse_policy_opts(self.policy_opt),
                max_new_tokens=self.max_new_tokens, tier=self.tier, top_k=self.top_k, min_score=self.min_score,
                layers=self.layers, importance=cast(ImportanceMode, self.importance),  # checked on construction
                importance_weights=self.importance_weights, speculative=self.speculative,
                attention_topk=self.attention_topk, prune=self.prune_schedule, prune_opts=parse_prune_opts(self.prune_opt),
                seed=self.seed,
            ).replace(**changes)
        except OptionError as exc:
            raise exc.flag_error() from None

    def read_sources(self) -> tuple[str | None, str | None]:
        """``(prompt text, context text)``: exactly one is set."""
        text = self.prompt
        if self.prompt_file is not None:
            text = read_text(self.prompt_file, "--prompt-file")
        context = read_text(self.context_file, "--context-file") if self.context_file is not None else None
        return text, context

    def encode(self, tokenizer: Any, sources: tuple[str | None, str | None] | None = None,
               max_positions: int | None = None) -> EncodedInput:
        """Token ids of the prompt, or of the context plus question (long-document protocol); text that
        cannot fit in ``max_positions`` tokens is refused by its size in bytes, before tokenizing."""
        from sparseety.engine import encode_document, encode_prompt

        text, context = sources if sources is not None else self.read_sources()
        what = "--context-file plus --question" if context is not None else \
            "--prompt-file" if self.prompt_file is not None else "--prompt"
        check_text_size(sum(len(part.encode()) for part in (text, context, self.question) if part), what,
                        max_positions)
        if context is not None:
            return encode_document(tokenizer, context, self.question or "", self.chat)
        return encode_prompt(tokenizer, text or "", self.chat)

    def policy_for(self, encoded: EncodedInput, name: str | None = None, budget: int | None = None,
                   ratio: float | None = None) -> Policy:
        """The policy (``--policy`` unless ``name`` is given) with its budget resolved on ``encoded``."""
        from sparseety.policies import sized_policy

        if budget is None and ratio is None:
            budget, ratio = self.budget, self.ratio
        return sized_policy(name or self.policy, budget, ratio, encoded.compress_len or encoded.input_len, self.options)

    def _check_sparsity_extras(self) -> None:
        """The checks with command-line wording that come before :meth:`generation_options` (which checks the
        values themselves): flags that need another, layer syntax, a damaged ``--importance-weights`` file."""
        from sparseety.engine.layers import parse_layers
        from sparseety.extract.head_weights import read_head_weights

        if self.prune_opt and self.prune_schedule is None:
            raise InputError("--prune-opt needs --prune-schedule")
        parse_layers(self.layers)
        if self.importance_weights is not None:
            if self.importance != "learned":
                raise InputError(f"--importance-weights needs --importance learned (got --importance {self.importance})")
            read_head_weights(self.importance_weights)  # a damaged file is refused before the model loads

    def prune_for(self, num_layers: int = 30) -> PruneSchedule | None:
        """The pruning schedule (``default`` resolved against ``num_layers``), or None."""
        from sparseety.prune_schedule import parse_prune_opts, parse_prune_schedule

        if self.prune_schedule is None:
            return None
        return parse_prune_schedule(self.prune_schedule, parse_prune_opts(self.prune_opt), num_layers)
