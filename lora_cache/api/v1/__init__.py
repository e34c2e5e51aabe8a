"""Generated code of the ``lora_cache.v1`` protobuf package; regenerate with ``python -m lora_cache.api.regen``."""
