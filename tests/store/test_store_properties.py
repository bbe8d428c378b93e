"""Property tests: any array a run may carry survives the store exactly; redaction leaves no secret."""

from __future__ import annotations

import tempfile
from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from sparseety.store import load_trace, write_trace
from sparseety.store.privacy import find_secrets, redact_text, redact_tokens
from sparseety.store.synthetic import synthetic_result

DTYPES = st.sampled_from([np.float16, np.float32, np.int64, np.int32, np.uint8, np.bool_])
NAMES = st.sampled_from(["importance", "step_importance", "router.3", "activation.maxabs", "custom", "x.y.z",
                         "pruned.score", "drafted.extra"])


@st.composite
def named_arrays(draw) -> dict[str, np.ndarray]:
    out = {}
    for name in draw(st.lists(NAMES, min_size=1, max_size=4, unique=True)):
        dtype = draw(DTYPES)
        shape = draw(array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
        elements = st.floats(width=16, allow_nan=True, allow_infinity=True) if dtype == np.float16 else None
        out[name] = draw(arrays(dtype, shape, elements=elements))
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(named_arrays())
def test_any_arrays_round_trip_exactly(extra_arrays):
    result = synthetic_result(0, tier=3)
    result = replace(result, arrays={**result.arrays, **extra_arrays})
    with tempfile.TemporaryDirectory() as folder:
        trace = load_trace(write_trace(result, folder))
    assert set(trace.arrays) == set(result.arrays)
    for name, array in result.arrays.items():
        back = trace.arrays[name]
        assert back.dtype == array.dtype and back.shape == array.shape, name
        assert np.array_equal(back, array, equal_nan=array.dtype.kind == "f"), name


WORDS = st.text(alphabet=st.sampled_from("abcdefghij ,.!?-"), max_size=12)
SECRET = st.one_of(
    st.from_regex(r"[a-z]{3,8}\.[a-z]{2,6}@[a-z]{3,8}\.(com|org|net)", fullmatch=True),
    st.from_regex(r"sk-[A-Za-z0-9]{24,32}", fullmatch=True),
    st.from_regex(r"ghp_[A-Za-z0-9]{36}", fullmatch=True),
    st.tuples(*[st.integers(1, 254)] * 4).map(lambda t: ".".join(map(str, t))),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(WORDS, SECRET), min_size=1, max_size=4), WORDS)
def test_planted_secrets_never_survive(pieces, tail):
    text = "".join(f"{words} {secret} " for words, secret in pieces) + tail
    redacted = redact_text(text)
    for _, secret in pieces:
        assert secret not in redacted
    assert redact_text(redacted) == redacted  # placeholders are not secrets themselves
    assert not find_secrets(redacted)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(WORDS, SECRET), min_size=1, max_size=3), st.integers(1, 5), st.randoms(use_true_random=False))
def test_secrets_split_across_tokens_never_survive(pieces, max_len, rnd):
    text = "".join(f"{words} {secret} " for words, secret in pieces)
    tokens, i = [], 0
    while i < len(text):  # random tokenization
        step = rnd.randint(1, max_len)
        tokens.append(text[i : i + step])
        i += step
    redacted, masked = redact_tokens(tokens)
    joined = "".join(redacted)
    for _, secret in pieces:
        assert secret not in joined
    assert all(redacted[p] != tokens[p] for p in masked)
    assert [t for p, t in enumerate(redacted) if p not in masked] == [t for p, t in enumerate(tokens) if p not in masked]
