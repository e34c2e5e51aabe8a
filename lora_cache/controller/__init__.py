"""The controller: one Ray actor that sees the whole fleet and tells each TP worker what to hold (steps 0, 2-4, 7-8).

Files:
- ``core.py``: ``ControllerCore``, plain Python: catalog + planner + readiness index; checks every input.
- ``lost_ranks.py``: ``LostRanks``: ranks lost and not heard from since, the plans withheld from their replicas.
- ``admission.py``: ``ReportAdmission``: which residency claims of a rank the readiness index and the planner take.
- ``claims.py``: ``Claims``: per rank, the loads commanded, acquired or adopted (what admission believes).
- ``readiness.py``: replica-level readiness from per-rank reports, the sequenced event log subscribers
  read, and the ``Doorbell`` that wakes their long polls.
- ``links.py``: ``WorkerLinks``, the controller's side of each worker: handles, delta streams (incarnation,
  last delta applied), adoption from full reports, resyncs, pings, commands and their results.
- ``adoption.py``: ``Adoption``: the workers found at a (re)start, adopted from their reports, late ones too.
- ``registrations.py``: ``Registrar``: registrations read on a thread, applied on the loop in each name's
  arrival order, batched, handed to the workers with the version as hashed (step 0).
- ``snapshots.py``: what only the controller knows (hints, queues, popularity), kept in Ray's GCS kv.
- ``catalog_store.py``: the catalog kept there too, restored with each file proven the one hashed or hashed again.
- ``control_loop.py``: ``ControlLoop``: the start latch, the health rounds, plan-and-send; owns the links.
- ``actor.py``: ``ControllerActor``, the named, detached, restartable Ray actor that composes them and forwards.

Data flow: a hint, queue report or registration reaches the actor (from the gateway or a client) -> the core
takes it and plans -> the links send each worker its commands -> the workers' residency deltas come back
through the links into the core -> the readiness index emits replica events -> the doorbell wakes watchers.
After a restart the catalog is restored first, then the links rebuild the core's view from the workers'
reports (invariant 6), then the planner's snapshot is restored, then the actor plans. Imports run one way:
actor -> control_loop -> links -> adoption -> core; actor -> registrations -> links -> core -> (lost_ranks,
admission -> claims) -> readiness; actor -> snapshots -> catalog_store -> core; only the application imports actor.py.
"""
