"""The benchmark: the job, workloads, policies, routers, the simulator and probes (bench/README.md)."""
