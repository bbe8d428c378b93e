"""Training: the fits that produce the files SparSEEty ships or a user passes back in.

Each module here drives the engine (teacher-forced or dense runs of a model), the bench's prompts
or stored traces, and writes a weights file that a later run reads; so this room sits above the
engine, bench, extract and store it uses, and nothing below imports it (a run never trains).

- :mod:`~sparseety.training.learned_policy`: the ``learned`` policy's predictor from tier-3 traces
  (``sparseety learn-policy``);
- :mod:`~sparseety.training.kvzap_surrogate`: the ``kvzap`` policy's surrogate from KVzip+ scores
  (``sparseety learn-policy --target kvzip``);
- :mod:`~sparseety.training.head_weights`: ``--importance learned``'s per-head weights
  (:class:`~sparseety.extract.head_weights.HeadWeights`, ``sparseety learn-importance``);
- :mod:`~sparseety.training.shipped_policies` and :mod:`~sparseety.training.shipped_head_weights`:
  rebuild the shipped files (``src/sparseety/policies/weights/``, ``src/sparseety/extract/weights/``)
  from a source checkout, ``python -m sparseety.training.shipped_policies`` and
  ``python -m sparseety.training.shipped_head_weights``.

One fit lives outside: ``benchmarks/kvpress_kvzap_train.py`` trains kvpress's own kvzap model (in
kvpress's side environment, ``benchmarks/.kvpress-venv``) on the same traces, to compare with ours;
it is a benchmark, not a file SparSEEty ships.

The modules are imported by name (``from sparseety.training.learned_policy import learn``): importing
this package loads none of them, so it pulls in no torch.
"""
