"""``import rlhf_ext`` and ``import rlhf_ext.continual`` (incl. the runner and recipe) stay engine-free."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("trl", "openrlhf", "deepspeed", "ray", "vllm", "flash_attn", "transformers")


def test_continual_imports_no_engine():
    code = (
        "import sys, rlhf_ext, rlhf_ext.continual, rlhf_ext.pipelines.continual, rlhf_ext.pipelines.continual_recipe\n"
        "from rlhf_ext.continual import kl_to_previous, backward_transfer, cppo_sample_weights\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"engine modules imported: {out.stdout.strip()}"
