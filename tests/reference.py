"""Slow, independent reference implementations in NumPy float64 with Python loops.

Written straight from the equations (the spec, the papers), sharing no code with the
library, so the tests compare two derivations of the same formula.
"""

from __future__ import annotations

import math

import numpy as np


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    m = np.max(z, axis=-1, keepdims=True)
    return z - m - np.log(np.sum(np.exp(z - m), axis=-1, keepdims=True))


def aggregate(values, mask, mode, max_len=None) -> float:
    """Loop over sequences; rows with no valid token are padding and are skipped."""
    values = np.asarray(values, np.float64)
    mask = np.asarray(mask, np.float64)
    rows = [i for i in range(values.shape[0]) if mask[i].sum() > 0]
    if not rows:
        return 0.0
    if mode == "token-mean":
        total, count = 0.0, 0.0
        for i in rows:
            for t in range(values.shape[1]):
                total += values[i, t] * mask[i, t]
                count += mask[i, t]
        return total / count
    sums = [sum(values[i, t] * mask[i, t] for t in range(values.shape[1])) for i in rows]
    if mode == "seq-mean-token-mean":
        return sum(s / mask[i].sum() for s, i in zip(sums, rows, strict=True)) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sums) / len(rows)
    length = values.shape[1] if max_len is None else max_len
    if mode == "seq-mean-token-sum-norm":
        return sum(sums) / (len(rows) * length)
    if mode == "token-sum-norm":  # verl's seq-mean-token-sum-norm: no division by the rows
        return sum(sums) / length
    raise ValueError(mode)


def per_token(advantages, shape) -> np.ndarray:
    a = np.asarray(advantages, np.float64)
    return np.repeat(a[:, None], shape[1], axis=1) if a.ndim == 1 else a


def kl_estimate(logp: float, ref_logp: float, estimator: str) -> float:
    log_ratio = ref_logp - logp  # log pi_ref / pi
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "abs":
        return abs(log_ratio)
    return math.exp(log_ratio) - log_ratio - 1.0


def clip(x: float, low: float | None, high: float | None) -> float:
    if low is not None and x < low:
        return low
    if high is not None and x > high:
        return high
    return x


def policy_gradient(logp, advantages, mask, agg, max_len=None) -> float:
    adv = per_token(advantages, np.shape(logp))
    per = -adv * np.asarray(logp, np.float64)
    return aggregate(per, mask, agg, max_len)


def ppo_clip(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, agg, max_len=None) -> float:
    logp, old_logp = np.asarray(logp, np.float64), np.asarray(old_logp, np.float64)
    adv = per_token(advantages, logp.shape)
    per = np.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            rho = math.exp(logp[i, t] - old_logp[i, t])
            a = adv[i, t]
            objective = min(rho * a, clip(rho, 1 - eps_low, 1 + eps_high) * a)
            if dual_clip is not None and a < 0:
                objective = max(objective, dual_clip * a)
            per[i, t] = -objective
    return aggregate(per, mask, agg, max_len)


def grpo(logp, old_logp, advantages, mask, ref_logp, beta, kl, eps_low, eps_high, level, agg, max_len=None) -> float:
    """DeepSeekMath's GRPO; for level="sequence" GSPO's length-normalised sequence ratio."""
    logp, old_logp = np.asarray(logp, np.float64), np.asarray(old_logp, np.float64)
    mask = np.asarray(mask, np.float64)
    adv = per_token(advantages, logp.shape)
    per = np.zeros_like(logp)
    for i in range(logp.shape[0]):
        n = mask[i].sum()
        seq_log_ratio = sum((logp[i, t] - old_logp[i, t]) * mask[i, t] for t in range(logp.shape[1])) / max(n, 1)
        for t in range(logp.shape[1]):
            rho = math.exp(logp[i, t] - old_logp[i, t]) if level == "token" else math.exp(seq_log_ratio)
            a = adv[i, t]
            per[i, t] = -min(rho * a, clip(rho, 1 - eps_low, 1 + eps_high) * a)
            if ref_logp is not None and beta:
                per[i, t] += beta * kl_estimate(logp[i, t], float(ref_logp[i, t]), kl)
    return aggregate(per, mask, agg, max_len)


def cispo(logp, old_logp, advantages, mask, eps_low, eps_high, agg, max_len=None) -> float:
    """Value of the CISPO loss; its gradient treats the clipped weight as a constant."""
    logp, old_logp = np.asarray(logp, np.float64), np.asarray(old_logp, np.float64)
    adv = per_token(advantages, logp.shape)
    per = np.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            rho = math.exp(logp[i, t] - old_logp[i, t])
            low = None if eps_low is None else 1 - eps_low
            high = None if eps_high is None else 1 + eps_high
            per[i, t] = -clip(rho, low, high) * adv[i, t] * logp[i, t]
    return aggregate(per, mask, agg, max_len)


def cispo_grad(logp, old_logp, advantages, mask, eps_low, eps_high, agg, max_len=None) -> np.ndarray:
    """d loss / d logp with the weight held fixed: the loss is linear in logp then."""
    logp, old_logp = np.asarray(logp, np.float64), np.asarray(old_logp, np.float64)
    weights = np.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            rho = math.exp(logp[i, t] - old_logp[i, t])
            low = None if eps_low is None else 1 - eps_low
            high = None if eps_high is None else 1 + eps_high
            weights[i, t] = clip(rho, low, high)
    adv = per_token(advantages, logp.shape)
    # Linear in logp: gradient = aggregate's weight per entry times -w*A.
    grad = np.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            unit = np.zeros_like(logp)
            unit[i, t] = 1.0
            grad[i, t] = aggregate(-weights * adv * unit, mask, agg, max_len)
    return grad


def value_loss(values, old_values, returns, mask, clip_range, agg, max_len=None) -> float:
    values = np.asarray(values, np.float64)
    per = np.zeros_like(values)
    for i in range(values.shape[0]):
        for t in range(values.shape[1]):
            v, v_old, r = values[i, t], float(old_values[i, t]), float(returns[i, t])
            error = (v - r) ** 2
            if clip_range is not None:
                v_clipped = min(max(v, v_old - clip_range), v_old + clip_range)
                error = max(error, (v_clipped - r) ** 2)
            per[i, t] = 0.5 * error
    return aggregate(per, mask, agg, max_len)


def finite_difference_grad(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central differences of a scalar function of an array, in float64."""
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += h
        down[index] -= h
        grad[index] = (f(up) - f(down)) / (2 * h)
    return grad


def overlong_penalty(lengths, *, max_len: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13), one length at a time."""

    def one(length):
        if length <= max_len - buffer:
            return 0.0
        return ((max_len - buffer) - length) / buffer * penalty if length <= max_len else -penalty

    return np.array([one(int(length)) for length in lengths])


def rloo(rewards) -> np.ndarray:
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    num_prompts, group = rewards.shape
    for p in range(num_prompts):
        for i in range(group):
            others = [rewards[p, j] for j in range(group) if j != i]
            out[p, i] = rewards[p, i] - sum(others) / len(others)
    return out


def grpo_advantages(rewards, eps, ddof, scale) -> np.ndarray:
    rewards = np.asarray(rewards, np.float64)
    num_prompts, group = rewards.shape
    all_mean = sum(rewards.ravel()) / rewards.size
    batch_std = math.sqrt(sum((r - all_mean) ** 2 for r in rewards.ravel()) / (rewards.size - ddof))
    out = np.zeros_like(rewards)
    for p in range(num_prompts):
        mu = sum(rewards[p]) / group
        if scale == "none":
            out[p] = rewards[p] - mu
            continue
        sigma = math.sqrt(sum((r - mu) ** 2 for r in rewards[p]) / (group - ddof)) if scale == "group" else batch_std
        out[p] = (rewards[p] - mu) / (sigma + eps)
    return out


def gae(rewards, values, mask, gamma, lam) -> tuple[np.ndarray, np.ndarray]:
    """Per row: walk the valid positions backwards, skipping masked ones."""
    rewards, values, mask = (np.asarray(x, np.float64) for x in (rewards, values, mask))
    advantages = np.zeros_like(rewards)
    returns = np.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        valid = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        next_value, next_advantage = 0.0, 0.0
        for t in reversed(valid):
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            advantages[i, t] = delta + gamma * lam * next_advantage
            returns[i, t] = advantages[i, t] + values[i, t]
            next_value, next_advantage = values[i, t], advantages[i, t]
    return advantages, returns


def whiten(values, mask, eps=1e-8, ddof=0, eps_placement="std") -> np.ndarray:
    """Whitening over the valid entries, 0 elsewhere, a loop over them: ``(x - mean) / s``
    with ``s = std + eps`` (``"std"``), verl's ``masked_whiten`` ``rsqrt(var + eps)``
    (``"variance"``) or OpenRLHF's ``rsqrt(clamp(var, min=eps))`` (``"variance_floor"``);
    the population (``ddof=0``) or sample (``ddof=1``) variance."""
    values, mask = np.asarray(values, np.float64), np.asarray(mask) > 0
    valid = [float(x) for x, keep in zip(values.ravel(), mask.ravel()) if keep]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - ddof) if len(valid) > ddof else 0.0
    scale = {"std": math.sqrt(var) + eps, "variance": math.sqrt(var + eps), "variance_floor": math.sqrt(max(var, eps))}[
        eps_placement
    ]
    out = np.zeros_like(values)
    out[mask] = [(x - mean) / scale for x in valid]
    return out


def kl_penalised_token_rewards(rewards, mask, logp, ref_logp, coef) -> np.ndarray:
    """r_t = R [t is the last valid token] - coef * (logp - ref_logp), 0 where masked."""
    rewards, mask = np.asarray(rewards, np.float64), np.asarray(mask) > 0
    out = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t]]
        for t in valid:
            out[i, t] = -coef * (float(logp[i, t]) - float(ref_logp[i, t]))
        if valid:
            out[i, valid[-1]] += rewards[i]
    return out


def returns_to_go(token_rewards, mask, gamma) -> np.ndarray:
    out = np.zeros(np.shape(token_rewards))
    for i in range(out.shape[0]):
        running = 0.0
        for t in reversed(range(out.shape[1])):
            if mask[i, t]:
                running = float(token_rewards[i, t]) + gamma * running
                out[i, t] = running
    return out
