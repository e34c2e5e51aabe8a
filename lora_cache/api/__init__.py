"""The router-facing gRPC API (lifecycle steps 1-2, 8): the contract in ``protos/lora_cache/v1``.

``v1/`` holds the generated code (never edited by hand; ``python -m lora_cache.api.regen``),
``validate`` turns request messages into checked controller inputs, ``ingest`` coalesces hint
batches into the controller, ``servicer`` maps each RPC to controller calls and domain errors to
status codes. The grpc.aio server around them is ``lora_cache.api.gateway``. Every file, and how a call
flows through them: lora_cache/api/README.md.
"""
