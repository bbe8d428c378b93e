"""``value_aware`` (VATP) for ``h2o``, ``tova`` and ``snapkv``: exact kept sets on a tiny model against an
independent computation from a never-wrapped eager twin, refusals, and the same sets alone and in a batch.

Prefill is dense in every layer (a layer evicts only after its own attention), so the twin's prefill
attention and cached values are what the wrapped model's policy sees.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kv_policy_checks import engine
from tiny_models import KV_HEADS, build_model, evicted_by_head, prompt_ids

from sparseety.engine import EncodedInput
from sparseety.engine.request import GenerationOptions
from sparseety.errors import ConfigError
from sparseety.policies import Observation, build_policy
from sparseety.policies.h2o import H2OPolicy
from sparseety.policies.snapkv import SnapKVPolicy
from sparseety.policies.tova import TOVAPolicy

PROMPT, BUDGET, SINKS = 32, 12, 4


@pytest.fixture(scope="module")
def twin() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer: ``[kv_heads, P, P]`` prefill probabilities averaged over each KV group's query heads, and
    ``[kv_heads, P]`` ℓ1 norms of the cached values."""
    model = build_model("llama")
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = model(prompt_ids(PROMPT), output_attentions=True, use_cache=True)
    attention = [a[0].reshape(KV_HEADS, -1, PROMPT, PROMPT).mean(dim=1).double().numpy() for a in out.attentions]
    norms = [layer.values[0].double().abs().sum(dim=-1).numpy() for layer in out.past_key_values.layers]
    return attention, norms


def evicted(scores: np.ndarray, protected: np.ndarray, budget: int = BUDGET) -> set[int]:
    """All but the ``budget`` best slots; protected first; ties kept by the lower position."""
    scores = np.where(protected, np.inf, scores)
    return set(sorted(range(scores.size), key=lambda i: (-scores[i], i))[budget:])


def protected(window: int) -> np.ndarray:
    """The first ``SINKS`` positions and the newest ``window``."""
    at = np.arange(PROMPT)
    return (at < SINKS) | (at >= PROMPT - window)


def pooled(votes: np.ndarray, kernel: int) -> np.ndarray:
    return F.avg_pool1d(torch.from_numpy(votes).view(1, 1, -1), kernel, stride=1, padding=kernel // 2,
                        count_include_pad=False)[0, 0].numpy()


# name -> (options, per-head VATP scores from (attention [kv, P, P], norms [kv, P]) -> [kv, P], recent window)
CASES = {
    "h2o": ({"prefill_rows": 0}, lambda a, v: a.sum(axis=1) * v, BUDGET // 2),
    "snapkv": ({"window": 4, "kernel": 3}, lambda a, v: np.stack([pooled(h[-4:].sum(axis=0), 3) for h in a]) * v, 4),
    "tova_kv_head": ({"heads": "kv_head"}, lambda a, v: a[:, -1] * v, 0),
    "tova": ({}, lambda a, v: np.broadcast_to((a[:, -1] * v).mean(axis=0), v.shape), 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_keeps_the_vatp_best_slots(case, twin):
    options, vatp, window = CASES[case]
    name = case.split("_")[0]
    attention, norms = twin
    results = {aware: engine().generate(EncodedInput(prompt_ids(PROMPT)),
                                        build_policy(name, BUDGET, {**options, "value_aware": aware}),
                                        max_new_tokens=2, tier=2) for aware in (True, False)}
    changed = 0
    for layer in range(len(attention)):
        scores = vatp(attention[layer], norms[layer])
        for head in range(KV_HEADS):
            positions, steps = evicted_by_head(results[True], layer, head)
            got = set(positions[steps == 0].tolist())
            assert got == evicted(scores[head], protected(window)), f"layer {layer} head {head}"
            plain, plain_steps = evicted_by_head(results[False], layer, head)
            changed += got != set(plain[plain_steps == 0].tolist())
    assert changed > 0  # the value norms changed some kept set: the option is not a no-op here


def observation(attention: torch.Tensor, values: torch.Tensor, state: torch.Tensor | None = None) -> Observation:
    b, h, n = attention.shape[0], attention.shape[1], attention.shape[-1]
    return Observation(layer=0, num_layers=1, step=0 if state is None else 1, prefill=state is None,
                       positions=torch.arange(n).expand(b, h, n), keys=torch.ones(b, h, n, 2), attention=attention,
                       state=state, seed=0, values=values)


def test_h2o_accumulates_plain_attention_and_weights_it_by_the_value_norm():
    values = torch.tensor([[[[1.0, 1.0], [0.1, 0.1], [2.0, -1.0], [0.5, 0.0], [1.0, 0.0], [3.0, 3.0],
                             [0.0, 0.5], [1.0, 1.0]]]])  # ‖v‖₁: 2, 0.2, 3, 0.5, 1, 6, 0.5, 2
    state = torch.tensor([[[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.0, 0.0]]])
    attention = torch.tensor([[[0.0, 0.0, 0.1, 0.2, 0.0, 0.1, 0.3, 0.3]]])
    policy = build_policy("h2o", 6, {"recent_ratio": 0.34, "value_aware": "true"})  # recent window 2
    before = state.clone()
    scores, new_state = policy.score(observation(attention, values, state))
    assert torch.equal(new_state, before + attention)  # the accumulator stays plain attention
    inf = float("inf")
    expected = torch.tensor([[[inf, inf, inf, inf, 0.5 * 1.0, 0.7 * 6.0, inf, inf]]])  # 4 sinks, 2 recent
    assert torch.allclose(scores, expected)


def test_tova_layer_mode_averages_the_weighted_scores_over_kv_heads():
    attention = torch.tensor([[[0.1, 0.2, 0.3, 0.1, 0.1, 0.2], [0.3, 0.1, 0.1, 0.2, 0.2, 0.1]]])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).view(1, 1, 6, 1).repeat(1, 2, 1, 1)
    values[0, 1, :, 0] = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0])
    scores, state = build_policy("tova", 2, {"value_aware": True}).score(observation(attention, values))
    assert state is None
    mean = ((attention * values[..., 0]).mean(dim=1))[0]  # slots 4, 5: (0.5 + 0.4) / 2, (1.2 + 0.1) / 2
    assert torch.isinf(scores[..., :4]).all()
    assert torch.allclose(scores[0, :, 4:], mean[4:].expand(2, 2))


@pytest.mark.parametrize("cls", [H2OPolicy, TOVAPolicy, SnapKVPolicy])
@pytest.mark.parametrize("bad", [1, "true", None])
def test_a_non_boolean_value_aware_is_refused_naming_the_value(cls, bad):
    with pytest.raises(ConfigError) as info:
        cls(budget=8, value_aware=bad)
    assert str(info.value) == f"{cls.name}: value_aware must be true or false, got {bad!r}"


def test_a_bad_value_aware_option_string_is_refused():
    with pytest.raises(ConfigError) as info:
        build_policy("snapkv", 8, {"value_aware": "yes"})
    assert str(info.value) == "snapkv: option value_aware='yes' is not a valid bool"


def test_value_aware_is_off_by_default_and_recorded():
    for name in ("h2o", "tova", "snapkv"):
        assert build_policy(name, 8).params()["value_aware"] is False
        assert build_policy(name, 8, {"value_aware": "1"}).params()["value_aware"] is True


def test_value_aware_policies_in_one_batch_equal_each_alone():
    eng = engine()
    specs = [("h2o", 20, {}), ("tova", 18, {}), ("snapkv", 22, {"window": 6}), ("tova", 18, {"heads": "kv_head"}),
             ("pyramid", 20, {"window": 6})]
    pols = [build_policy(name, budget, {**opts, "value_aware": True}) for name, budget, opts in specs]
    pols.append(build_policy("h2o", 20))  # a plain policy beside them
    encoded = [EncodedInput(prompt_ids(n, seed=n)) for n in (40, 65, 31, 52, 58, 47)]
    batched = eng.generate_batch(encoded, pols, GenerationOptions(max_new_tokens=8, tier=3), prefill_chunk=16)
    for e, p, b in zip(encoded, pols, batched):
        alone = eng.generate(e, p, max_new_tokens=8, tier=3)
        assert b.output_ids == alone.output_ids
        assert b.kept_positions_final == alone.kept_positions_final
        for key in ("evicted.step", "evicted.layer", "evicted.kv_head", "evicted.position"):
            np.testing.assert_array_equal(b.arrays[key], alone.arrays[key], err_msg=key)
        np.testing.assert_allclose(b.arrays["evicted.score"], alone.arrays["evicted.score"], rtol=1e-4, atol=1e-3)
