"""The AlpacaFarm-style simulator (paper 002): gold rewards, simulated annotators, win rates, method comparison.

* :class:`GoldScorer` — the programmatic gold reward of the offline generator's tasks and the toy task: the credit of
  the preferred style's key phrases minus that of competing styles' (partial credit: a phrase's share of its
  distinctive bigrams, graded; repetition earns nothing).
* :class:`AnnotatorPool` — simulated pairwise preferences ``p_sim``: a pool of annotators (gold-scorer variants,
  reward models or LLM judges), one per pair, with 25% flips on training labels; ``relabel`` turns any preference
  dataset into simulated human feedback; ``agreement`` reports inter-annotator and gold agreement.
* :func:`win_rate` — a policy's win rate against a reference on held-out prompts with standard error, length, gold
  reward and KL; :class:`HFPolicy`, :class:`BestOfNPolicy` and :func:`best_of_n`.
* ``rlhf-ext sim compare`` (:mod:`rlhf_ext.sim.compare`) — AlpacaFarm's reference methods and ours, several seeds.

Engine-free: ``import rlhf_ext.sim`` imports only ``torch``; ``transformers`` / ``datasets`` / ``trl`` are imported by
the functions that need them.
"""

from __future__ import annotations

from rlhf_ext.runtime.io import lazy_exports

_EXPORTS = {
    "GoldScorer": "rlhf_ext.sim.gold",
    "TOY_STYLE": "rlhf_ext.sim.gold",
    "toy_rubric": "rlhf_ext.sim.gold",
    "Annotator": "rlhf_ext.sim.annotators",
    "AnnotatorPool": "rlhf_ext.sim.annotators",
    "AnnotatorSpec": "rlhf_ext.sim.annotators",
    "AgreementReport": "rlhf_ext.sim.annotators",
    "BTAnnotator": "rlhf_ext.sim.annotators",
    "DEFAULT_ANNOTATORS": "rlhf_ext.sim.annotators",
    "Decisions": "rlhf_ext.sim.annotators",
    "LLMAnnotator": "rlhf_ext.sim.llm_annotator",
    "PoolConfig": "rlhf_ext.sim.recipe",
    "TRAIN_FLIP_PROB": "rlhf_ext.sim.annotators",
    "BestOfNPolicy": "rlhf_ext.sim.evaluate",
    "HFPolicy": "rlhf_ext.sim.evaluate",
    "WinRate": "rlhf_ext.sim.evaluate",
    "best_of_n": "rlhf_ext.sim.evaluate",
    "win_rate": "rlhf_ext.sim.evaluate",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
