"""The ground floor of the vLLM integration: every vLLM internal SparSEEty patches or reads, declared and checked at
load (:mod:`.needs`), the readers that turn vLLM's objects into SparSEEty's own types, one module per process
(:mod:`.frontend`: the API server; :mod:`.scheduler`: the engine core; :mod:`.worker`: the model runner and the
attention backend; :mod:`.eviction`: what eviction reads and changes in both), the guards that keep a hook's errors
out of vLLM (:mod:`.guards`) and the message types (:mod:`.messages`). :mod:`.adapter` gathers them under one name.
Imports nothing else of the integration, and neither vLLM nor torch at import time.
"""
