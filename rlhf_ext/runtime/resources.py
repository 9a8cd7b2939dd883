"""Cluster shapes, model sizes and per-GPU memory for the pre-flight plan (engine-free arithmetic; see
:mod:`rlhf_ext.openrlhf.plan` and :mod:`rlhf_ext.pipelines.plan` for what is placed where).

Memory per GPU, in GiB (2**30 bytes), for a model of ``P`` parameters:

* **training state** with Adam (Rajbhandari et al. 2020, ZeRO, section 3.1): mixed precision (DeepSpeed bf16, as
  OpenRLHF trains) keeps ``2P`` bf16 weights, ``2P`` bf16 gradients and ``12P`` of fp32 master weights and Adam
  moments; ZeRO stage 1 shards the ``12P`` over the ``d`` data-parallel ranks, stage 2 also the gradients, stage 3
  also the weights; ``--ds.adam_offload`` moves the ``12P`` to host memory. fp32 training without DeepSpeed (a TRL
  model under DDP, ``bf16`` autocast) keeps ``4P + 4P + 8P`` on every GPU.
* **frozen models** (reference, reward model): their weights, ``2P`` in bf16 (``4P`` fp32), sharded by ZeRO-3.
* **activations** (an estimate; Korthikanti et al. 2022, Eq. 1 without the ``5as/h`` attention-score term that
  flash-attention does not store): ``34 t h`` bytes per layer for ``t`` tokens in a micro batch of hidden size ``h``;
  with activation checkpointing only each layer's input (``2 t h``) is kept plus one layer being recomputed; a
  language-model head adds ``10 t V`` bytes (bf16 logits, their fp32 copy and the log-softmax, as OpenRLHF computes
  log-probs). A forward without gradients (experience making) holds one layer plus the head.
* **vLLM**: ``gpu_memory_utilization`` of the GPU per engine GPU — its weights (``2P / tp``) and the KV cache, which
  needs ``2 * layers * kv_heads * head_dim * 2 / tp`` bytes per token.

The training state and vLLM's share are exact arithmetic: a plan whose sum of them exceeds a GPU cannot run. The
activation term is an estimate and only warns.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rlhf_ext.algos.knobs import knob

GiB = 2**30


class PlanError(ValueError):
    """A plan that cannot run (one line naming the problem and the fix)."""


# --------------------------------------------------------------------------------------------------------- cluster
@dataclass(frozen=True)
class Cluster:
    """``gpus``: GPUs per node (one entry per node; ``(0,)`` is a CPU-only machine). ``gpu_memory_gib``: memory of one
    GPU (None: unknown). ``source``: where the shape came from. ``logical``: the GPUs are Ray bookkeeping on machines
    without GPUs (``ray start --num-gpus N``), so everything computes on CPUs."""

    gpus: tuple[int, ...]
    gpu_memory_gib: float | None = knob(None, gt=0)
    source: str = "stated"
    logical: bool = False

    @property
    def num_nodes(self) -> int:
        return len(self.gpus)

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus)

    @property
    def gpus_per_node(self) -> int:
        """GPUs of the smallest node (OpenRLHF's ``*.num_gpus_per_node`` is the same on every node)."""
        return min(self.gpus) if self.gpus else 0

    def describe(self) -> str:
        if self.total_gpus == 0:
            return f"CPU only ({self.source})"
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''}"
        per_node = f"{self.gpus_per_node} GPU{'s' if self.gpus_per_node != 1 else ''}"
        shape = f"{nodes} x {per_node}" if len(set(self.gpus)) == 1 else f"{nodes}, GPUs {self.gpus}"
        memory = f"{self.gpu_memory_gib:g} GiB each" if self.gpu_memory_gib else "GPU memory unknown"
        memory = "logical GPUs: computing on CPUs" if self.logical else memory
        return f"{shape} ({memory}; {self.source})"


def parse_cluster(spec: str, gpu_memory_gib: float | None = 80.0) -> Cluster:
    """``"2x8"`` -> 2 nodes of 8 GPUs; ``"1x0"`` is a CPU-only machine."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", spec)
    if not match or int(match.group(1)) < 1:
        raise PlanError(f"--cluster must be auto or NODESxGPUS (e.g. 1x8, 2x8; 1x0 = CPU only), got {spec!r}")
    nodes, gpus = int(match.group(1)), int(match.group(2))
    return Cluster((gpus,) * nodes, gpu_memory_gib if gpus else None, "stated")


# ----------------------------------------------------------------------------------------------------- model sizes
@dataclass(frozen=True)
class ModelSize:
    """Parameter count and the shapes the memory formulas need, read from a model's config."""

    name: str
    params: int  # as a causal LM (tied embeddings counted once)
    lm_head_params: int  # output-embedding parameters that are not tied to the input embeddings
    hidden: int
    layers: int
    vocab: int
    kv_heads: int
    head_dim: int
    assumed: str = ""  # why this size is an assumption, if it is one

    @property
    def value_model_params(self) -> int:
        """A reward model or critic on the same backbone: the LM head replaced by a ``hidden -> 1`` head."""
        return self.params - self.lm_head_params + self.hidden


class ModelSizeUnknown(LookupError):
    """The config of a model could not be read (not on disk, not in the Hugging Face cache while offline)."""


def model_size(name_or_path: str, config=None) -> ModelSize:
    """The size of ``name_or_path`` from its ``config.json`` (a local directory, the Hugging Face cache, or the hub
    when online), counted exactly by building the model on the ``meta`` device (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if config is None:
        try:
            config = AutoConfig.from_pretrained(name_or_path)
        except (OSError, ValueError) as error:
            raise ModelSizeUnknown(f"{name_or_path}: {str(error).splitlines()[0]}") from None
    config = getattr(config, "get_text_config", lambda: config)()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    lm_head_params = 0 if head is None or tied else head.weight.numel()
    return ModelSize(
        name=str(name_or_path),
        params=params,
        lm_head_params=lm_head_params,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        vocab=config.vocab_size,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
    )


#: Why a model that does not exist yet is sized as another one.
SIZED_AS_SFT = "not found: sized as the SFT model it is trained from"


def size_or_fallback(
    lookup: Callable[[str], ModelSize], spec: str | None, fallback: ModelSize | None
) -> ModelSize | None:
    """``lookup(spec)``; a model whose config cannot be read is sized as ``fallback`` (a reward model or critic that
    is not trained yet: as the SFT model it starts from), or unknown (None)."""
    if not spec:
        return None
    try:
        return lookup(spec)
    except ModelSizeUnknown:
        return None if fallback is None else replace(fallback, name=spec, assumed=SIZED_AS_SFT)


# ----------------------------------------------------------------------------------------------------- memory terms
def training_state(
    params: int, zero_stage: int, world: int, mixed_precision: bool = True, offload_optimizer: bool = False
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU of a model trained with Adam (module docstring)."""
    if not mixed_precision:  # fp32 model under DDP: nothing is sharded
        return 4.0 * params, 4.0 * params, 8.0 * params
    w, g, o = 2.0 * params, 2.0 * params, 12.0 * params
    d = max(world, 1)
    if zero_stage >= 1:
        o /= d
    if zero_stage >= 2:
        g /= d
    if zero_stage >= 3:
        w /= d
    return w, g, 0.0 if offload_optimizer else o


def activation_bytes(size: ModelSize, tokens: int, training: bool, checkpointing: bool, lm_head: bool) -> float:
    """Peak activation bytes of one micro batch of ``tokens`` tokens (module docstring)."""
    layer = 34.0 * tokens * size.hidden
    if not training:
        stored = layer
    elif checkpointing:
        stored = 2.0 * tokens * size.hidden * size.layers + layer
    else:
        stored = layer * size.layers
    return stored + (10.0 * tokens * size.vocab if lm_head else 0.0)


def kv_bytes_per_token(size: ModelSize, tensor_parallel: int = 1) -> float:
    """bf16 K and V of every layer for one token, per GPU of a ``tensor_parallel``-way engine."""
    return 2.0 * size.layers * size.kv_heads * size.head_dim * 2 / tensor_parallel


# ------------------------------------------------------------------------------------------------------ the table
@dataclass
class RoleMemory:
    """One role's bytes on each GPU it occupies."""

    role: str
    setup: str  # e.g. "ZeRO-2 x8, grad ckpt", "bf16, frozen"
    size: ModelSize | None
    params: int = 0
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    vllm: float = 0.0  # vLLM's reservation: weights + KV cache
    note: str = ""

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer + self.vllm


@dataclass
class GPUGroup:
    """``count`` GPUs holding the same roles; ``static`` / ``peak`` bytes on each (None: not computable)."""

    label: str
    count: int
    roles: list[str]
    static: float | None = None
    peak: float | None = None


@dataclass
class Plan:
    """What a run will ask for: where its roles go and what each GPU holds; ``problems`` make it unrunnable."""

    title: str
    cluster: Cluster
    lines: list[str] = field(default_factory=list)  # placement and engine facts, one line each
    roles: list[RoleMemory] = field(default_factory=list)
    gpus: list[GPUGroup] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def check_memory(self) -> None:
        """Add a problem for each GPU group whose exact memory exceeds a GPU, a warning where the estimate does."""
        capacity = self.cluster.gpu_memory_gib
        if not capacity or self.cluster.total_gpus == 0:
            return
        for group in self.gpus:
            if group.static is not None and group.static > capacity * GiB:
                detail = ", ".join(
                    f"{r.role} {r.static / GiB:.1f}" for r in self.roles if r.role in group.roles and r.static
                )
                self.problems.append(
                    f"{group.label} would hold {group.static / GiB:.1f} GiB before activations ({detail}) on "
                    f"{capacity:g} GiB GPUs"
                )
            elif group.peak is not None and group.peak > capacity * GiB:
                self.warnings.append(
                    f"{group.label}: with the estimated activations {group.peak / GiB:.1f} GiB > {capacity:g} GiB: "
                    "lower the micro batch sizes or enable gradient checkpointing"
                )

    def table(self) -> str:
        def gib(x: float) -> str:
            return f"{x / GiB:7.1f}" if x else "      -"

        out = [f"plan: {self.title}", f"cluster: {self.cluster.describe()}", *self.lines]
        if self.roles:
            out.append(
                f"  {'role':<10} {'setup':<30} {'params':>7} {'weights':>7} {'grads':>7} {'optim':>7} "
                f"{'activ.':>7} {'vLLM':>7}  GiB per GPU"
            )
            for r in self.roles:
                params = f"{r.params / 1e9:6.2f}B" if r.params >= 1e8 else f"{r.params / 1e6:6.2f}M"
                params = params if r.size is not None else "      ?"
                out.append(
                    f"  {r.role:<10} {r.setup[:30]:<30} {params:>7} {gib(r.weights)} {gib(r.grads)} "
                    f"{gib(r.optimizer)} {gib(r.activations)} {gib(r.vllm)}" + (f"  ({r.note})" if r.note else "")
                )
        if self.gpus:
            capacity = self.cluster.gpu_memory_gib
            unit = f"of {capacity:g} GiB" if capacity and self.cluster.total_gpus else "(not checked: no GPU memory)"
            out.append(f"  {'GPUs':<44} {'static':>7} {'peak':>7}  GiB per GPU {unit}")
            for g in self.gpus:
                static, peak = (f"{x / GiB:7.1f}" if x is not None else "      ?" for x in (g.static, g.peak))
                out.append(f"  {g.label[:44]:<44} {static} {peak}  {', '.join(g.roles)}")
        out += [f"warning: {w}" for w in self.warnings]
        out += [f"refused: {p}" for p in self.problems]
        if not self.problems:
            out.append("plan ok")
        return "\n".join(out)

    def refuse_if_unrunnable(self) -> None:
        if self.problems:
            raise PlanError(self.problems[0])
