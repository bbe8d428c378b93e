"""The parts policies are built from, none of them a policy: shared helpers and the trained models they load.

- :mod:`~sparseety.policies.parts.rotary`: RoPE helpers (un-rotating keys, the mean rotation) for
  ``expected_attention`` and ``compactor``, and the inverse frequencies the engine reads;
- :mod:`~sparseety.policies.parts.value_aware`: the ``value_aware`` option (VATP) of ``h2o``, ``tova``
  and ``snapkv``;
- :mod:`~sparseety.policies.parts.learned_features` and :mod:`~sparseety.policies.parts.learned_model`:
  the ``learned`` policy's per-slot features and predictor (file format, loading, the shipped files of
  ``policies/weights/``);
- :mod:`~sparseety.policies.parts.kvzap_model`: the ``kvzap`` policy's surrogate (linear or MLP per layer).

The trainers that write the predictor and the surrogate live in :mod:`sparseety.training`; each policy
file (``policies/<name>.py``) imports what it needs from here, and the registry enumerates only those.
"""
