"""The iteration loop of paper 004's Algorithm 2, written once, engine-free: it calls the steps of an
:class:`IterationSteps` object (the TRL adapter :class:`rlhf_ext.trl.IterativeDPOTrainer` is one; its ``train()`` runs
this loop, and so does every pipeline through it).
"""

from __future__ import annotations

from typing import Any, Protocol


class IterationSteps(Protocol):
    """The steps :func:`run_iterations` calls (see :class:`rlhf_ext.trl.IterativeDPOTrainer` for their contracts)."""

    args: Any

    def open_run(self) -> Any: ...
    def should_collect(self, t: int) -> bool: ...
    def iteration_prompts(self, t: int) -> tuple[list[Any], list[int]]: ...
    def sample_responses(self, t: int, prompts: list[Any]) -> Any: ...
    def score_responses(self, prompts: list[Any], samples: Any) -> Any: ...
    def select_pairs(self, t: int, prompts: list[Any], ids: list[int], samples: Any, rewards: Any) -> Any: ...
    def store_pairs(self, t: int, rows: list[dict[str, Any]], stats: dict[str, Any]) -> None: ...
    def pairs_summary(self, t: int) -> dict[str, Any]: ...
    def train_iteration(self, t: int) -> str: ...
    def evaluate_policy(self, t: int) -> dict[str, Any]: ...
    def log_iteration(self, t: int, pairs: dict[str, Any], evaluation: dict[str, Any]) -> dict[str, Any]: ...
    def summarize_iterations(self, evaluations: list[dict[str, Any]], iterations: list[dict[str, Any]]) -> Any: ...


def run_iterations(trainer: IterationSteps) -> dict[str, Any]:
    """Paper 004's Algorithm 2, iterative best/worst-of-n online DPO, on ``trainer`` (the TRL adapter
    :class:`~rlhf_ext.trl.IterativeDPOTrainer` with ``online_mode="iterative"``, whose ``train()`` calls this);
    returns the run's summary.

    ``pi_0`` is the SFT model; it is evaluated first. Then, for each iteration ``t = 0 .. num_iterations - 1``:

    1. take the iteration's ``m = prompts_per_iteration`` prompts (paper: 20k; one fixed shuffle, consecutive
       slices);
    2. sample ``n = num_samples`` responses per prompt from ``pi_t``, split across the two temperatures
       (paper: 8 or 16 at 0.7 and 1.0, no top-p / top-k);
    3. score every response with the reward ``r``;
    4. select one pair per prompt: the best vs the worst response under ``r_e(x, a) = r(x, a) - lambda * |a|``
       (paper 004 Eq. 9, ``|a|`` in characters), dropping prompts whose responses tie;
    5. store the iteration's pairs atomically: they exist complete or not at all, so steps 2-5 run exactly once
       per iteration and a resumed run skips them;
    6. train DPO from ``pi_t`` on the accumulated pairs of iterations ``0..t`` (paper: "historical + new") with the
       SFT model ``pi_0`` as reference (paper: 2 epochs, cosine, lr 5e-7, warm-up 0.03, global batch 128,
       beta 0.1) -> ``pi_{t+1}``, resumed from its last checkpoint if it was interrupted; an iteration without
       pairs keeps ``pi_{t+1} = pi_t``;
    7. evaluate ``pi_{t+1}``: the reward of its samples on the held-out prompts (and the gold score if any),
       logged through the trainer's loggers with the iteration's pair statistics.

    Every step's result is on disk before the next starts (pairs, ``state.json``, ``eval/``), so rerunning a killed
    run resumes at the last finished step and produces the same pairs and weights.
    """
    args = trainer.args
    if args.online_mode != "iterative":
        raise ValueError("run_iterations runs online_mode='iterative'; per-batch online DPO is trainer.train()")
    trainer.open_run()  # run.json: refuses an output_dir started with other settings
    evaluations = [trainer.evaluate_policy(0)]
    iterations = [run_iteration(trainer, t) for t in range(args.num_iterations)]
    evaluations += [it["eval"] for it in iterations]
    return trainer.summarize_iterations(evaluations, iterations)


def run_iteration(trainer: IterationSteps, t: int) -> dict[str, Any]:
    """Iteration ``t`` of :func:`run_iterations` (steps 1-7); returns the record :meth:`log_iteration` made of it
    (``pairs``, ``eval`` of ``pi_{t+1}``)."""
    if trainer.should_collect(t):  # the main process, when iteration t's pairs are not stored yet
        prompts, ids = trainer.iteration_prompts(t)  # 1. take prompts
        samples = trainer.sample_responses(t, prompts)  # 2. n responses from pi_t at the temperatures
        rewards = trainer.score_responses(prompts, samples)  # 3. score with the reward
        rows, stats = trainer.select_pairs(t, prompts, ids, samples, rewards)  # 4. best vs worst (Eq. 9)
        trainer.store_pairs(t, rows, stats)  # 5. store the iteration's pairs atomically
    pairs = trainer.pairs_summary(t)
    trainer.train_iteration(t)  # 6. DPO on the accumulated pairs, SFT reference -> pi_{t+1}
    evaluation = trainer.evaluate_policy(t + 1)  # 7. evaluate pi_{t+1}
    return trainer.log_iteration(t, pairs, evaluation)
