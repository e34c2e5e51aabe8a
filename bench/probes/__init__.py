"""One-off probes beside the benchmark: each measures one part of the system (or reads one run's logs) and
prints or writes its figures. None is part of the benchmark job, and nothing imports them; each runs as
``python -m bench.probes.<name>`` (bench/probes/README.md lists them; their figures are in bench/RESULTS.md).
"""
