"""rlhf_ext.openrlhf.compat: flash-attn / vLLM stand-ins that let OpenRLHF import on CPU, fail loudly when used, and
leave no trace for other libraries once the scoped import is over."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from rlhf_ext.openrlhf import compat

pytestmark = pytest.mark.skipif(
    any(not compat.is_shim(sys.modules.get(p)) and importlib.util.find_spec(p) for p in ("flash_attn", "vllm")),
    reason="the real flash-attn / vLLM are installed: no stand-ins are needed",
)


def test_stand_ins_import_openrlhf_and_raise_clear_errors_when_used():
    with compat.import_shims() as installed:
        assert {"flash_attn.bert_padding", "vllm", "vllm.inputs", "vllm.utils"} <= set(installed)
        assert compat.install_import_shims() == []  # idempotent
        import vllm
        from flash_attn.bert_padding import pad_input, rearrange
        from openrlhf.models.ring_attn_utils import unpad_input
        from openrlhf.models.utils import log_probs_from_logits
        from openrlhf.trainer.ray.vllm_engine import RolloutRayActor  # noqa: F401  (imports vllm at module level)

        with pytest.raises(RuntimeError, match=r"flash_attn.bert_padding.pad_input needs flash-attn .* GPU machine"):
            pad_input(None, None, 1, 1)
        with pytest.raises(RuntimeError, match="unpad_input needs flash-attn"):
            unpad_input(None, None)
        with pytest.raises(RuntimeError, match="vllm.SamplingParams needs vLLM"):
            vllm.SamplingParams(n=2)
        with pytest.raises(RuntimeError, match="vllm.AsyncLLMEngine.from_engine_args needs vLLM"):
            vllm.AsyncLLMEngine.from_engine_args(None)
        assert not hasattr(vllm.SamplingParams, "__origin__")  # introspection still sees plain AttributeErrors
        with pytest.raises(AttributeError, match="stand-in"):
            vllm.__version__  # noqa: B018
        assert rearrange(torch.zeros(2, 3), "a b -> b a").shape == (3, 2)  # einops' real function
        # flash-attn's fused cross entropy is not shimmed: OpenRLHF falls back to its pure-torch path
        with pytest.raises(ModuleNotFoundError):
            import flash_attn.ops.triton.cross_entropy  # noqa: F401
        logits, labels = torch.randn(2, 4, 7), torch.randint(0, 7, (2, 4))
        expected = logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
        torch.testing.assert_close(log_probs_from_logits(logits.clone(), labels), expected)
    # after the block nothing is visible to other libraries' availability checks
    assert not any(name.split(".")[0] in ("vllm", "flash_attn") for name in sys.modules)
    assert importlib.util.find_spec("vllm") is None and importlib.util.find_spec("flash_attn") is None
    from transformers.utils.import_utils import is_flash_attn_2_available
    from trl.import_utils import is_vllm_available

    assert not is_vllm_available() and not is_flash_attn_2_available()


def test_persistent_install_and_remove():
    installed = compat.install_import_shims()
    try:
        assert "vllm.distributed.utils" in installed
        from vllm.distributed.utils import StatelessProcessGroup

        with pytest.raises(RuntimeError, match="StatelessProcessGroup.create needs vLLM"):
            StatelessProcessGroup.create(host="x", port=1, rank=0, world_size=1)
    finally:
        removed = compat.remove_import_shims()
    assert sorted(removed) == sorted(installed)
    assert compat.remove_import_shims() == []
