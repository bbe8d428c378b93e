"""The eviction timeline against a brute-force replay of the events, and against the engine's final cache."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseety.report.timeline import NEVER, build_timeline


def brute_force(events, layers, heads, positions, steps, prompt_len):
    """State per (layer, step, position) and slots held per (layer, step), replaying events one by one."""
    state = np.zeros((layers, steps, positions), dtype=np.int8)
    held = np.zeros((layers, steps))
    for layer in range(layers):
        for step in range(steps):
            seq = min(prompt_len + step, positions)
            gone = {h: {p for (s, l, hh, p) in events if l == layer and hh == h and s <= step} for h in range(heads)}
            for p in range(positions):
                n = sum(p in gone[h] for h in range(heads))
                state[layer, step, p] = 0 if p >= seq else 3 if n == heads else 2 if n else 1
            held[layer, step] = seq - sum(len({p for p in gone[h] if p < seq}) for h in range(heads)) / heads
    return state, held


@st.composite
def runs(draw):
    layers, heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    prompt_len, steps = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    positions = prompt_len + steps
    seen = {}
    for _ in range(draw(st.integers(0, 25))):
        step = draw(st.integers(0, steps - 1))
        position = draw(st.integers(0, min(prompt_len + step, positions) - 1))
        key = (draw(st.integers(0, layers - 1)), draw(st.integers(0, heads - 1)), position)
        seen[key] = min(step, seen.get(key, step))  # a position leaves a head's cache once
    events = [(s, l, h, p) for (l, h, p), s in seen.items()]
    return layers, heads, prompt_len, steps, positions, events


def arrays_of(events):
    cols = np.array(events, dtype=np.int64).reshape(-1, 4)
    return {f"evicted.{name}": cols[:, i] for i, name in enumerate(("step", "layer", "kv_head", "position"))}


@settings(max_examples=60, deadline=None)
@given(runs())
def test_states_and_held_slots_match_a_replay_of_the_events(run):
    layers, heads, prompt_len, steps, positions, events = run
    timeline = build_timeline(arrays_of(events), num_layers=layers, positions=positions, kv_heads=heads,
                              steps=steps, prompt_len=prompt_len)
    state, held = brute_force(events, layers, heads, positions, steps, prompt_len)
    for layer in range(layers):
        for step in range(steps):
            np.testing.assert_array_equal(timeline.state(layer, step), state[layer, step])
    np.testing.assert_allclose(timeline.kept_per_step, held)


def test_first_and_all_steps_and_head_counts():
    # layer 0: position 1 leaves head 0 at step 1 and head 1 at step 2; position 2 leaves head 1 only.
    events = [(1, 0, 0, 1), (2, 0, 1, 1), (0, 0, 1, 2)]
    timeline = build_timeline(arrays_of(events), num_layers=1, positions=6, kv_heads=2, steps=3, prompt_len=4)
    assert timeline.first_step[0].tolist() == [NEVER, 1, 0, NEVER, NEVER, NEVER]
    assert timeline.all_step[0].tolist() == [NEVER, 2, NEVER, NEVER, NEVER, NEVER]
    assert timeline.heads_evicted[0].tolist() == [0, 2, 1, 0, 0, 0]
    assert timeline.state(0, 0).tolist() == [1, 1, 2, 1, 0, 0]
    assert timeline.state(0, 2).tolist() == [1, 3, 2, 1, 1, 1]


def test_no_events_keeps_everything():
    timeline = build_timeline({}, num_layers=2, positions=5, kv_heads=3, steps=2, prompt_len=4)
    assert (timeline.first_step == NEVER).all() and (timeline.heads_evicted == 0).all()
    assert timeline.kept_per_step.tolist() == [[4, 5], [4, 5]]


def test_final_step_matches_the_engines_final_cache(real_trace):
    """What the timeline rebuilds from events equals what the engine's cache held at the end."""
    from sparseety.report.data import trace_view

    view = trace_view(real_trace)
    timeline = view["timeline"]
    kept = real_trace.document["sparsity"]["kept_positions_final"]
    last = timeline.steps - 1
    assert len(kept) == view["layers"] == 30
    for layer, per_head in kept.items():
        sets = [set(p) for p in per_head.values()]
        state = timeline.state(int(layer), last)
        assert set(np.flatnonzero(state == 1)) == set.intersection(*sets)
        seen = timeline.seq_len(last, view["positions"])
        assert set(np.flatnonzero(state == 3)) == set(range(seen)) - set.union(*sets)
        assert timeline.kept_per_step[int(layer), last] * len(sets) == sum(len(s) for s in sets)
