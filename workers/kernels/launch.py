"""Launching a Triton kernel at a fixed launch plan with little Python per call (lifecycle step 9).

``kernel[grid](*args)`` costs about 25 us of Python per launch in Triton 3.6: it binds and specializes
every argument, looks the compiled kernel up and only then launches. A LoRA op launches its kernels
with the same plan (grid, constants, every argument but a few pointers and the layer) 4 x layers
times per step, so ``KernelCall`` goes through Triton's dispatcher once per plan and pointer alignment,
keeps the ``CompiledKernel`` it returns and launches that directly afterwards (``compiled[grid](*args)``,
Triton's own launcher for compiled kernels). That is sound because everything a compiled variant is
specialized on is fixed by the plan except the per-call pointers' 16-byte alignment (``meta_layer``,
the one per-call integer, is declared ``do_not_specialize``): the direct launch is kept for calls whose
pointers are all aligned (the caching allocator's and BatchMeta's are), any other call takes the
dispatcher. Under the interpreter ``kernel[grid]`` returns no compiled kernel: every call dispatches.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

POINTER_ALIGN = 16  # Triton specializes pointer arguments on data_ptr() % 16 == 0


class KernelCall:
    """One kernel at one plan: ``call(*head)`` launches ``kernel[grid](*head, *tail, **options)``.

    ``fixed`` names the value of every kernel parameter after the ``head`` ones (constexprs included, all
    passed by position, as Triton's launchers take them); ``options`` are launch options (num_warps...).
    """

    __slots__ = ("_runner", "grid", "kernel", "options", "tail")

    def __init__(self, kernel: Any, grid: tuple[int, int, int], head: int, fixed: Mapping[str, Any],
                 options: Mapping[str, Any]) -> None:
        names = list(inspect.signature(kernel.fn).parameters)[head:]
        if set(names) != set(fixed):
            raise TypeError(f"{kernel.fn.__name__}: fixed arguments {sorted(fixed)} do not match its parameters "
                            f"after the first {head}: {names}")
        self.kernel, self.grid, self.options = kernel, grid, dict(options)
        self.tail = tuple(fixed[n] for n in names)
        self._runner: Any = None  # the launcher of the variant compiled for aligned pointers

    def __call__(self, *head: Any) -> None:
        """``head``: the per-call arguments (tensors and unspecialized integers), in kernel order."""
        ptrs = 0
        for a in head:
            if type(a) is torch.Tensor:
                ptrs |= a.data_ptr()
        aligned = ptrs % POINTER_ALIGN == 0
        if aligned and self._runner is not None:
            self._runner(*head, *self.tail)
            return
        compiled = self.kernel[self.grid](*head, *self.tail, **self.options)
        if aligned and compiled is not None and hasattr(compiled, "run"):  # a CompiledKernel (None: interpreter)
            self._runner = compiled[self.grid]
