"""The iteration loop of paper 004's Algorithm 2, engine-free: :func:`run_iterations` calls the steps of an
:class:`IterationSteps` object, :class:`IterationRun`, which does everything but the DPO run. The TRL adapter
:class:`rlhf_ext.trl.IterativeDPOTrainer` holds one (``iteration_steps``) and is its :class:`IterationEngine`."""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from rlhf_ext.runtime.async_runner import torch_threads
from rlhf_ext.runtime.io import atomic_write_json, recover_directory, stable_hash
from rlhf_ext.runtime.pair_collection import score_and_select
from rlhf_ext.runtime.pair_store import PairStore
from rlhf_ext.runtime.rewards import RewardFn, score
from rlhf_ext.runtime.rundir import RunDir
from rlhf_ext.runtime.sampling import Samples, make_sampler, sampling_seed

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
STATE_FILE = "state.json"
RUN_KIND = "iterative-dpo"
#: Where every policy of a run is saved (``policy_000`` ... and ``online_final``). ``Trainer.push_to_hub`` uploads
#: ``output_dir`` without ``_*``, so only the final policy (``IterativeDPOTrainer.save_model``) goes to the hub.
POLICIES_DIR = "_policies"


class IterationSteps(Protocol):
    """The steps :func:`run_iterations` calls (see :class:`IterationRun` for their contracts)."""

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
    """Paper 004's Algorithm 2, iterative best/worst-of-n online DPO, on ``trainer``'s steps (an
    :class:`IterationSteps`, or a trainer holding one as ``iteration_steps``); returns the run's summary.

    ``pi_0`` is the SFT model; it is evaluated first. Then, for each iteration ``t = 0 .. num_iterations - 1``:

    1. take the iteration's ``m = prompts_per_iteration`` prompts (paper: 20k; one fixed shuffle, consecutive slices);
    2. sample ``n = num_generations`` responses per prompt from ``pi_t`` at the temperatures (paper: 8 or 16 at 0.7
       and 1.0, no top-p / top-k);
    3. score every response with the reward ``r``;
    4. select one pair per prompt: best vs worst under ``r_e(x, a) = r(x, a) - lambda * |a|`` (paper 004 Eq. 9,
       ``|a|`` in characters), dropping prompts whose responses tie;
    5. store the pairs atomically, so steps 2-5 run exactly once per iteration;
    6. train DPO from ``pi_t`` on the pairs of iterations ``0..t`` (paper: "historical + new") with ``pi_0`` as
       reference (paper: 2 epochs, cosine, lr 5e-7, warm-up 0.03, global batch 128, beta 0.1) -> ``pi_{t+1}``; an
       iteration without pairs keeps ``pi_{t+1} = pi_t``;
    7. evaluate ``pi_{t+1}`` on the held-out prompts (reward, and gold score if any) and log it with the pairs' stats.

    Every step's result is on disk before the next starts, so rerunning a killed run resumes at the last finished
    step and produces the same pairs and weights.
    """
    trainer = getattr(trainer, "iteration_steps", trainer)  # the TRL adapter holds its steps (an IterationRun)
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
    (``pairs``, ``eval`` of ``pi_{t+1}``). ``trainer``: the steps, or a trainer holding them as ``iteration_steps``."""
    trainer = getattr(trainer, "iteration_steps", trainer)
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


class IterationEngine(Protocol):
    """What :class:`IterationRun` needs from the training engine (the TRL adapter
    :class:`rlhf_ext.trl.IterativeDPOTrainer` is one)."""

    def train_policy(self, start: str, ref_path: str, rows: list[dict[str, Any]], work: Path, seed: int,
                     dest: Path) -> None: ...  # fmt: skip
    def log(self, logs: dict[str, Any]) -> None: ...


class IterationRun:
    """The engine-free part of an online DPO run in ``args.output_dir`` (``run.json``, ``state.json``, ``pairs/``,
    ``eval/``): :func:`run_iterations`'s :class:`IterationSteps`; the DPO run of step 6 and the logger are the
    ``engine``'s (an :class:`IterationEngine`).

    Args:
        args: the run's ``IterativeDPOConfig``.
        sft_path, ref_path: checkpoints of ``pi_0`` and of the SFT reference.
        reward_fn, gold_fn: ``(prompts, responses) -> scores``; ``gold_fn`` is reported at evaluation only.
        dist: the process group (``accelerate.PartialState``).
    """

    def __init__(self, args, prompts: list[Any], eval_prompts: list[Any], sft_path: str, ref_path: str, tokenizer,
                 reward_fn: RewardFn, gold_fn: RewardFn | None, dist, engine: IterationEngine):  # fmt: skip
        self.args, self.prompts, self.eval_prompts = args, prompts, eval_prompts
        self.sft_path, self.ref_path, self.tokenizer = sft_path, ref_path, tokenizer
        self.reward_fn, self.gold_fn, self.dist, self.engine = reward_fn, gold_fn, dist, engine
        self.root = Path(args.output_dir)
        self.store = PairStore(self.root / "pairs")
        self._sampler = None

    # ------------------------------------------------------------------------------------------ run directory
    def open_run(self) -> RunDir:
        """Check ``output_dir`` against this run's settings (``run.json``) before any step writes to it: a
        ``FileExistsError`` for a run there without ``args.resume``, ``RunSettingsChanged`` for other settings."""
        settings = {**self.args.settings(), "sft": self.sft_path, "prompts": stable_hash(self.prompts)}
        run_file = self.root / RUN_FILE
        old = json.loads(run_file.read_text()) if run_file.exists() else None
        if old is not None and not self.args.resume:
            raise FileExistsError(
                f"{self.root} already holds a run; delete it, choose another output_dir, or set resume=True"
            )
        # a run.json from before RunDir: {"settings", "sft", "prompts"}; the same run is taken over, not refused
        legacy = {"settings": self.args.settings(), "sft": self.sft_path, "prompts": settings["prompts"]}
        legacy = old is not None and "fingerprint" not in old and old == json.loads(json.dumps(legacy))
        run = None
        names = self.args.recorded_names
        if self.dist.is_main_process:
            run = RunDir(self.root, settings, kind=RUN_KIND, force=legacy, recorded_names=names)
        elif old is not None and not legacy:  # read-only here: the same run, or the same error
            run = RunDir(self.root, settings, kind=RUN_KIND, recorded_names=names)
        self.dist.wait_for_everyone()
        return run or RunDir(self.root, settings, kind=RUN_KIND, recorded_names=names)

    def read_state(self) -> dict[str, Any]:
        """``state.json``: the checkpoint of every policy so far (``policies``) and the iterations without pairs."""
        path = self.root / STATE_FILE
        return json.loads(path.read_text()) if path.exists() else {"policies": {"0": self.sft_path}, "skipped": []}

    def write_state(self, state: dict[str, Any]) -> None:
        if self.dist.is_main_process:
            atomic_write_json(self.root / STATE_FILE, state)
        self.dist.wait_for_everyone()

    def policy_path(self, t: int) -> str | None:
        """Checkpoint of ``pi_t`` (``pi_0`` = SFT), or None if it does not exist yet."""
        return self.read_state()["policies"].get(str(t))

    def seed(self, *parts: Any) -> int:
        """The run's seed for ``parts`` (e.g. ``("collect", t)``)."""
        return sampling_seed(self.args.seed, *parts)

    def sampler_spec(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~rlhf_ext.runtime.sampling.make_sampler` for this run."""
        a = self.args
        return dict(
            backend=a.generation_backend,
            policy=self.sft_path,
            tokenizer=self.tokenizer,
            max_new_tokens=a.max_completion_length,
            temperatures=a.temperatures,
            batch_size=a.generation_batch_size,
            max_prompt_length=a.max_prompt_length,
            top_p=a.top_p,
            top_k=a.top_k,
            vllm_kwargs={"gpu_memory_utilization": a.vllm_gpu_memory_utilization, **(a.vllm_kwargs or {})},
        )

    def sampler(self):
        if self._sampler is None:
            self._sampler = make_sampler(**self.sampler_spec())
        return self._sampler

    # ---------------------------------------------------------------------------- Algorithm 2, one iteration
    def iteration_prompts(self, t: int) -> tuple[list[Any], list[int]]:
        """Step 1: (prompts, their indices in the prompt set) of iteration ``t``: a fixed shuffled order,
        consecutive slices of ``prompts_per_iteration`` (default ``len(prompts) // num_iterations``), wrapping."""
        total = len(self.prompts)
        m = self.args.prompts_per_iteration or max(1, total // self.args.num_iterations)
        order = torch.randperm(total, generator=torch.Generator().manual_seed(self.seed("order")))
        positions = (t * m + torch.arange(m)) % total
        ids = order[positions].tolist()
        return [self.prompts[i] for i in ids], ids

    def should_collect(self, t: int) -> bool:
        """Whether this process collects iteration ``t``'s pairs: the main process, once per run (a write of them
        that a kill interrupted is finished or cleaned up first)."""
        if not self.dist.is_main_process:
            return False
        recover_directory(self.store.path(t))
        return not self.store.has(t)

    def sample_responses(self, t: int, prompts: list[Any]) -> Samples:
        """Step 2: ``num_generations`` responses per prompt from ``pi_t``, split evenly across ``temperatures``."""
        return self._sample(self.policy_path(t), prompts, self.args.num_generations, None, self.seed("collect", t))

    def _sample(self, path: str, prompts: list[Any], n: int, temperatures: list[float] | None, seed: int) -> Samples:
        """``n`` responses per prompt from the checkpoint at ``path`` at ``temperatures`` (None: the run's)."""
        sampler = self.sampler()
        sampler.load_policy(path)
        with torch_threads(self.args.generation_threads):
            samples = sampler.sample(prompts, n, temperatures=temperatures, seed=seed)
        sampler.release()
        return samples

    def score_responses(self, prompts: list[Any], samples: Samples) -> torch.Tensor:
        """Step 3: the reward of every response, ``[len(prompts), num_generations]``."""
        n = len(samples.temperatures)
        flat_prompts = [p for p in prompts for _ in range(n)]
        return score(self.reward_fn, flat_prompts, samples.flat()).view(len(prompts), n)

    def select_pairs(
        self, t: int, prompts: list[Any], ids: list[int], samples: Samples, rewards: torch.Tensor
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Step 4: one pair per prompt, best vs worst of ``r - lambda * |a|`` (Eq. 9, ``selection_rule``); prompts
        whose responses tie are dropped. Returns the pair rows and the iteration's statistics."""
        scores = lambda prompts, responses: rewards.flatten()  # the scores of step 3
        generator = torch.Generator().manual_seed(self.seed("select", t))
        # self.args: the selection knobs (OnlineDPOKnobs)
        rows, stats = score_and_select(prompts, ids, samples, scores, self.args, generator)
        for r in rows:
            r.update(iteration=t, policy=t)
        return rows, {**stats, "policy": self.policy_path(t)}

    def store_pairs(self, t: int, rows: list[dict[str, Any]], stats: dict[str, Any]) -> None:
        """Step 5: write iteration ``t``'s pairs to ``output_dir/pairs/iter_{t}`` (atomically, exactly once)."""
        if not rows:
            warnings.warn(
                f"iteration {t}: every prompt's {self.args.num_generations} responses tied under the "
                "reward (equal scores or identical text), so no preference pairs were collected",
                stacklevel=2,
            )
        self.store.write(t, rows, stats)
        logger.info("iteration %d: %d pairs (%d prompts dropped)", t, len(rows), stats["dropped"])

    def pairs_summary(self, t: int) -> dict[str, Any]:
        """What iteration ``t``'s collection measured (waits for the main process to store it)."""
        self.dist.wait_for_everyone()
        return self.store.summary(t)

    def train_iteration(self, t: int) -> str:
        """Step 6: DPO from ``pi_t`` on the stored pairs (``pair_data``) against the reference -> ``pi_{t+1}`` (the
        engine's :meth:`~IterationEngine.train_policy`); returns its path. ``pi_{t+1}`` is saved atomically before
        ``state.json`` records it; a rerun records a complete one instead of training it again."""
        state = self.read_state()
        if str(t + 1) in state["policies"]:
            return state["policies"][str(t + 1)]
        start = state["policies"][str(t)]
        rows = self.store.training_pairs(t, self.args.pair_data)
        if not rows:
            msg = f"iteration {t}: no preference pairs to train on; skipping DPO (policy {t + 1} = policy {t})"
            warnings.warn(msg, stacklevel=2)
            state["policies"][str(t + 1)] = start
            state["skipped"].append(t)
            self.write_state(state)
            return start
        work = self.root / "iterations" / f"iter_{t:03d}"
        dest = self.root / POLICIES_DIR / f"policy_{t + 1:03d}"
        if self.dist.is_main_process:
            recover_directory(dest)  # a save of pi_{t+1} that a kill interrupted: finished or cleaned up
        self.dist.wait_for_everyone()
        if not dest.is_dir():  # (else: saved by a run killed before state.json recorded it)
            ref_path = self.ref_path if self.args.reference == "sft" else start
            self.engine.train_policy(start, ref_path, rows, work, self.args.seed + t, dest)
        if self.dist.is_main_process:
            for ckpt in work.glob("checkpoint-*"):
                shutil.rmtree(ckpt, ignore_errors=True)
        state["policies"][str(t + 1)] = str(dest)
        self.write_state(state)
        return str(dest)

    def evaluate_policy(self, t: int) -> dict[str, Any]:
        """Step 7: mean reward (and ``gold_fn``) of ``pi_t``'s samples on the evaluation prompts (cached on disk)."""
        return self.evaluate_checkpoint(self.policy_path(t), f"policy_{t:03d}", {"policy": t})

    def evaluate_checkpoint(self, path: str, name: str, extra: dict[str, Any]) -> dict[str, Any]:
        """Sample ``eval_samples_per_prompt`` responses per evaluation prompt from the checkpoint at ``path`` and
        score them; written to ``output_dir/eval/{name}.json``. Every policy is evaluated on the same prompts with
        the same sampling seed (common random numbers), so differences between policies are not prompt noise."""
        out = self.root / "eval" / f"{name}.json"
        if not out.exists() and self.dist.is_main_process:
            n = self.args.eval_samples_per_prompt
            samples = self._sample(path, self.eval_prompts, n, [self.args.eval_temperature], self.seed("eval"))
            flat_prompts = [p for p in self.eval_prompts for _ in range(n)]
            rewards = score(self.reward_fn, flat_prompts, samples.flat())
            metrics = {
                **extra,
                "path": str(path),
                "num_responses": int(rewards.numel()),
                "mean_reward": float(rewards.mean()),
                "std_reward": float(rewards.std()) if rewards.numel() > 1 else 0.0,
                "mean_length_chars": float(samples.num_chars().mean()),
                "mean_length_tokens": float(samples.num_tokens.float().mean()),
                "truncated_fraction": float(samples.truncated.float().mean()),
            }
            if self.gold_fn is not None:
                metrics["mean_gold"] = float(score(self.gold_fn, flat_prompts, samples.flat()).mean())
            atomic_write_json(out, metrics)
        self.dist.wait_for_everyone()
        return json.loads(out.read_text())

    # -------------------------------------------------------------------------------------------- reporting
    def log_iteration(self, t: int, pairs: dict[str, Any], evaluation: dict[str, Any]) -> dict[str, Any]:
        """Log iteration ``t``'s pairs and the evaluation of ``pi_{t+1}`` through the engine's loggers; returns
        the summary's record of the iteration."""
        logs = {"iteration": t, **{f"pairs/{k}": pairs[k] for k in ("num_pairs", "dropped", "mean_reward")}}
        self.engine.log({**logs, **eval_logs(evaluation)})
        return {"iteration": t, "pairs": pairs, "eval": evaluation}

    def summarize_iterations(self, evals: list[dict[str, Any]], iterations: list[dict[str, Any]]) -> dict[str, Any]:
        """The per-iteration run's summary, written to ``output_dir/summary.json``."""
        state = self.read_state()
        summary = {
            "mode": "iterative",
            "output_dir": str(self.root),
            "final_policy": state["policies"][str(self.args.num_iterations)],
            "skipped_iterations": state["skipped"],
            "eval": evals,
            "iterations": iterations,
        }
        if self.dist.is_main_process:
            atomic_write_json(self.root / "summary.json", summary)
        return summary

    # ----------------------------------------------------------------------------------------------- per-batch
    def record_online_batch(self, index: int, version: int, batch_rows: list[dict[str, Any]],
                            generate_seconds: float, cursors: list[int]) -> None:  # fmt: skip
        """Write the pairs of the batch that trains update ``index`` (generated by policy ``version``) to the store,
        with every process's prompt cursor after it (``prompt_cursors``, one per rank: where a resumed run
        continues)."""
        rows = [{**r, "update": index, "policy_version": version} for r in batch_rows]
        if self.dist.is_main_process:
            stats = {"policy_version": version, "generate_seconds": generate_seconds, "prompt_cursors": cursors}
            self.store.write(index, rows, stats)

    def resume_cursor(self, offset: int) -> int:
        """This process's prompt cursor after update ``offset - 1`` (0 at the start of a run), from the stored
        batch of that update."""
        if offset == 0:
            return 0
        cursors = self.store.summary(offset - 1).get("prompt_cursors")
        if cursors is None or len(cursors) != self.dist.num_processes:
            raise ValueError(
                f"{self.store.path(offset - 1)} holds no prompt cursor for {self.dist.num_processes} process(es) "
                "(written by an older rlhf-ext or another number of processes), so the run cannot resume from "
                f"checkpoint-{offset} with the uninterrupted run's prompts; start it again in a new output_dir"
            )
        return int(cursors[self.dist.process_index])


def eval_logs(evaluation: dict[str, Any]) -> dict[str, float]:
    """The logged metrics of an evaluation (:meth:`IterationRun.evaluate_checkpoint`)."""
    keys = ("mean_reward", "mean_gold", "mean_length_chars", "truncated_fraction")
    return {f"policy_eval/{k}": evaluation[k] for k in keys if k in evaluation}
