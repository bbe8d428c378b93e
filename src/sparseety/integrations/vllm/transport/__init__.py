"""What carries records from vLLM's processes to the store: the channels between processes, the record of one
request, the sink that writes it, the Prometheus metrics, the ``SPARSEETY_*`` settings and the strict reading of
values from outside. Imports only :mod:`..vllm_api` of the integration.
"""
