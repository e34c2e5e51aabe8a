"""The benchmark's router (lifecycle step 1): which replica each request goes to, and when it is hinted.

``rules`` holds the routing rules (round-robin, least-loaded, affinity, lora-cache), plain Python that both
engines use; ``real`` the router thread of ``--engine real`` (over gRPC and the wall clock). The simulator
asks the same rules (``bench.sim.fleet.ROUTERS``). The advice the ``lora-cache`` rule follows is the
service's (``lora_cache.routing``). Nothing here is imported by this package's ``__init__``: the simulator
imports ``rules`` without gRPC.
"""
