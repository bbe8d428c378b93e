"""The checks of a run's inputs against the model and the policy, made before a request runs or joins a batch.

Everything here raises :class:`~sparseety.errors.InputError` (the request asks for something this
model or policy cannot do) naming the option; a refusal of two settings that cannot be combined, or of a
layer list or schedule this model does not have, is an :class:`~sparseety.options.OptionRefusal`: an
``InputError`` that stays the :class:`~sparseety.errors.ConfigError` it was. Nothing touches the model's
weights or the cache.
"""

from __future__ import annotations

from sparseety.engine.inputs import EncodedInput
from sparseety.engine.layers import parse_layers
from sparseety.errors import ConfigError, InputError
from sparseety.options import GenerationOptions, refused
from sparseety.policies.base import ModelInfo, Policy


def check_request(model: ModelInfo, max_positions: int | None, encoded: EncodedInput, policy: Policy,
                  options: GenerationOptions) -> None:
    """Raise for a request ``model`` (context of ``max_positions`` tokens, None: unbounded) cannot run.

    Everything that can be checked before a request joins a batch is checked here, the policy's
    binding to this model included (a ``learned`` policy without its predictor file, or with one
    trained for another model), so a request that cannot run is refused alone, at once.
    """
    num_layers = model.num_layers
    with refused("policy_opts"):  # a learned policy without its predictor file, or one trained for another model
        policy.bind(model)
    with refused("layers"):
        parse_layers(options.layers, num_layers)
    prune = options.prune_schedule(num_layers)
    with refused("prune"):
        if prune is not None:
            prune.check_layers(num_layers)
            prune.check_prompt(encoded.compress_len or encoded.input_len)
        if policy.reconstructs and prune is not None:
            raise ConfigError(f"policy {policy.name!r} cannot be combined with token pruning: its reconstruction pass "
                              "scores every slot of the region it compresses")
    check_topk(policy, options.attention_topk)
    if max_positions and encoded.input_len + options.max_new_tokens > max_positions:
        raise InputError(
            f"the prompt ({encoded.input_len} tokens) plus max_new_tokens ({options.max_new_tokens}) exceeds "
            f"the model's context of {max_positions} tokens"
        )


def check_topk(policy: Policy, attention_topk: int | None) -> None:
    """``attention_topk`` composes with every policy that neither attends to its own top-k nor splits heads."""
    if attention_topk is None:  # a positive number: GenerationOptions checked it
        return
    if policy.attends_topk:
        raise InputError(f"policy {policy.name!r} already attends to its top {policy.budget} slots; "
                         "attention_topk composes with the other policies")
    if policy.splits_heads:
        raise InputError(f"policy {policy.name!r} keeps a different number of slots in each KV head, which "
                         "attention_topk cannot rank; set its option per_head=false to combine them")


def check_speculative(speculative: int, encoded: EncodedInput, policy: Policy, num_layers: int) -> None:
    """Prompt lookup needs room for its drafts and an empty cache at its first step (``speculative`` is
    positive: GenerationOptions checked it)."""
    if policy.reconstructs:
        raise ConfigError(f"policy {policy.name!r} cannot be combined with speculative decoding in generate: "
                          "its reconstruction pass runs between the prefill and the first decode step, and "
                          "transformers' prompt lookup needs an empty cache")
    if policy.splits_heads:
        raise ConfigError(f"policy {policy.name!r} keeps a different number of slots in each KV head, and such a "
                          "layer cannot take rejected drafts back; set its option per_head=false to draft")
    if encoded.compress_len is not None:
        raise InputError("speculative decoding cannot be combined with the long-document protocol: "
                         "transformers' prompt lookup re-feeds a pre-filled cache")
    budgets = [policy.layer_budget(layer, num_layers) for layer in range(num_layers)]
    smallest = min((b for b in budgets if b is not None), default=None)
    if policy.evicts and smallest is not None and speculative >= smallest:
        raise InputError(f"speculative ({speculative}) must be smaller than the smallest layer budget ({smallest})")
