"""hetmoe.serve: an OpenAI-compatible HTTP server with continuous batching.

``protocol`` (request validation, error bodies), ``sampling``, ``stops`` (incremental
detokenization and stop strings), ``kv_batch`` (the left-padded batch cache),
``ragged_attention`` (batch-invariant decode attention), ``scheduler`` (the worker thread),
``metrics`` (Prometheus), ``served_model`` (model + tokenizer + limits), ``app`` (FastAPI),
``background`` (uvicorn on a thread). Only ``hetmoe.cli`` imports this package.
"""
