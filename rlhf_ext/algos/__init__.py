"""L0: the papers' equations as pure ``torch`` functions (no IO, no transformers), one module per paper piece.

=====================  ==================================================================================
module                 what it holds (paper, equation)
=====================  ==================================================================================
``segment_reward``     entropy segmentation, segment rewards, soft-max aggregation, segment BT loss (003 Eq. 3-4)
``segment_dense``      dense per-token rewards and interpolation (003 Tables 1/3)
``location_norm``      location-aware reward normalizer (003 Eq. 6)
``ppo``                KL estimators, GAE / reward-to-go / whitening, value loss, advantage estimators
``pair_selection``     best/worst-of-n pair selection (004 Eq. 9)
``importance``         truncated importance weights for off-policy samples (001)
``continual_kl``       KL to the previous task's policy (000 Eq. 7)
``cppo_weights``       CPPO learning / retention sample weights (000, after CPPO)
``forgetting``         backward transfer, forgetting, average performance (000 App. C.3)
=====================  ==================================================================================

See ``PAPERS.md`` for the paper ids and the equation -> function table.
"""
