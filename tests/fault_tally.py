"""The fault-injection suite's figures (tests/test_faults.py, tests/test_ray_faults.py): faults injected, faults
survived (every process that should live lives, the service answers, the invariants hold after recovery), wrong
READY seen (a replica reported ready for adapter@version while one of its ranks did not hold exactly that version
ready) and data lost (registered adapters or their versions missing, or residency that disagrees with the
workers, after recovery). Printed when a module ends; appended as one JSON line to ``$LORA_CACHE_FAULTS_OUT``
when set (bench/RESULTS.md sums them)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field


@dataclass
class Tally:
    module: str
    injected: int = 0
    survived: int = 0
    wrong_ready: int = 0
    lost: int = 0
    faults: list[str] = field(default_factory=list)

    def record(self, fault: str, survived: bool, wrong_ready: int = 0, lost: int = 0) -> None:
        self.injected += 1
        self.survived += int(survived)
        self.wrong_ready += wrong_ready
        self.lost += lost
        self.faults.append(
            f"{fault}: {'survived' if survived else 'NOT survived'}, wrong READY {wrong_ready}, lost {lost}"
        )

    def report(self) -> None:
        print(
            f"\nFAULTS {self.module}: injected {self.injected}, survived {self.survived}, wrong READY "
            f"{self.wrong_ready}, data lost {self.lost}"
        )
        for line in self.faults:
            print(f"  {line}")
        out = os.environ.get("LORA_CACHE_FAULTS_OUT")
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(asdict(self)) + "\n")
