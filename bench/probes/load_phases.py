"""One load's time split into its phases (``bench.probes.cold_read``, issue 30), from its marks.

A split of ``cold_read.py`` along its seam: the probe drives loads and times them; this reads one load's marks
(``SlotLoad.marks``, its read's ``HostEntry.marks``) into named phases, and takes their medians over loads.
Plain Python: the figures' meaning in one place (``phases``' docstring).
"""

from __future__ import annotations

import statistics
from typing import Any


def phases(t0: float, load: list[tuple[str, float]], read: list[tuple[str, float]]) -> dict[str, float]:
    """One load's time split into its phases, ms (``SlotLoad.marks``, and its read's ``HostEntry.marks``: empty
    for a host hit), each from the end of the one before:

    - ``dispatch``: prefetch -> the host tier's read thread starts (the cache's and the tier's Python, a pool hop);
    - ``to_reader``: -> the reader (process) has the job (a thread reader: 0);
    - ``open``: -> the file stat'ed, opened, fstat'ed, its header read and CRC-checked, its index (cached) found;
    - ``plan``: -> the plan (cached per rank pattern) and the chunks' block checks chosen, the tasks built;
    - ``read``: -> the last chunk read and proven (``read_first``: -> the first one);
    - ``report_lag``, ``issue_lag``: median per chunk, proven in the reader -> known here -> its copy issued;
    - ``reply``: last chunk proven -> the read's end known here (the reader's final reply);
    - ``to_slot``: (a hit) prefetch -> its slot taken; ``issue``: (a hit) slot -> last copy issued, of which
      ``issue_copy``: slot -> the first copy issued, ``issue_meta``: the slot's kernel metadata written after it;
    - ``copy_tail``: the later of the last copy issued and the read's end -> the watcher sees the last copy done;
    - ``finish``: -> READY reported, the future resolved; ``total``: prefetch -> that.
    ``busy_read`` / ``busy_crc``: the reader threads' time in slice reads and in block checks (summed, ms).
    A read split over processes: each step from the first process to get there, a chunk proven by the last."""
    at: dict[str, float] = {}
    busy = {"busy read": 0.0, "busy crc": 0.0}
    proven: dict[int, float] = {}
    got: dict[int, float] = {}
    issued: dict[int, float] = {}
    for name, t in [*load, *read]:
        if name in busy:
            busy[name] += t
        elif name.startswith("proven "):  # a split read: the last part to prove the chunk
            k = int(name.split()[1])
            proven[k] = max(t, proven.get(k, t))
        elif name.startswith("got "):
            got[int(name.split()[1])] = t
        elif name.startswith("issue "):
            issued[int(name.split()[1])] = t
        else:
            at.setdefault(name, t)
    out: dict[str, float] = {}

    def step(name: str, start: float, end: float | None) -> float:
        if end is not None:
            out[name] = (end - start) * 1e3
            return end
        return start

    last_issue = max(issued.values(), default=t0)
    if read:
        t = step("dispatch", t0, at.get("read"))
        t = step("to_reader", t, at.get("received", t))
        t = step("open", t, at.get("opened"))
        planned = t = step("plan", t, at.get("planned"))
        if proven:
            out["read_first"] = (proven[min(proven)] - planned) * 1e3
            t = step("read", t, max(proven.values()))
            known = got or proven
            out["report_lag"] = statistics.median((got[k] - proven[k]) * 1e3 for k in got) if got else 0.0
            out["issue_lag"] = statistics.median((issued[k] - known[k]) * 1e3 for k in issued if k in known)
        t = step("reply", t, at.get("read end"))
        t = max(t, last_issue)
    else:
        t = step("to_slot", t0, at.get("slot"))
        if "meta" in at and "meta end" in at:
            out["issue_copy"] = (at["meta"] - t) * 1e3
            out["issue_meta"] = (at["meta end"] - at["meta"]) * 1e3
        t = step("issue", t, last_issue)
    t = step("copy_tail", t, at.get("seen"))
    step("finish", t, at.get("ready"))
    out["total"] = (at.get("ready", t0) - t0) * 1e3
    out["busy_read"], out["busy_crc"] = busy["busy read"] * 1e3, busy["busy crc"] * 1e3
    return out


def median_phases(results: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each phase (``phases``) over loads."""
    names = {k for r in results for k in r.get("phases", {})}
    return {k: statistics.median([r["phases"][k] for r in results if k in r["phases"]]) for k in sorted(names)}
