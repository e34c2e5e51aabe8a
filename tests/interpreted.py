"""Triton kernels built for the interpreter on a CPU-only machine (the kernel tests' helper).

``@triton.jit`` chooses the interpreter or the GPU compiler when its module is imported. A kernel test module calls
``build_for_interpreter`` before importing what it tests: each named kernel module imported earlier for the GPU is
rebuilt with ``TRITON_INTERPRET`` set only for that, and the modules that bound its functions at their import are
rebuilt after it. Other test modules keep the CPU paths (the torch twins).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence


def build_for_interpreter(kernels: Sequence[str], dependents: Sequence[str] = ()) -> None:
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        rebuilt = False
        for name in kernels:
            module = importlib.import_module(name)
            if not module.BUILT_FOR_INTERPRETER:  # imported earlier (by another test module) for the GPU
                importlib.reload(module)
                rebuilt = True
        for name in dependents if rebuilt else ():
            if name in sys.modules:  # imported earlier: bind it to the rebuilt kernels
                importlib.reload(sys.modules[name])
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
