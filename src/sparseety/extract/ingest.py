"""Offline records: the JSON convention any serving system can dump, and their score files.

A record is one JSON object::

    {"generation_id": "g1", "prompt_tokens": [...], "generated_tokens": [...], "layer": 3,
     "score_type": "attention", "scores_path": "g1_l3.npy",
     "layout": "hqk", "token_offset": 0, "batch_index": null, "step": null, "request_meta": {...}}

the last five keys being optional. A ``.json`` file holds one record, a ``.jsonl`` file one per line.
``scores_path`` is resolved against a base directory (the record file's folder by default) and may not
leave it. Score files are ``.npy`` (loaded without pickle), ``.npz`` or ``.safetensors``.

An attention record may also name ``value_norms_path``: the keys' value norms, ``[kv_heads, keys]``
(``‖v_j‖``, the ``value`` score) or ``[kv_heads, keys, g]`` (``‖W_O^h v_j‖`` for each of the group's ``g``
query heads, the ``output`` score), or ``[keys]`` for one head. :meth:`OfflineRecord.scores_for` then
weighs each head's attention by them with :func:`sparseety.extract.scoring.head_scores`, the engine's own
scoring code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparseety.config import ExtractionConfig
from sparseety.errors import RecordError
from sparseety.extract.scoring import head_scores
from sparseety.extract.signals import attention_layout

_REQUIRED: dict[str, tuple[type, ...]] = {
    "generation_id": (str, int),
    "prompt_tokens": (list,),
    "generated_tokens": (list,),
    "layer": (int, type(None)),
    "score_type": (str,),
    "scores_path": (str,),
}
_OPTIONAL: dict[str, tuple[type, ...]] = {
    "layout": (str, type(None)),
    "token_offset": (int, type(None)),
    "batch_index": (int, type(None)),
    "step": (int, type(None)),
    "request_meta": (dict, type(None)),
    "value_norms_path": (str, type(None)),
}
_CONFIG_KEYS = ("score_type", "layout", "token_offset", "batch_index")


@dataclass(frozen=True)
class OfflineRecord:
    """One parsed offline record; ``scores_path`` is resolved and known to lie inside the base directory.

    Attributes
    ----------
    source : where the record came from, e.g. ``dump.jsonl:3``, for messages.
    """

    generation_id: str | int
    prompt_tokens: list[int]
    generated_tokens: list[int]
    layer: int | None
    score_type: str
    scores_path: Path
    source: str
    layout: str | None = None
    token_offset: int | None = None
    batch_index: int | None = None
    step: int | None = None
    request_meta: dict[str, Any] | None = None
    value_norms_path: Path | None = None

    @property
    def token_ids(self) -> list[int]:
        """``prompt_tokens + generated_tokens``."""
        return self.prompt_tokens + self.generated_tokens

    def config_fields(self) -> dict[str, Any]:
        """The extraction settings the record sets itself (``score_type`` and those not null)."""
        return {key: getattr(self, key) for key in _CONFIG_KEYS if getattr(self, key) is not None}

    def load_scores(self) -> np.ndarray | torch.Tensor:
        """The record's score tensor (see :func:`load_scores`)."""
        return load_scores(self.scores_path)

    def scores_for(self, config: ExtractionConfig) -> np.ndarray | torch.Tensor:
        """The score tensor to extract from: the attention weighed by the value norms when the record has
        them (:func:`value_weighted`), else :meth:`load_scores`."""
        scores = self.load_scores()
        if self.value_norms_path is None:
            return scores
        if config.score_type != "attention":
            raise RecordError(f"value_norms_path weighs attention scores; this record's score_type is "
                              f"{config.score_type!r}")
        return value_weighted(torch.as_tensor(scores), torch.as_tensor(load_scores(self.value_norms_path)), config)


def value_weighted(x: torch.Tensor, norms: torch.Tensor, config: ExtractionConfig) -> torch.Tensor:
    """Attention ``x`` (in ``config.layout``) with each head's weight of key ``j`` times the key's value norm
    (``norms`` ``[kv_heads, keys(, g)]`` or ``[keys]``), through :func:`~sparseety.extract.scoring.head_scores`.

    Raises
    ------
    RecordError
        Norms of the wrong rank, key count or head count.
    """
    layout = attention_layout(x, config)
    if norms.dim() == 1:
        norms = norms[None]
    if norms.dim() == 2:
        norms = norms[..., None]
    keys = x.shape[layout.index("k")]
    heads = x.shape[layout.index("h")] if "h" in layout else 1
    if norms.dim() != 3 or norms.shape[1] != keys or heads % norms.shape[0] or \
            norms.shape[2] not in (1, heads // norms.shape[0]):
        raise RecordError(f"value norms of shape {tuple(norms.shape)} do not fit attention of shape {tuple(x.shape)} "
                          f"(layout {layout!r}): expected [kv_heads, {keys}] or [kv_heads, {keys}, g] with kv_heads "
                          f"dividing {heads} and g = {heads} / kv_heads")
    canon = x if "h" in layout else x.unsqueeze(-3)  # [.., heads, q, k] or [.., heads, k, q]
    key_last = layout.endswith("qk")
    rows = canon.transpose(-2, -3) if key_last else canon.permute(*range(canon.dim() - 3), -1, -3, -2)
    weighted = head_scores(rows.float(), norms.float())  # [.., q, heads, k]
    back = weighted.transpose(-2, -3) if key_last else weighted.permute(*range(weighted.dim() - 3), -2, -1, -3)
    return back if "h" in layout else back.squeeze(-3)


def read_records(path: str | Path, base_dir: str | Path | None = None) -> list[OfflineRecord | RecordError]:
    """Parse a ``.json`` (one record) or ``.jsonl`` (one record per line) file.

    Parameters
    ----------
    path : the record file.
    base_dir : folder ``scores_path`` is resolved against and confined to (default: the file's folder).

    Returns
    -------
    list[OfflineRecord | RecordError]
        One entry per record; a bad line of a JSONL file comes back as a :class:`RecordError` in its
        place, so the other lines still count.

    Raises
    ------
    RecordError
        The file is missing or unreadable, or a ``.json`` file is not one valid record.
    """
    path = Path(path)
    base = Path(base_dir if base_dir is not None else path.parent).resolve()
    if not base.is_dir():
        raise RecordError(f"base directory not found: {base}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecordError(f"records file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"cannot read records file {path}: {exc}") from None
    if path.suffix.lower() != ".jsonl":
        return [parse_record(_loads(text, str(path), hint=True), base_dir=base, source=str(path))]
    records: list[OfflineRecord | RecordError] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            source = f"{path}:{number}"
            try:
                records.append(parse_record(_loads(line, source), base_dir=base, source=source))
            except RecordError as exc:
                records.append(exc)
    return records


def parse_record(data: Any, *, base_dir: Path, source: str) -> OfflineRecord:
    """Check one decoded JSON record and resolve its ``scores_path`` inside ``base_dir``.

    Raises
    ------
    RecordError
        Naming the missing or mistyped key, or the unsafe path.
    """
    if not isinstance(data, dict):
        raise RecordError(f"{source}: a record must be a JSON object, got {_json_type(data)}")
    for key, kinds in {**_REQUIRED, **_OPTIONAL}.items():
        if key not in data:
            if key in _REQUIRED:
                raise RecordError(f"{source}: record key {key!r} is missing")
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            expected = " or ".join("null" if kind is type(None) else _JSON_NAMES[kind] for kind in kinds)
            raise RecordError(f"{source}: record key {key!r} must be {expected}, got {_json_type(value)}")
    for key in ("prompt_tokens", "generated_tokens"):
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in data[key]):
            raise RecordError(f"{source}: record key {key!r} must be a list of non-negative integer token ids")
    for key in ("layer", "token_offset", "batch_index", "step"):
        if data.get(key) is not None and data[key] < 0:
            raise RecordError(f"{source}: record key {key!r} must not be negative, got {data[key]}")
    return OfflineRecord(
        generation_id=data["generation_id"],
        prompt_tokens=list(data["prompt_tokens"]),
        generated_tokens=list(data["generated_tokens"]),
        layer=data["layer"],
        score_type=data["score_type"],
        scores_path=resolve_scores_path(data["scores_path"], base_dir, source),
        source=source,
        layout=data.get("layout"),
        token_offset=data.get("token_offset"),
        batch_index=data.get("batch_index"),
        step=data.get("step"),
        request_meta=data.get("request_meta"),
        value_norms_path=None if data.get("value_norms_path") is None else
        resolve_scores_path(data["value_norms_path"], base_dir, source),
    )


def resolve_scores_path(scores_path: str, base_dir: Path, source: str = "record") -> Path:
    """``base_dir / scores_path``, resolved (symlinks too); refused when it leaves ``base_dir``."""
    base = base_dir.resolve()
    if not scores_path or "\x00" in scores_path:
        raise RecordError(f"{source}: scores_path {scores_path!r} is not a file name")
    full = (base / scores_path).resolve()
    if not full.is_relative_to(base):
        raise RecordError(f"{source}: scores_path {scores_path!r} escapes the base directory {base}")
    return full


def load_scores(path: str | Path) -> np.ndarray | torch.Tensor:
    """Load a score tensor from ``.npy`` (never unpickling), ``.npz`` or ``.safetensors``.

    A ``.npz``/``.safetensors`` file must hold one array, or name the one to use ``scores``.

    Raises
    ------
    RecordError
        Missing file, unsupported type, pickled, truncated or malformed content (any failure of the
        loaders), ambiguous arrays.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".npy", ".npz", ".safetensors"):
        raise RecordError(f"unsupported scores file type {suffix or path.name!r}: use .npy, .npz or .safetensors")
    if not path.is_file():
        raise RecordError(f"scores file not found: {path}")
    try:
        if suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return archive[_pick(path, archive.files)]
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except SafetensorError as exc:
            raise RecordError(f"cannot read {path}: {exc}") from None
        return tensors[_pick(path, list(tensors))]
    except RecordError:
        raise
    except ValueError as exc:  # NumPy's refusal of pickled or object data, or a malformed header
        raise RecordError(f"{path} is not a plain numeric array file (pickled data is refused): {exc}") from None
    except OSError as exc:
        raise RecordError(f"cannot read {path}: {exc}") from None
    except Exception as exc:  # not a zip archive, truncated data, a corrupt member: the record's error
        raise RecordError(f"cannot read {path}: not a valid {suffix} file ({type(exc).__name__}: {exc})") from None


def _pick(path: Path, names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    if "scores" in names:
        return "scores"
    raise RecordError(f"{path} holds the arrays {sorted(names)}: keep only one, or name it 'scores'")


def _loads(text: str, source: str, hint: bool = False) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        tip = " (a file of one record per line needs the .jsonl extension)" if hint and exc.msg == "Extra data" else ""
        raise RecordError(f"{source}: malformed JSON: {exc}{tip}") from None


_JSON_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "an object"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        return "a number"
    return _JSON_NAMES.get(type(value), type(value).__name__)
