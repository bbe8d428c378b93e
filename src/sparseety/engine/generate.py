"""``SparseEngine``: greedy generation through the hook point, with a policy, a ``SparseCache`` and probes.

The engine wraps one model: it switches that model (and only it) to the registered attention
function and registers, once per model, hooks that forward to the :class:`RunContext` active on the
calling thread (or, in a packed forward, to each sequence's own context); each request gets a fresh
context, so concurrent runs on one model stay apart. ``generate`` is plain
``model.generate(do_sample=False)`` for one sequence (so with the ``dense`` policy the tokens are
exactly those of plain generation); ``generate_batch`` and :class:`BatchEngine` run many sequences
as one continuous batch. Everything SparSEEty adds happens beside the computation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from sparseety.engine.attention import ATTENTION_NAME, attach_hidden_hooks
from sparseety.engine.batch import BatchEngine, _eos_ids, generate_batch
from sparseety.engine.cache import SparseCache
from sparseety.engine.checks import check_request, check_speculative, check_topk
from sparseety.engine.context import RunContext, activate, active_context
from sparseety.extract.head_weights import HeadWeights, resolve_head_weights
from sparseety.extract.scoring import check_mode, output_grams
from sparseety.engine.inputs import EncodedInput, encode_prompt
from sparseety.engine.layers import parse_layers
from sparseety.engine.packed import SplitProbes, active_packed, isolated
from sparseety.engine.probe import ModuleProbes, attach_probe_hooks
from sparseety.engine.prune import PruneRun, install_layer_hooks
from sparseety.engine.reconstruct import run_reconstruction
from sparseety.engine.result import RunResult
from sparseety.engine.result_build import build_result
from sparseety.engine.scheduler import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK
from sparseety.engine.settings import RunSettings
from sparseety.engine.window import layer_windows
from sparseety.errors import InputError, shown
from sparseety.fingerprint import model_fingerprint
from sparseety.options import GenerationOptions, is_int, options_from, refused
from sparseety.policies.base import ModelInfo, Policy


class SparseEngine:
    """Runs traced sparse generation on one model.

    Parameters
    ----------
    model : a causal LM from transformers (decoder with ``AttentionInterface`` support).
    tokenizer : its tokenizer.
    model_name : name recorded in traces.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, model_name: str | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name or getattr(model.config, "_name_or_path", "model")
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.kv_heads: int = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.windows: tuple[int | None, ...] = layer_windows(config)  #: per layer: sliding window, None if global
        self._grams: list[torch.Tensor] | None = None
        self._shipped_weights: HeadWeights | None = None
        model.set_attn_implementation(ATTENTION_NAME)
        _install_hooks(model)

    @functools.cached_property
    def model_info(self) -> ModelInfo:
        """The model a policy is bound to (:meth:`Policy.bind`); the weights are hashed only when asked."""
        config = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        return ModelInfo(name=self.model_name, num_layers=self.num_layers, kv_heads=self.kv_heads,
                         head_dim=self.head_dim, vocab_size=getattr(config, "vocab_size", None),
                         fingerprint=functools.partial(model_fingerprint, self.model))

    def decode(self, token_id: int) -> str:
        """Text of one token id."""
        return self.tokenizer.decode([token_id])

    def generate(
        self,
        encoded: EncodedInput | str | Sequence[int] | torch.Tensor,
        policy: Policy | str | None = None,
        options: GenerationOptions | None = None,
        *,
        request_id: str | None = None,
        on_prefill_layer: Callable[[int, int], None] | None = None,
        streamer: Any = None,
        **fields: Any,
    ) -> RunResult:
        """Generate greedily and record the token lifecycle.

        Parameters
        ----------
        encoded : token ids (a list of ints, a ``[n]`` or ``[1, n]`` integer tensor, or an :class:`EncodedInput`,
            whose ``compress_len`` selects the long-document protocol), or prompt text (encoded with the chat
            template on chat models); see :meth:`encoded`.
        policy : KV policy with its budget resolved, or a policy name; None builds the options' policy on this input.
        options : a :class:`~sparseety.options.GenerationOptions` (None: every default).
        request_id : the run's id (None: a random one).
        on_prefill_layer : called with ``(layer, num_layers)`` as prefill passes each layer.
        streamer : a transformers streamer (``put``/``end``) handed to ``model.generate``; it receives
            the prompt ids first, then each step's new token ids.
        **fields : :class:`~sparseety.options.GenerationOptions` fields set over ``options``
            (``max_new_tokens=8, importance="attention"``; ``policy`` and ``budget`` build the policy only when
            none is given).
        """
        encoded = self.encoded(encoded)
        if isinstance(policy, str):  # generate(prompt, "snapkv", budget=64)
            fields["policy"], policy = policy, None
        elif policy is not None and not isinstance(policy, Policy):
            raise InputError(f"policy must be a policy name (sparseety policies list), a Policy or None, got "
                             f"{shown(policy)}")
        options = options_from(options, **fields)
        if policy is None:
            policy = options.policy_for(encoded.compress_len or encoded.input_len)
        speculative, max_new_tokens = options.speculative, options.max_new_tokens
        if speculative is not None:
            with refused("speculative"):
                check_speculative(speculative, encoded, policy, self.num_layers)
        self.check_request(encoded, policy, options)
        input_ids = encoded.input_ids
        with self.open_run(encoded, policy, options, on_prefill_layer=on_prefill_layer) as ctx:
            if encoded.compress_len is not None:  # the context is prefilled (and compressed) on its own
                self.model(input_ids=input_ids[:, : encoded.compress_len], past_key_values=ctx.cache, use_cache=True)
                self.reconstruct(ctx, encoded)
            elif policy.reconstructs:  # the prompt is prefilled here so that kvzip's pass runs before the first decode step
                sequences = self._reconstructing_generate(ctx, encoded, max_new_tokens, streamer)
                return self.build_result(ctx, encoded, sequences, policy, options.tier, options.top_k, request_id,
                                         options.min_score)
            kwargs: dict[str, Any] = {}
            if speculative:
                kwargs["prompt_lookup_num_tokens"] = speculative
            sequences = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                past_key_values=ctx.cache,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=_pad_id(self.tokenizer),
                streamer=streamer,
                **kwargs,
            )
        return self.build_result(ctx, encoded, sequences, policy, options.tier, options.top_k, request_id,
                                 options.min_score)

    def reconstruct(self, ctx: RunContext, encoded: EncodedInput) -> None:
        """Run a reconstructing policy's pending pass over the region just prefilled (see :mod:`.reconstruct`)."""
        if ctx.reconstruction.pending:
            ids = encoded.input_ids[0, : ctx.reconstruction.region].tolist()
            run_reconstruction(self.model, ctx, ids, self.tokenizer)

    def _reconstructing_generate(self, ctx: RunContext, encoded: EncodedInput, max_new_tokens: int,
                                 streamer: Any) -> torch.Tensor:
        """A plain prompt under a reconstructing policy: prefill, pick the first token, reconstruct and evict, then
        let ``model.generate`` continue from the prompt plus that token (greedy, so the tokens are those one call makes)."""
        input_ids = encoded.input_ids
        logits = self.model(input_ids=input_ids, past_key_values=ctx.cache, use_cache=True, logits_to_keep=1).logits
        first = logits[:, -1].float().argmax(dim=-1, keepdim=True).to(input_ids.dtype)
        self.reconstruct(ctx, encoded)
        sequences = torch.cat([input_ids, first.to(input_ids.device)], dim=1)
        if streamer is not None:
            streamer.put(input_ids.cpu())
            streamer.put(first[0].cpu())
        if max_new_tokens == 1 or int(first) in _eos_ids(self.model):
            if streamer is not None:
                streamer.end()
            return sequences
        return self.model.generate(sequences, attention_mask=torch.ones_like(sequences), past_key_values=ctx.cache,
                                   max_new_tokens=max_new_tokens - 1, do_sample=False, pad_token_id=_pad_id(self.tokenizer),
                                   streamer=None if streamer is None else _AfterPrompt(streamer))

    def encoded(self, given: EncodedInput | str | Sequence[int] | torch.Tensor) -> EncodedInput:
        """``given`` as the engine's input: text (encoded with the chat template on chat models), token ids (a list
        of ints, or a ``[n]`` / ``[1, n]`` integer tensor) or an :class:`EncodedInput`; else :class:`InputError`."""
        if isinstance(given, EncodedInput):
            return given
        if isinstance(given, str):
            return encode_prompt(self.tokenizer, given, None)
        one_row = isinstance(given, torch.Tensor) and (given.dim() == 1 or given.dim() == 2 and given.shape[0] == 1)
        if one_row and not (given.is_floating_point() or given.is_complex() or given.dtype == torch.bool):
            ids = given.reshape(1, -1).to(torch.long)
        elif isinstance(given, (list, tuple)) and all(is_int(t) for t in given):
            ids = torch.tensor([list(given)], dtype=torch.long)
        else:
            raise InputError(f"encoded must be text, token ids (a list of ints) or an EncodedInput, got "
                             f"{shown(given)}")
        vocab = self.model.get_input_embeddings().num_embeddings
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InputError(f"token ids must be a non-empty list of ids in [0, {vocab}), got {shown(given)}")
        return EncodedInput(ids)

    def generate_batch(
        self,
        inputs: Sequence[EncodedInput],
        policies: Policy | Sequence[Policy],
        options: GenerationOptions | Sequence[GenerationOptions] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        kv_memory_limit: int | None = None,
    ) -> list[RunResult]:
        """Generate greedily for many inputs as one continuous batch (see :class:`BatchEngine`).

        Parameters
        ----------
        inputs : token ids per request.
        policies : one policy for all, or one per input (a batch may mix policies and budgets).
        options : one :class:`GenerationOptions` for all, or one per input.
        max_batch : sequences decoded together; prefill_chunk : prompt tokens prefilled per step.
        kv_memory_limit : bytes of KV the running requests may reserve (worst case per request).

        Returns
        -------
        One :class:`RunResult` per input, in order; each equals what that input gives alone.
        """
        return generate_batch(self, inputs, policies, options, request_ids=request_ids, max_batch=max_batch,
                              prefill_chunk=prefill_chunk, kv_memory_limit=kv_memory_limit)

    def batch(self, **kwargs: Any) -> BatchEngine:
        """A step-level :class:`BatchEngine` over this model (what the server drives)."""
        return BatchEngine(self, **kwargs)

    # -- pieces shared by generate and the batched engine ------------------------------------------
    def check_request(self, encoded: EncodedInput, policy: Policy, options: GenerationOptions) -> None:
        """Raise :class:`InputError` (or :class:`ConfigError`) for a request this model cannot run
        (see :func:`~sparseety.engine.checks.check_request`)."""
        check_request(self.model_info, self.max_positions, encoded, policy, options)

    def reserved_kv_bytes(self, encoded: EncodedInput, policy: Policy, max_new_tokens: int) -> int:
        """Worst-case KV bytes of one request: per layer, the slots it may hold once the prompt is in.

        Dense (and non-evicting) policies hold every token the cache sees (prompt + ``max_new_tokens``
        - 1); an evicting policy holds at most its layer budget plus the one token a decode step
        appends before it evicts (never more than the tokens seen); a sliding layer at most its window.
        """
        seen = encoded.input_len + max_new_tokens - 1
        slots = 0
        for layer, window in enumerate(self.windows):
            budget = policy.layer_budget(layer, self.num_layers, seen) if policy.evicts else None
            held = seen if budget is None else min(seen, budget + 1)
            slots += held if window is None else min(held, window)  # a sliding layer never holds more than its window
        element = next(self.model.parameters()).element_size()
        return 2 * slots * self.kv_heads * self.head_dim * element

    def new_context(self, encoded: EncodedInput, policy: Policy, options: GenerationOptions,
                    on_prefill_layer: Callable[[int, int], None] | None = None) -> RunContext:
        """A fresh :class:`RunContext` (with an empty ``SparseCache``) for one request."""
        policy.bind(self.model_info)
        head = self.head_weights(options.importance_weights) if options.importance == "learned" else None
        feature = options.importance if head is None else check_mode(head.feature, "importance weights feature")
        prune = options.prune_schedule(self.num_layers)
        settings = RunSettings(
            options=options, policy=policy, num_layers=self.num_layers, kv_heads=self.kv_heads,
            input_len=encoded.input_len, compress_len=encoded.compress_len,
            layers=parse_layers(options.layers, self.num_layers), importance_mode=feature,
            out_grams=self.output_grams() if feature == "output" and options.tier >= 2 else None,
            head_weights=None if head is None else head.weights, on_prefill_layer=on_prefill_layer,
        )
        return RunContext(settings, SparseCache(self.num_layers, self.windows),
                          probes=ModuleProbes() if options.tier >= 2 else None,
                          prune=PruneRun(prune, self.num_layers) if prune is not None else None)

    def head_weights(self, weights: Any = None) -> HeadWeights:
        """``--importance learned``'s weights (a file or :class:`HeadWeights`; None: the shipped ones),
        checked against this model's fingerprint and shape."""
        if weights is None:
            if self._shipped_weights is None:
                self._shipped_weights = resolve_head_weights(None, self.model_name, self.model_info.fingerprint(),
                                                             self.num_layers, self.num_heads)
            return self._shipped_weights
        return resolve_head_weights(weights, self.model_name, self.model_info.fingerprint(), self.num_layers,
                                    self.num_heads)

    def output_grams(self) -> list[torch.Tensor]:
        """Per layer, ``[kv_heads, g, d, d]`` Gram matrices of its attention output projection (``output`` importance)."""
        if self._grams is None:
            modules = sorted((m for m in self.model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")),
                             key=lambda m: m.layer_idx)
            if len(modules) != self.num_layers:
                raise InputError(f"importance 'output' needs an o_proj in each of the {self.num_layers} attention "
                                 f"layers; found {len(modules)}")
            self._grams = [output_grams(m.o_proj.weight, self.num_heads, self.kv_heads) for m in modules]
        return self._grams

    @contextlib.contextmanager
    def open_run(
        self,
        encoded: EncodedInput,
        policy: Policy,
        options: GenerationOptions | None = None,
        *,
        on_prefill_layer: Callable[[int, int], None] | None = None,
        **fields: Any,
    ) -> Iterator[RunContext]:
        """A fresh :class:`RunContext` (with an empty ``SparseCache``), active inside the block.

        Every forward of ``self.model`` on this thread inside the block runs through the context's
        policy and probes; pass ``past_key_values=ctx.cache``. Gradients are off. ``options`` (or its
        ``fields``, as in :meth:`generate`) set the tier, the seed, the pruning of the block's first
        forward, the layers recording importance and the importance mode.
        """
        options = options_from(options, **fields)
        prune = options.prune_schedule(self.num_layers)
        if prune is not None:
            prune.check_layers(self.num_layers)
        check_topk(policy, options.attention_topk)
        torch.manual_seed(options.seed)
        ctx = self.new_context(encoded, policy, options, on_prefill_layer)
        with activate(ctx), torch.inference_mode():
            yield ctx

    def build_result(self, ctx: RunContext, encoded: EncodedInput, sequences: torch.Tensor, policy: Policy,
                     tier: int, top_k: int, request_id: str | None, min_score: float = 0.0) -> RunResult:
        """The run's :class:`RunResult` (see :func:`~sparseety.engine.result_build.build_result`)."""
        return build_result(self, ctx, encoded, sequences, policy, tier, top_k, request_id, min_score)


class _AfterPrompt:
    """A streamer proxy for a ``model.generate`` that continues a started answer: drops its first ``put``
    (the prompt plus the tokens already streamed), forwards the rest."""

    def __init__(self, streamer: Any) -> None:
        self.streamer, self.started = streamer, False

    def put(self, value: Any) -> None:
        if self.started:
            self.streamer.put(value)
        self.started = True

    def end(self) -> None:
        self.streamer.end()


_HOOKED = "_sparseety_hooks"


def _install_hooks(model: torch.nn.Module) -> None:
    """Register, once per model, forward hooks that reach the run active on the calling thread."""
    if getattr(model, _HOOKED, False):
        return

    def begin(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        packed = active_packed()
        if packed is not None:
            for segment in packed.segments:
                isolated(segment.ctx, segment.ctx.begin_forward, segment.length,
                         ids[:, segment.start : segment.start + segment.length])
            return
        ctx = active_context()
        if ctx is None:
            return
        if ids is None:
            ctx.begin_forward(int(kwargs["inputs_embeds"].shape[1]))
        else:
            ctx.begin_forward(int(ids.shape[1]), ids)

    def end(*_: Any) -> None:
        packed = active_packed()
        if packed is not None:
            for segment in packed.segments:
                isolated(segment.ctx, segment.ctx.end_forward)
            return
        ctx = active_context()
        if ctx is not None:
            ctx.end_forward()

    def active_probes() -> ModuleProbes | SplitProbes | None:
        packed = active_packed()
        if packed is not None:
            return SplitProbes(packed)
        return getattr(active_context(), "probes", None)

    def active_prune() -> tuple[PruneRun, SparseCache] | None:
        ctx = active_context()
        return None if ctx is None or ctx.prune is None else (ctx.prune, ctx.cache)

    model.register_forward_pre_hook(begin, with_kwargs=True)
    model.register_forward_hook(end)
    attach_probe_hooks(model, active_probes)
    attach_hidden_hooks(model)
    install_layer_hooks(model, active_prune)
    setattr(model, _HOOKED, True)


def _pad_id(tokenizer: Any) -> int | None:
    """The tokenizer's pad id, falling back to its eos id (generation here is batch 1; nothing is padded)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
