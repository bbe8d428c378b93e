"""The Python API for notebooks: load a model once, generate with a KV policy, look at what happened.

Example::

    import sparseety

    model = sparseety.load("smollm2-135m")  # a built-in name, a local directory or a Hugging Face id
    result = model.generate("The capital of France is", policy="snapkv", budget=64, max_new_tokens=8)
    result.text, result.important_tokens, result.events()
    result.events_df()          # pandas (pip install 'sparseety[notebook]')
    result.compare_dense()      # token diff, teacher-forced fidelity and quality against dense
    result                      # as a notebook cell's last line: the report, inline

Every keyword of :meth:`Model.generate` is a :class:`~sparseety.options.GenerationOptions` field, with the
same defaults as ``sparseety run`` and ``sparseety serve``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from sparseety.engine import EncodedInput, RunResult, SparseEngine, encode_prompt
from sparseety.errors import InputError, shown
from sparseety.models.registry import DEFAULT_MODEL, load_model
from sparseety.options import GenerationOptions, options_from
from sparseety.schema import TokenRecord
from sparseety.store.rows import StoreOptions, request_rows

if TYPE_CHECKING:
    import pandas

    from sparseety.analysis.compare import Comparison

PANDAS_MISSING = ("the DataFrame views need pandas, which sparseety does not install by default: "
                  "pip install 'sparseety[notebook]' (or pip install pandas); events() and "
                  "important_token_rows() give the same rows as dicts")


def load(model: str = DEFAULT_MODEL, *, dtype: str = "float32", device: str = "cpu") -> Model:
    """Load ``model`` (a built-in name such as ``smollm2-135m``, a local directory or a Hugging Face id).

    Parameters
    ----------
    model : what ``sparseety run --model`` takes.
    dtype, device : torch dtype name (``float32``, ``float16``, ``bfloat16``, ``float64``) and device of the weights
        (``cpu``, ``cuda``, ``cuda:1``, ...: one this machine has).

    Raises
    ------
    InputError : naming the argument, before any weight is read.
    """
    _check_load(model, dtype, device)
    lm, tokenizer = load_model(model, dtype=dtype, device=device)
    return Model(SparseEngine(lm, tokenizer, model))


DTYPES = ("float32", "float16", "bfloat16", "float64")


def _check_load(model: Any, dtype: Any, device: Any) -> None:
    import os

    import torch

    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise InputError(f"model must be a built-in name, a local directory or a Hugging Face id, got {shown(model)}")
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {shown(dtype)}")
    if not isinstance(device, str):
        raise InputError(f"device must be a device name such as 'cpu' or 'cuda:0', got {shown(device)}")
    try:
        kind = torch.device(device)
    except (RuntimeError, ValueError):
        raise InputError(f"device must be a device name such as 'cpu' or 'cuda:0', got {shown(device)}") from None
    if kind.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {shown(device)}: this machine has no CUDA device")
    if kind.type == "cuda" and (kind.index or 0) >= torch.cuda.device_count():
        raise InputError(f"device {shown(device)}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if kind.type not in ("cpu", "cuda"):
        raise InputError(f"device {shown(device)}: SparSEEty runs on cpu or cuda")


def _check_chat(chat: Any) -> None:
    if chat is not None and not isinstance(chat, bool):
        raise InputError(f"chat must be True, False or None (on for chat models), got {shown(chat)}")


class Model:
    """A loaded model that generates with a KV policy and traces it (wraps a :class:`SparseEngine`)."""

    def __init__(self, engine: SparseEngine) -> None:
        self.engine = engine

    @property
    def name(self) -> str:
        return self.engine.model_name

    def __repr__(self) -> str:
        return f"sparseety.Model({self.name!r}, layers={self.engine.num_layers}, kv_heads={self.engine.kv_heads})"

    @overload
    def generate(self, prompt: str, options: GenerationOptions | None = None, *, chat: bool | None = None,
                 **fields: Any) -> Generation: ...

    @overload
    def generate(self, prompt: Sequence[str], options: GenerationOptions | None = None, *,
                 chat: bool | None = None, **fields: Any) -> list[Generation]: ...

    def generate(self, prompt: str | Sequence[str], options: GenerationOptions | None = None, *,
                 chat: bool | None = None, **fields: Any) -> Generation | list[Generation]:
        """Generate greedily for one prompt, or for a list of prompts as one continuous batch.

        Parameters
        ----------
        prompt : the text, or a list of texts (each answered as if alone).
        options : a :class:`~sparseety.options.GenerationOptions` (None: every default).
        chat : the chat template (None: on for chat models).
        **fields : options fields set over ``options``: ``policy="snapkv", budget=64, max_new_tokens=16,
            importance="value", tier=2, ...``.

        Returns
        -------
        A :class:`Generation`, or one per prompt, in order.
        """
        _check_chat(chat)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if isinstance(prompt, (list, tuple)) else []
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise InputError(f"prompt must be a text or a non-empty list of texts, got {shown(prompt)}")
        options = options_from(options, **fields)
        if isinstance(prompt, str):
            encoded = self._encode(prompt, chat)
            policy = options.policy_for(encoded.compress_len or encoded.input_len)
            return Generation(self.engine.generate(encoded, policy, options), options, prompt, chat, self)
        if options.speculative is not None:
            raise InputError("speculative decoding runs one sequence at a time: generate each prompt on its own")
        encoded = [self._encode(p, chat) for p in prompts]
        policies = [options.policy_for(e.compress_len or e.input_len) for e in encoded]
        results = self.engine.generate_batch(encoded, policies, options)
        return [Generation(r, options, p, chat, self) for r, p in zip(results, prompts)]

    def compare(self, prompt: str, options: GenerationOptions | None = None, *, chat: bool | None = None,
                embeddings: bool = True, **fields: Any) -> Comparison:
        """The options' policy against dense on ``prompt``: token diff, teacher-forced fidelity, quality
        (:func:`sparseety.analysis.compare`, what ``sparseety compare`` prints)."""
        from sparseety.analysis.compare import compare

        _check_chat(chat)
        if not isinstance(prompt, str):
            raise InputError(f"prompt must be a text, got {shown(prompt)}")
        options = options_from(options, **fields)
        return compare(self.engine, self._encode(prompt, chat), None, options, embeddings=embeddings)

    def _encode(self, prompt: str, chat: bool | None) -> EncodedInput:
        return encode_prompt(self.engine.tokenizer, prompt, chat)


@dataclass(frozen=True)
class Generation:
    """One prompt's traced generation: its text, tokens, events and important tokens.

    ``events()`` and ``important_token_rows()`` have the columns of the trace store's ``token_events``
    and ``important_tokens`` tables (``docs/trace-format.md``), so what you write on them carries over to
    ``sparseety query``.
    """

    run: RunResult  #: everything the engine recorded (what ``sparseety run --json`` prints)
    options: GenerationOptions
    prompt: str
    chat: bool | None = None
    model: Model | None = field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str:
        """The generated text."""
        return self.run.text

    @property
    def output_ids(self) -> list[int]:
        """Generated token ids."""
        return self.run.output_ids

    @property
    def tokens(self) -> list[str]:
        """The text of each generated token."""
        if self.run.token_texts:
            return self.run.token_texts[len(self.run.prompt_ids):]
        if self.model is None:
            raise InputError("token texts need the model's tokenizer (run at tier 2 or generate through a Model)")
        return [self.model.engine.decode(i) for i in self.run.output_ids]

    @property
    def important_tokens(self) -> list[TokenRecord]:
        """The important tokens (tier >= 2): per layer and overall, ranked by the options' importance."""
        return self.run.important_tokens

    def events(self) -> list[dict[str, Any]]:
        """Token events (tier >= 1: evictions, attention skips, window edges, drafts, pruning), one dict each."""
        table = self._rows().get("token_events")
        return [] if table is None else table.to_pylist()

    def important_token_rows(self) -> list[dict[str, Any]]:
        """The important tokens as rows of the store's ``important_tokens`` table."""
        return list(self._rows().get("important_tokens", []))

    def events_df(self) -> pandas.DataFrame:
        """:meth:`events` as a pandas DataFrame (needs pandas)."""
        return _frame(self.events(), "token_events")

    def important_tokens_df(self) -> pandas.DataFrame:
        """:meth:`important_token_rows` as a pandas DataFrame (needs pandas)."""
        return _frame(self.important_token_rows(), "important_tokens")

    def compare_dense(self, *, embeddings: bool = True) -> Comparison:
        """This prompt and options against dense (:meth:`Model.compare`; both are run again)."""
        if self.model is None:
            raise InputError("compare_dense needs the model: generate through sparseety.load(...).generate")
        return self.model.compare(self.prompt, self.options, chat=self.chat, embeddings=embeddings)

    def to_json(self) -> dict[str, Any]:
        """The ``sparseety run --json`` object."""
        return self.run.to_json()

    def report_html(self, *, layer: int | None = None) -> str:
        """The HTML report of this run (what ``sparseety run`` writes beside the trace)."""
        if self.run.tier < 1:
            return f"<p>{self.run.policy}: tier 0 records nothing to report; generate with tier=1 or more.</p>"
        from sparseety.report import render_html
        from sparseety.store import load_trace, write_trace

        with tempfile.TemporaryDirectory(prefix="sparseety-") as where:
            write_trace(self.run, where)
            return render_html(load_trace(where, self.run.request_id), layer=layer)

    def _repr_html_(self) -> str:
        return self.report_html()

    def _rows(self) -> dict[str, Any]:
        return request_rows(self.run, StoreOptions()).tables


def _frame(rows: list[dict[str, Any]], table: str) -> pandas.DataFrame:
    try:
        import pandas
    except ImportError:
        raise ImportError(PANDAS_MISSING) from None
    if rows:
        return pandas.DataFrame(rows)
    from sparseety.store.tables import TABLES

    return pandas.DataFrame(columns=TABLES[table].names)
