"""The reward server (``rlhf-ext serve rm``): a segment reward model's e_phi over HTTP in OpenRLHF's remote-reward
protocol, on uvicorn (``pip install "rlhf-ext[serve]"``).

:mod:`~rlhf_ext.serve.protocol` (requests, answers, refusals), :mod:`~rlhf_ext.serve.settings` (knobs, listening
socket), :mod:`~rlhf_ext.serve.batching` (tokenised pairs, batched scoring), :mod:`~rlhf_ext.serve.server` (the HTTP
server). Nothing heavy is imported until a server is built.
"""
