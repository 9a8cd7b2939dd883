"""L1: engine-free machinery (may use transformers / datasets, never trl / openrlhf).

``io`` (atomic writes, locks, hashing), ``rundir`` (one resumable run directory), ``async_runner`` (paper 001's
one-step asynchronous runner), ``sampling`` (HF / vLLM samplers), ``rewards`` (reward functions from checkpoints),
``pair_collection`` (score and select pairs, paper 004), ``pair_store``, ``segment_data`` (segment RM data prep),
``token_scores`` (per-token reward capture), ``calibration`` (fit / save / load the location normalizer).
"""
