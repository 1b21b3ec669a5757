"""Importing the engine does not import triton.language.

That import decorates Triton's own helpers (tl.max, tl.sum, ...) in the mode TRITON_INTERPRET names at
that moment; the CPU tests switch the interpreter on after the engine is imported (tests/kernels,
tests/tiers), and a helper decorated for the compiler then fails inside every interpreted kernel.
Session 20's argmax kernel, imported with engine.sampling, did exactly that to half of CI. Run in a
fresh interpreter: this process has imported everything already."""

from __future__ import annotations

import subprocess
import sys

MODULES = ("engine.sampling", "engine.llm_engine", "engine.model_runner", "engine.launch", "engine.async_engine")


def test_the_engine_imports_without_triton_language():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES)
            + "print('triton.language' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", "an engine module imports triton.language at import time"
