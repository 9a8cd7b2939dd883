"""L0: the papers' equations as pure ``torch`` functions (no IO, no transformers), one module per paper piece.

=====================  ==================================================================================
module                 what it holds (paper, equation)
=====================  ==================================================================================
``segment_reward``     entropy segmentation, segment rewards, soft-max aggregation, segment BT loss (paper 003 Eq. 3-4)
``segment_dense``      dense per-token rewards and interpolation (paper 003 Tables 1/3)
``location_norm``      location-aware reward normalizer (paper 003 Eq. 6)
``ppo``                the one KL function ``kl_estimate`` (k1/k2/k3/exact), GAE / reward-to-go / whitening,
                       value loss, advantage-estimator registry; per-token PPO reward (paper 003 Eq. 5)
``pair_selection``     best/worst-of-n pair selection (paper 004 Eq. 9)
``importance``         truncated importance weights for off-policy samples (paper 001)
``continual_kl``       KL to the previous task's policy (paper 000 Eq. 7)
``cppo_weights``       CPPO learning / retention sample weights (paper 000, after CPPO)
``forgetting``         backward transfer, forgetting, average performance (paper 000 App. C.3)
``names``              ``StrEnum``, the base of every option enum (``Granularity.BANDIT == "bandit"``)
=====================  ==================================================================================

See ``PAPERS.md`` for the paper ids and the equation -> function table.
"""
