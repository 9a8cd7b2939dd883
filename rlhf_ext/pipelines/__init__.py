"""L3: the only place that picks an engine. A recipe in, a finished run out.

``segment_rm`` and ``segment_ppo`` (paper 003, TRL or OpenRLHF), ``iterative_dpo`` (paper 004's Algorithm 2 on TRL,
with paper 001's one-step async option), ``continual`` + ``continual_stages`` (paper 000 task sequences), ``builtins``
(explicit builds of the trained ``builtin:`` models), ``reports`` and ``trl_runs`` (the simulator's and the demo's
small TRL runs).
"""
