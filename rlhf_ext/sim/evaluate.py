"""Automatic evaluation in the simulator: win rate against a reference policy (paper 002, section 3.3).

:func:`win_rate`: the expected fraction of held-out instructions on which ``p_eval`` (the pool without training noise)
prefers the policy's output over the reference's, with response length (section 5.2), gold reward and KL alongside.
Draws count half a win, as AlpacaEval's 1.5: ``win_rate = (wins + ties / 2) / comparisons``; its standard error is
that of the outcomes ``{1, 1/2, 0}``, clustered by prompt with ``k`` samples per prompt.

Policies (:class:`HFPolicy`, :class:`BestOfNPolicy`) have ``sample(prompts, n, seed) -> Samples`` (``[P][n]``) and,
for the KL, ``logprobs(prompts, responses, truncated) -> [N]``.

KL (``kl_estimator``): ``sequence_log_ratio``, ``KL(pi || pi_ref) ~= mean_i [log pi(y_i | x_i) - log pi_ref(y_i |
x_i)]`` over the policy's samples (unbiased, can be negative), or ``exact``, ``mean_i sum_t KL(pi(.|x_i, y_i<t) ||
pi_ref(.|x_i, y_i<t))`` (same expectation, never negative, lower variance; needs one vocabulary). Responses are
re-tokenised as the trainers do (EOS appended unless cut at ``max_new_tokens``); logits are divided by the sampling
temperature. Best-of-n's KL is the analytic ``log n - (n - 1) / n`` (an upper bound, exact without reward ties).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from rlhf_ext.runtime.rewards import RewardFn, score
from rlhf_ext.runtime.sampling import Samples, encode_prompts
from rlhf_ext.sim.annotators import AnnotatorPool
from rlhf_ext.sim.gold import GoldScorer

#: AlpacaFarm samples evaluation outputs at temperature 0.7 for API models (Appendix A); we default to 1.0 so that
#: the KL estimate is of the policy itself. Both are recipe values.
DEFAULT_EVAL_TEMPERATURE = 1.0


class HFPolicy:
    """A transformers causal LM as a simulator policy: ``model`` a checkpoint path (``builtin:`` names resolved) or an
    instance (with ``tokenizer``); ``prompt_prefix`` goes before every prompt when sampling and scoring; no top-k."""

    kl_method = "sequence_log_ratio"

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        prompt_prefix: str = "",
        max_new_tokens: int = 128,
        temperature: float = DEFAULT_EVAL_TEMPERATURE,
        top_p: float = 1.0,
        batch_size: int = 64,
        logprob_batch_size: int = 16,
        max_prompt_length: int | None = None,
        device: str | torch.device = "cpu",
        name: str | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if temperature <= 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be a positive number, got {temperature}")
        if isinstance(model, str | Path):
            from rlhf_ext.pipelines.builtins import resolve_model

            path = resolve_model(str(model))
            if not (Path(path) / "config.json").exists():
                raise FileNotFoundError(f"policy {model!r} is not a checkpoint directory (no config.json in {path})")
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            name = name or str(model.config._name_or_path)
        elif tokenizer is None:
            raise ValueError("pass tokenizer= when the policy is an instantiated model")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.prompt_prefix = prompt_prefix
        self.temperature = float(temperature)
        self.max_new_tokens = max_new_tokens
        self.max_prompt_length = max_prompt_length
        self.logprob_batch_size = logprob_batch_size
        self.device = torch.device(device)
        self.name = name or type(model).__name__
        self._sampler = None
        self._sampler_args = dict(
            max_new_tokens=max_new_tokens,
            temperatures=[self.temperature],
            batch_size=batch_size,
            max_prompt_length=max_prompt_length,
            top_p=top_p,
            top_k=0,
            device=device,
        )

    def __repr__(self) -> str:
        return f"HFPolicy({self.name!r}, temperature={self.temperature}, prefix={self.prompt_prefix!r})"

    def _prompts(self, prompts: Sequence[Any]) -> list[Any]:
        if not self.prompt_prefix:
            return list(prompts)
        if any(not isinstance(p, str) for p in prompts):
            raise ValueError("prompt_prefix works with text prompts only (the prompts are chat messages)")
        return [self.prompt_prefix + p for p in prompts]

    def sample(self, prompts: Sequence[Any], n: int, seed: int) -> Samples:
        """``n`` responses per prompt (``[P][n]``), reproducible for a given ``seed``."""
        from rlhf_ext.runtime.sampling import HFSampler

        if self._sampler is None:
            self._sampler = HFSampler(self.model, self.tokenizer, **self._sampler_args)
        return self._sampler.sample(self._prompts(prompts), n, seed=seed)

    def _batches(self, prompts: Sequence[Any], responses: Sequence[str], truncated: Sequence[bool] | Tensor):
        """``(ids [b, L], attention [b, L], response [b, L-1])`` per chunk: prompt + response re-tokenised the way
        the trainers tokenise them (EOS appended unless ``truncated``); ``response[:, t]`` marks the logits at
        ``t`` that predict a response token ``t + 1``."""
        from rlhf_ext.runtime.segment_data import pad_sequences

        tok = self.tokenizer
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        truncated = torch.as_tensor(truncated, dtype=torch.bool).flatten().tolist()
        prompt_ids = encode_prompts(tok, self._prompts(prompts), self.max_prompt_length)
        seqs, starts = [], []
        for p_ids, text, cut in zip(prompt_ids, responses, truncated):
            r_ids = tok(text, add_special_tokens=False)["input_ids"] if text else []
            if not cut and eos is not None:
                r_ids = r_ids + [eos]
            seqs.append(p_ids + r_ids)
            starts.append(len(p_ids))
        for lo in range(0, len(seqs), self.logprob_batch_size):
            chunk = seqs[lo : lo + self.logprob_batch_size]
            ids = pad_sequences(chunk, pad, "right", torch.long).to(self.device)
            lengths = torch.tensor([len(s) for s in chunk], device=self.device)
            pos = torch.arange(ids.shape[1], device=self.device).unsqueeze(0)
            target = pos[:, 1:]  # logits at t predict token t + 1
            first = torch.tensor(starts[lo : lo + self.logprob_batch_size], device=self.device).unsqueeze(1)
            yield ids, (pos < lengths.unsqueeze(1)).long(), (target >= first) & (target < lengths.unsqueeze(1))

    def _log_softmax(self, ids: Tensor, attention: Tensor) -> Tensor:
        """``[b, L-1, V]`` float32 log-probabilities of the next token at the sampling temperature."""
        logits = self.model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
        return torch.log_softmax(logits / self.temperature, dim=-1)

    @torch.no_grad()
    def logprobs(self, prompts: Sequence[Any], responses: Sequence[str], truncated: Sequence[bool] | Tensor) -> Tensor:
        """``[N]`` float32 ``log pi(y | x)`` summed over response tokens (EOS included unless ``truncated``), with
        logits divided by the policy's sampling temperature."""
        out = []
        for ids, attention, response in self._batches(prompts, responses, truncated):
            logp = self._log_softmax(ids, attention).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            out.append(torch.where(response, logp, 0.0).sum(1).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def token_kl(
        self, reference: HFPolicy, prompts: Sequence[Any], responses: Sequence[str], truncated: Sequence[bool] | Tensor
    ) -> Tensor:
        """``[N]`` float32 ``sum_t KL(pi(.|x, y_<t) || pi_ref(.|x, y_<t))`` over each response's positions
        (:func:`rlhf_ext.algos.ppo.kl_estimate`'s ``exact``, at the sampling temperatures): for ``y ~ pi`` its mean is
        ``KL(pi || pi_ref)`` (chain rule), never negative. Both policies share vocabulary and prompt prefix."""
        from rlhf_ext.algos.ppo import kl_estimate

        if (
            reference.tokenizer.get_vocab() != self.tokenizer.get_vocab()
            or reference.prompt_prefix != self.prompt_prefix
        ):
            raise ValueError("the exact KL needs two policies with the same tokenizer vocabulary and prompt prefix")
        out = []
        for ids, attention, response in self._batches(prompts, responses, truncated):
            mine, theirs = self._log_softmax(ids, attention), reference._log_softmax(ids, attention)
            out.append(torch.where(response, kl_estimate(None, None, "exact", mine, theirs), 0.0).sum(1).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def segmentation(
        self, prompts: Sequence[Any], responses: Sequence[str], truncated: Sequence[bool] | Tensor, cutoff: float
    ) -> dict[str, float]:
        """How this model's entropies segment ``responses`` at ``cutoff`` (paper 003, at the sampling temperature):
        mean ``segments_per_response``, ``tokens_per_response`` and ``above_cutoff_share`` (share of response tokens
        whose entropy exceeds the cutoff; with the SFT model on a policy's samples: the reward-hacking monitor)."""
        from rlhf_ext.algos.segment_reward import segment_boundaries, segment_ids

        segments, tokens, above = 0, 0, 0
        for ids, attention, response in self._batches(prompts, responses, truncated):
            logp = self._log_softmax(ids, attention)
            entropy = -(logp.exp() * logp).sum(-1)
            segments += int(segment_ids(segment_boundaries(entropy, response, cutoff), response).counts.sum())
            tokens += int(response.sum())
            above += int((response & (entropy > cutoff)).sum())
        n = max(len(responses), 1)
        return {
            "segments_per_response": segments / n,
            "tokens_per_response": tokens / n,
            "above_cutoff_share": above / max(tokens, 1),
        }


class BestOfNPolicy:
    """Inference-time best-of-n (paper 002, section 3.4): each response is the highest-scoring of ``n`` samples of
    ``base`` under ``scorer`` (``(prompts, responses) -> [N]``, e.g. a surrogate reward model or the gold scorer).
    Ties go to the first of the tied samples."""

    kl_method = "analytic_best_of_n"

    def __init__(self, base: HFPolicy, scorer: RewardFn, n: int):
        if n < 1:
            raise ValueError(f"best-of-n needs n >= 1, got {n}")
        self.base, self.scorer, self.n = base, scorer, int(n)
        self.name = f"best-of-{n}({base.name})"
        self.tokenizer = base.tokenizer

    def __repr__(self) -> str:
        return f"BestOfNPolicy({self.base!r}, n={self.n})"

    def analytic_kl(self) -> float:
        """``log n - (n - 1) / n`` nats: the KL of best-of-n to its base policy (Stiennon et al., 2020)."""
        return math.log(self.n) - (self.n - 1) / self.n

    def sample(self, prompts: Sequence[Any], n: int, seed: int) -> Samples:
        """``n`` best-of-``self.n`` responses per prompt: ``n * self.n`` base samples, scored, best of each group."""
        raw = self.base.sample(prompts, n * self.n, seed=seed)
        flat_prompts = [p for p in prompts for _ in range(n * self.n)]
        scores = score(self.scorer, flat_prompts, raw.flat()).view(len(prompts), n, self.n)
        best = scores.argmax(-1)  # [P, n]: first maximum
        cols = (torch.arange(n).unsqueeze(0) * self.n + best).long()  # [P, n] column in the raw layout
        texts = [[raw.texts[i][c] for c in row] for i, row in enumerate(cols.tolist())]
        return Samples(
            texts=texts,
            num_tokens=raw.num_tokens.gather(1, cols),
            truncated=raw.truncated.gather(1, cols),
            temperatures=[raw.temperatures[0]] * n,
        )


def best_of_n(
    policy, prompts: Sequence[Any], scorer: RewardFn, n: int, *, seed: int = 0, tokenizer=None, **policy_kwargs: Any
) -> list[str]:
    """The best of ``n`` samples of ``policy`` (an :class:`HFPolicy`, or a path / model instance with ``tokenizer=`` and
    :class:`HFPolicy` keyword arguments) for each prompt under ``scorer``."""
    return BestOfNPolicy(as_policy(policy, tokenizer, **policy_kwargs), scorer, n).sample(prompts, 1, seed).flat()


def as_policy(policy, tokenizer=None, **kwargs: Any):
    """An :class:`HFPolicy` for a path / model instance; policy objects (with ``sample``) pass through."""
    if hasattr(policy, "sample"):
        return policy
    return HFPolicy(policy, tokenizer, **kwargs)


@dataclass
class WinRate:
    """Result of :func:`win_rate` (all means over the evaluation comparisons).

    Attributes:
        win_rate / stderr: mean outcome (win 1, tie 1/2, loss 0) and its standard error (from per-prompt means).
        lc_win_rate / lc_stderr / lc_length_coef: the length-controlled fit (:func:`length_controlled_win_rate`).
        wins / ties / losses / tie_rate: counts of comparisons; ``ties / num_comparisons``.
        num_prompts / samples_per_prompt / num_comparisons: sample sizes.
        judge: ``pool`` (evaluation annotators, no flips) or ``gold``.
        avg_length_chars / avg_length_tokens / truncated_fraction (policy), ref_avg_length_*: of the responses.
        gold_mean / gold_stderr / ref_gold_mean: gold reward of the policy's / reference's responses.
        kl / kl_stderr / kl_method: KL(policy || reference) in nats (see the module docstring); NaN if not computed.
    """

    win_rate: float
    stderr: float
    lc_win_rate: float
    lc_stderr: float
    lc_length_coef: float
    wins: int
    ties: int
    losses: int
    tie_rate: float
    num_prompts: int
    samples_per_prompt: int
    num_comparisons: int
    judge: str
    avg_length_chars: float
    avg_length_tokens: float
    truncated_fraction: float
    ref_avg_length_chars: float
    ref_avg_length_tokens: float
    gold_mean: float
    gold_stderr: float
    ref_gold_mean: float
    kl: float
    kl_stderr: float
    kl_method: str
    policy: str = ""
    reference: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LengthControlled:
    """Result of :func:`length_controlled_win_rate`: the win rate read off at zero length difference, its standard
    error (delta method, cluster-robust by prompt) and the fitted coefficient of the length feature."""

    win_rate: float
    stderr: float
    length_coef: float


_SLOPE_RIDGE = 1e-8  # length_controlled_win_rate: keeps the slope finite on length-separable outcomes


def length_controlled_win_rate(outcome: Tensor, length: Tensor, ref_length: Tensor) -> LengthControlled:
    """AlpacaEval 2.0's length-controlled win rate (its ``length_controlled_minimal`` GLM, unpenalised).

    ``P(win) = sigmoid(a + b * tanh((len - ref_len) / std(len - ref_len)))`` fitted by maximum likelihood (Newton's
    method in float64) with the outcomes ``{1, 1/2, 0}`` as soft labels, read off at zero length difference: ``LC =
    sigmoid(a)``. Instead of AlpacaEval's cross-validated L1 penalty (and instruction term), a vanishing ridge ``(1e-8 /
    2) b^2`` on the slope only keeps ``b`` finite when length separates the outcomes.

    ``outcome``: ``[P, k]`` outcomes (rows are prompts, the clusters of the standard error); ``length`` /
    ``ref_length``: ``[P, k]`` response lengths (characters). When no length varies, or every outcome is equal, the
    fit is the raw win rate.
    """
    y = outcome.double().flatten()
    delta = (length.double() - ref_length.double()).flatten()
    spread = float(delta.std()) if delta.numel() > 1 else 0.0
    t = torch.tanh(delta / spread) if spread > 0 else torch.zeros_like(delta)
    x = torch.stack([torch.ones_like(t), t], dim=1)  # [N, 2]
    mean = float(y.mean())
    if mean in (0.0, 1.0) or spread == 0:
        return LengthControlled(mean, _cluster_stderr(outcome), 0.0)
    theta = torch.tensor([math.log(mean / (1 - mean)), 0.0], dtype=torch.float64)

    ridge = torch.diag(torch.tensor([0.0, _SLOPE_RIDGE], dtype=torch.float64))

    def nll(th: Tensor) -> float:
        z = x @ th
        log_likelihood = y * torch.nn.functional.logsigmoid(z) + (1 - y) * torch.nn.functional.logsigmoid(-z)
        return float(-log_likelihood.sum() + 0.5 * th @ ridge @ th)

    for _ in range(100):
        p = torch.sigmoid(x @ theta)
        gradient = x.T @ (p - y) + ridge @ theta
        hessian = (x * (p * (1 - p)).unsqueeze(1)).T @ x + ridge
        step = torch.linalg.solve(hessian, gradient)
        scale, current = 1.0, nll(theta)
        while nll(theta - scale * step) > current and scale > 1e-10:  # step halving (separable data)
            scale /= 2
        theta = theta - scale * step
        if float(step.abs().max()) * scale < 1e-12:
            break
    p = torch.sigmoid(x @ theta)
    hessian = (x * (p * (1 - p)).unsqueeze(1)).T @ x + ridge
    scores = (x * (p - y).unsqueeze(1)).view(*outcome.shape, 2).sum(1)  # [P, 2] per-prompt score sums
    bread = torch.linalg.inv(hessian)
    covariance = bread @ (scores.T @ scores) @ bread
    lc = float(torch.sigmoid(theta[0]))
    return LengthControlled(lc, lc * (1 - lc) * math.sqrt(float(covariance[0, 0])), float(theta[1]))


def _cluster_stderr(values: Tensor) -> float:
    """Standard error of the mean of ``[P, k]`` values, clustered by row (prompt)."""
    per_prompt = values.double().mean(1)
    if per_prompt.numel() < 2:
        return float("nan")
    return float(per_prompt.std(unbiased=True) / math.sqrt(per_prompt.numel()))


def win_rate(
    policy,
    reference,
    prompts: Sequence[Any],
    *,
    styles: Sequence[str | None] | str | None = None,
    judge: AnnotatorPool | GoldScorer | Literal["pool", "gold"] = "pool",
    gold: GoldScorer | None = None,
    samples_per_prompt: int = 1,
    seed: int = 0,
    tokenizer=None,
    reference_samples: Samples | None = None,
    samples: Samples | None = None,
    compute_kl: bool = True,
    kl_estimator: Literal["sequence_log_ratio", "exact"] = "sequence_log_ratio",
    **policy_kwargs: Any,
) -> WinRate:
    """Win rate of ``policy`` against ``reference`` on held-out ``prompts`` (paper 002, section 3.3).

    Args:
        policy / reference: policy objects, checkpoint paths or model instances (with ``tokenizer=``; wrapped in
            :class:`HFPolicy` with ``policy_kwargs``); ``policy`` may be ``reference`` itself (independent samples).
        prompts: ``P`` held-out prompts; ``styles``: one per prompt or one for all (``None``: the scorers' default).
        judge: an :class:`AnnotatorPool` in evaluation mode (default ``AnnotatorPool.default(seed)``) or a
            :class:`GoldScorer` / ``"gold"`` (higher gold reward wins); ``gold`` scores the gold-reward columns.
        samples_per_prompt: ``k``; comparison ``j`` pits policy sample ``j`` against reference sample ``j``.
        seed: sampling seed of the policy (the reference uses ``seed + 1``).
        reference_samples / samples: the reference's / policy's ``[P][k]`` samples, if already drawn.
        compute_kl / kl_estimator: estimate KL(policy || reference), ``sequence_log_ratio`` or ``exact``
            (:meth:`HFPolicy.token_kl`; two :class:`HFPolicy` with one vocabulary); best-of-n is analytic either way.
    """
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("win_rate needs at least one prompt")
    k = samples_per_prompt
    pol = as_policy(policy, tokenizer, **policy_kwargs)
    ref = pol if reference is policy else as_policy(reference, tokenizer, **policy_kwargs)
    gold = gold if gold is not None else GoldScorer()
    styles_rows = gold.resolve_styles(prompts, styles)
    flat_prompts = [p for p in prompts for _ in range(k)]
    flat_styles = [s for s in styles_rows for _ in range(k)]

    if samples is None:
        samples = pol.sample(prompts, k, seed=seed)
    if reference_samples is None:
        reference_samples = ref.sample(prompts, k, seed=seed + 1)
    if len(reference_samples.texts) != len(prompts) or any(len(r) != k for r in reference_samples.texts):
        raise ValueError(f"reference_samples must hold {k} responses for each of the {len(prompts)} prompts")
    mine, theirs = samples.flat(), reference_samples.flat()

    if isinstance(judge, str):
        if judge not in ("pool", "gold"):
            raise ValueError(f"judge must be 'pool', 'gold', an AnnotatorPool or a GoldScorer; got {judge!r}")
        judge = AnnotatorPool.default(seed=seed) if judge == "pool" else gold
    if isinstance(judge, AnnotatorPool):
        outcome = judge.outcome(flat_prompts, mine, theirs, flat_styles, train=False).double()
        judge_name = "pool"
    elif isinstance(judge, GoldScorer):
        g = judge.score(flat_prompts + flat_prompts, mine + theirs, flat_styles + flat_styles).double()
        outcome = (torch.sign(g[: len(mine)] - g[len(mine) :]) + 1) / 2
        judge_name = "gold"
    else:
        raise TypeError(f"judge must be an AnnotatorPool or a GoldScorer, got {type(judge).__name__}")
    outcome = outcome.view(len(prompts), k)

    gold_mine = gold.score(flat_prompts, mine, flat_styles).view(len(prompts), k)
    gold_ref = gold.score(flat_prompts, theirs, flat_styles)

    kl, kl_se, kl_method = float("nan"), float("nan"), "none"
    if compute_kl:
        cut = samples.truncated.flatten()
        if isinstance(pol, BestOfNPolicy):
            kl, kl_se, kl_method = pol.analytic_kl(), 0.0, pol.kl_method
        elif kl_estimator == "exact" and isinstance(pol, HFPolicy) and isinstance(ref, HFPolicy):
            per = pol.token_kl(ref, flat_prompts, mine, cut).view(len(prompts), k)
            kl, kl_se, kl_method = float(per.double().mean()), _cluster_stderr(per), "exact_token_sum"
        elif kl_estimator == "sequence_log_ratio" and hasattr(pol, "logprobs") and hasattr(ref, "logprobs"):
            lp, lr = pol.logprobs(flat_prompts, mine, cut), ref.logprobs(flat_prompts, mine, cut)
            ratio = (lp - lr).view(len(prompts), k)
            kl, kl_se, kl_method = float(ratio.double().mean()), _cluster_stderr(ratio), pol.kl_method
        else:
            raise ValueError(
                f"cannot estimate KL ({kl_estimator}) for {type(pol).__name__} against {type(ref).__name__}: both "
                "need logprobs() (exact: two HFPolicy); pass compute_kl=False"
            )

    lc = length_controlled_win_rate(
        outcome, samples.num_chars().view(len(prompts), k), reference_samples.num_chars().view(len(prompts), k)
    )
    return WinRate(
        win_rate=float(outcome.mean()),
        stderr=_cluster_stderr(outcome),
        lc_win_rate=lc.win_rate,
        lc_stderr=lc.stderr,
        lc_length_coef=lc.length_coef,
        wins=int((outcome == 1).sum()),
        ties=int((outcome == 0.5).sum()),
        losses=int((outcome == 0).sum()),
        tie_rate=float((outcome == 0.5).double().mean()),
        num_prompts=len(prompts),
        samples_per_prompt=k,
        num_comparisons=outcome.numel(),
        judge=judge_name,
        avg_length_chars=float(samples.num_chars().mean()),
        avg_length_tokens=float(samples.num_tokens.float().mean()),
        truncated_fraction=float(samples.truncated.float().mean()),
        ref_avg_length_chars=float(reference_samples.num_chars().mean()),
        ref_avg_length_tokens=float(reference_samples.num_tokens.float().mean()),
        gold_mean=float(gold_mine.double().mean()),
        gold_stderr=_cluster_stderr(gold_mine),
        ref_gold_mean=float(gold_ref.double().mean()),
        kl=kl,
        kl_stderr=kl_se,
        kl_method=kl_method,
        policy=getattr(pol, "name", type(pol).__name__),
        reference=getattr(ref, "name", type(ref).__name__),
    )
