"""The AlpacaFarm-style simulator (paper 002): gold rewards (:class:`GoldScorer`), simulated pairwise preferences
``p_sim`` (:class:`AnnotatorPool`: ``relabel`` a preference dataset, ``agreement``), win rates against a reference
(:func:`win_rate`, :class:`HFPolicy`, :class:`BestOfNPolicy`, :func:`best_of_n`) and ``rlhf-ext sim compare``
(:mod:`rlhf_ext.sim.compare`: AlpacaFarm's reference methods and ours, several seeds).

Engine-free: ``import rlhf_ext.sim`` imports only ``torch``; the functions import ``transformers`` / ``datasets`` /
``trl`` when they need them.
"""

from __future__ import annotations

from rlhf_ext.runtime.io import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["GoldScorer", "TOY_STYLE", "toy_rubric"], "rlhf_ext.sim.gold"),
    **dict.fromkeys(
        [
            "Annotator",
            "AnnotatorPool",
            "AnnotatorSpec",
            "AgreementReport",
            "BTAnnotator",
            "DEFAULT_ANNOTATORS",
            "Decisions",
            "TRAIN_FLIP_PROB",
        ],
        "rlhf_ext.sim.annotators",
    ),
    "LLMAnnotator": "rlhf_ext.sim.llm_annotator",
    "PoolConfig": "rlhf_ext.sim.recipe",
    **dict.fromkeys(["BestOfNPolicy", "HFPolicy", "WinRate", "best_of_n", "win_rate"], "rlhf_ext.sim.evaluate"),
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
