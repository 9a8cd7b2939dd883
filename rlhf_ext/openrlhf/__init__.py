"""Adapters for OpenRLHF 0.11.2 (pinned: they subclass parts of its private layout).

Import the submodules you need (``rlhf_ext.openrlhf.segment_rm`` ...); importing them imports OpenRLHF, DeepSpeed and
transformers. :mod:`rlhf_ext.openrlhf.compat` makes that work on a CPU-only machine.
"""
