"""rlhf_ext.openrlhf.compat as the continual actor uses it: scoped placeholders that let OpenRLHF import on CPU,
raise when used, keep OpenRLHF's pure-torch log-prob fallback working, and leave nothing behind."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from rlhf_ext.openrlhf import compat

pytestmark = pytest.mark.skipif(
    any(not compat.is_shim(p) and importlib.util.find_spec(p) for p in ("flash_attn", "vllm")),
    reason="the real flash-attn / vLLM are installed: no placeholders are needed",
)


def test_scoped_placeholders_import_openrlhf_raise_when_used_and_are_removed():
    registered_before = compat.is_shim("vllm")  # another adapter may have installed them for the whole process
    with compat.import_shims() as installed:
        if not registered_before:
            assert {"flash_attn.bert_padding", "vllm", "vllm.inputs", "vllm.utils"} <= set(installed)
        assert compat.install_import_shims() == []  # idempotent
        import vllm
        from flash_attn.bert_padding import pad_input
        from flash_attn.utils.distributed import all_gather
        from openrlhf.models.ring_attn_utils import unpad_input
        from openrlhf.models.utils import log_probs_from_logits
        from openrlhf.trainer.ray.vllm_engine import RolloutRayActor  # noqa: F401  (imports vllm at module level)

        for call in (lambda: all_gather(None, None), vllm.LLM):
            with pytest.raises(RuntimeError, match="not installed on this machine"):
                call()
        # flash-attn's padding helpers are plain PyTorch there too: real CPU versions (packing runs on CPU)
        mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        x = torch.arange(6.0).reshape(2, 3)
        packed, indices, cu_seqlens, longest, _ = unpad_input(x[..., None], mask)
        assert packed.squeeze(-1).tolist() == [0.0, 1.0, 3.0, 4.0, 5.0] and cu_seqlens.tolist() == [0, 2, 5]
        assert longest == 3 and torch.equal(pad_input(packed, indices, 2, 3).squeeze(-1), x * mask)
        # flash-attn's fused cross entropy is not a placeholder: OpenRLHF falls back to its pure-torch path
        with pytest.raises(ModuleNotFoundError):
            import flash_attn.ops.triton.cross_entropy  # noqa: F401
        logits, labels = torch.randn(2, 4, 7), torch.randint(0, 7, (2, 4))
        expected = logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
        torch.testing.assert_close(log_probs_from_logits(logits.clone(), labels), expected)
    if registered_before:
        return
    assert not any(name.split(".")[0] in ("vllm", "flash_attn") for name in sys.modules)
    assert importlib.util.find_spec("vllm") is None and importlib.util.find_spec("flash_attn") is None
    from transformers.utils.import_utils import is_flash_attn_2_available
    from trl.import_utils import is_vllm_available

    assert not is_vllm_available() and not is_flash_attn_2_available()
