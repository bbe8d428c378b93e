"""Fuzzed offline records: random fields, shapes, dtypes, NaN and infinities, and score files that are
torn, garbage or of another format. Each record is judged on its own: a bad one is one ``error:`` line,
the good record beside it is always extracted, and nothing is a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from fuzz_helpers import assert_clean, examples
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from typer.testing import CliRunner

from sparseety.cli import app

DTYPES = st.sampled_from([np.float16, np.float32, np.float64, np.int8, np.int64, np.uint8, np.bool_, np.complex64])
ARRAYS = hnp.arrays(DTYPES, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6),
                    elements=None)
FIELD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**65), max_value=2**65),
                         st.floats(allow_nan=True), st.text(max_size=10),
                         st.lists(st.integers(min_value=-5, max_value=2**40), max_size=8))
FIELDS = ["generation_id", "prompt_tokens", "generated_tokens", "layer", "score_type", "scores_path", "layout",
          "head_reduce", "query_reduce", "batch_index", "token_offset", "step", "unknown"]


def write_scores(folder: Path, array: np.ndarray, form: str, cut: float) -> str:
    name = f"scores.{'npy' if form.startswith('npy') else 'npz' if form.startswith('npz') else form}"
    path = folder / name
    if form.startswith("npy"):
        np.save(path, array)
    elif form.startswith("npz"):
        np.savez(path, scores=array)
    elif form == "safetensors":
        path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}" + bytes(8))
    else:
        path.write_bytes(array.tobytes()[:64])
    if form.endswith("-torn"):
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * cut)])
    return name


def good_record(folder: Path) -> Path:
    np.save(folder / "good.npy", np.full((3, 6), 1 / 6, dtype=np.float32))
    path = folder / "good.json"
    path.write_text(json.dumps({"generation_id": "good", "prompt_tokens": [5, 6, 7, 8], "generated_tokens": [9, 10],
                                "layer": 0, "score_type": "attention", "scores_path": "good.npy", "layout": "qk"}))
    return path


@examples(120)
@given(array=ARRAYS, form=st.sampled_from(["npy", "npz", "npy-torn", "npz-torn", "safetensors", "raw"]),
       cut=st.floats(min_value=0, max_value=1), n_prompt=st.integers(0, 8), n_gen=st.integers(0, 4),
       extra=st.dictionaries(st.sampled_from(FIELDS), FIELD_VALUES, max_size=3),
       score_type=st.sampled_from(["attention", "route", "activation"]))
def test_each_record_is_judged_on_its_own(array, form, cut, n_prompt, n_gen, extra, score_type, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rec")
    name = write_scores(folder, array, form, cut)
    record = {"generation_id": "fuzzed", "prompt_tokens": list(range(4, 4 + n_prompt)),
              "generated_tokens": list(range(20, 20 + n_gen)), "layer": 0, "score_type": score_type,
              "scores_path": name, **extra}
    fuzzed = folder / "fuzzed.json"
    fuzzed.write_text(json.dumps(record, allow_nan=True))
    result = CliRunner().invoke(app, ["extract", str(fuzzed), str(good_record(folder))])
    assert_clean(result)
    assert result.exit_code in (0, 1), result.output  # the good record always succeeds
    ids = {json.loads(line)["generation_id"] for line in result.stdout.splitlines() if line.strip()}
    assert "good" in ids  # nothing accepted is lost
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == (1 if result.exit_code == 1 else 0), result.stderr
