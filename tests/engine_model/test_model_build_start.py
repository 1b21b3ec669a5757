"""Building the model draws no initial weights: every builder fills each weight itself, and the draw on
the meta device the builders use imported ``torch._dynamo`` (1.3-2.3 s of every CPU server's start).
Checked in a fresh interpreter, where nothing else has imported it yet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_BUILD = """
import sys
from pathlib import Path

import torch

from engine.models.loader import build_model
from engine.models.random_init import build_random_model
from engine.models.spec import parse_checkpoint_config

model_dir = Path(sys.argv[1])
arch = parse_checkpoint_config(model_dir)
loaded = build_model(arch, model_dir, "cpu", torch.float32)
drawn = build_random_model(arch, "cpu", torch.float32, seed=3)
assert "torch._dynamo" not in sys.modules, "building a model imported torch._dynamo"
# and the weights are what each builder put there, nothing left from the skipped initialisation: the
# checkpoint's tensor for every loaded parameter, the seeded draw (N(0, 0.02)) for every drawn weight
from safetensors.torch import load_file

stored = load_file(str(model_dir / "model.safetensors"))
params = dict(loaded.named_parameters())
assert set(params) <= set(stored) | {"lm_head.weight"}, set(params) - set(stored)
for name, p in params.items():
    if name in stored:
        assert torch.equal(p, stored[name].to(p.dtype)), name
for name, p in drawn.named_parameters():
    if name.endswith("norm.weight"):
        assert bool((p == 1).all()), name
    else:
        assert 0.015 < float(p.std()) < 0.025 and abs(float(p.mean())) < 0.005, (name, float(p.std()))
print("ok")
"""


def test_building_a_model_imports_no_dynamo_and_fills_every_weight(tiny_model_dir):
    out = subprocess.run([sys.executable, "-c", _BUILD, str(tiny_model_dir)], cwd=REPO, capture_output=True,
                         text=True, timeout=280, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
