"""The controller's handle on a TP rank hosted in an engine's own process: the ``Endpoint`` actor and its
``Relay`` (lifecycle steps 4, 7). Files and how calls flow through them: lora_cache/link/README.md."""
