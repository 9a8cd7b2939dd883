"""Adapters for OpenRLHF 0.11.2: subclasses of OpenRLHF's losses and trainers that call rlhf-ext's tensor functions.

Importing a submodule imports ``openrlhf`` (and DeepSpeed / Ray); ``import rlhf_ext`` alone does not.
"""
