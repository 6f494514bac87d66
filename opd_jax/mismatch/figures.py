"""The census's figures, from per-token log-probs alone (what `opd-jax mismatch --dump` writes), so
each can be recomputed from the dump. For response tokens with trainer log-prob a = log π(y_t)
and engine log-prob b = log μ(y_t), the ratio k = π / μ = exp(a − b):

- |Δlogp| = mean |a − b|;
- k3 KL = mean (k − 1 − log k), an unbiased estimate of KL(μ ‖ π) on tokens sampled from μ;
- the ratio's quantiles, and the fraction of tokens with k outside each band [lo, hi];
- phantom clipping: the fraction outside PPO's clip band [1 − ε_low, 1 + ε_high], what the
  surrogate would clip at step 0 if its ratio were taken against the engine's log-probs;
- the same by decile of the trainer's probability p = exp(a) (ten bins of equal token counts,
  lowest p first: where the gap concentrates);
- by position in the response (equal-width bins), and per sequence the summed log-ratio
  S = Σ_t (a_t − b_t) against its length L: the drift per 1,000 tokens is the least-squares slope
  of |S| on L through the origin, 1000 · Σ |S| L / Σ L².

A DSA model (GLM-5) also has the keys each indexer layer chose per token, the engine's and the
trainer's own (offsets back, `models.mla.key_offsets`): the index-flip fraction is the share of
(token, indexer layer) pairs whose key sets differ, overall, per layer, by decile and by position;
and the per-token figures are given twice, scored with the trainer's own keys and with the
engine's (index replay).

Plain NumPy over flat token arrays; nothing here runs a model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

QUANTILES = (1, 10, 50, 90, 99)


@dataclasses.dataclass(frozen=True)
class Tokens:
    """One engine's sampled response tokens (flat over every sequence), and where each sits."""

    trainer: np.ndarray  # [N] log π(y_t), the trainer's score
    engine: np.ndarray  # [N] log μ(y_t), the engine's own
    position: np.ndarray  # [N] index of the token in its response (0 first)
    sequence: np.ndarray  # [N] the response it belongs to
    # DSA: the keys chosen, [N, indexer layers, k] offsets back (-1: none), the engine's and the
    # trainer's own; the trainer's log-probs attending its own keys and the engine's (index replay)
    index_engine: np.ndarray | None = None
    index_own: np.ndarray | None = None
    own_keys: np.ndarray | None = None
    engine_keys: np.ndarray | None = None

    def __post_init__(self):
        n = {len(self.trainer), len(self.engine), len(self.position), len(self.sequence)}
        if len(n) != 1:
            raise ValueError(f"census tokens: trainer, engine, position and sequence differ in length ({sorted(n)})")

    @property
    def log_ratio(self) -> np.ndarray:
        return np.asarray(self.trainer, np.float64) - np.asarray(self.engine, np.float64)


def band_name(lo: float, hi: float) -> str:
    return f"outside [{lo:g}, {hi:g}]"


def token_figures(log_ratio: np.ndarray, bands: Sequence[tuple[float, float]], clip: tuple[float, float]
                  ) -> dict[str, float]:
    """The per-token figures of a set of tokens (see the module's docstring); NaN when empty."""
    d = np.asarray(log_ratio, np.float64)
    if d.size == 0:
        return {"tokens": 0.0}
    k = np.exp(d)
    out = {"tokens": float(d.size), "abs_dlogp": float(np.mean(np.abs(d))), "kl_k3": float(np.mean(k - 1.0 - d))}
    out.update({f"ratio q{q:02d}": float(v) for q, v in zip(QUANTILES, np.quantile(k, [q / 100 for q in QUANTILES]))})
    for lo, hi in bands:
        out[band_name(lo, hi)] = float(np.mean((k < lo) | (k > hi)))
    out["phantom clip"] = float(np.mean((k < clip[0]) | (k > clip[1])))
    return out


def by_probability(tokens: Tokens, bands: Sequence[tuple[float, float]], clip: tuple[float, float],
                   bins: int = 10) -> list[dict[str, float]]:
    """Token figures per decile of the trainer's probability (equal token counts, lowest first),
    each with its probability range [p_low, p_high]."""
    p = np.exp(np.asarray(tokens.trainer, np.float64))
    order = np.argsort(p, kind="stable")
    d = tokens.log_ratio
    out = []
    for part in np.array_split(order, bins):
        if part.size:
            out.append({"p_low": float(p[part].min()), "p_high": float(p[part].max()),
                        **token_figures(d[part], bands, clip)})
    return out


def by_position(tokens: Tokens, bands: Sequence[tuple[float, float]], clip: tuple[float, float], bins: int,
                longest: int | None = None) -> list[dict[str, float]]:
    """Token figures per bin of response position: `bins` equal widths over [0, longest)."""
    longest = int(longest or (tokens.position.max() + 1 if tokens.position.size else 1))
    width = max(1, -(-longest // bins))
    d, where = tokens.log_ratio, np.asarray(tokens.position) // width
    return [{"from": b * width, "to": min((b + 1) * width, longest), **token_figures(d[where == b], bands, clip)}
            for b in range(-(-longest // width))]


def sequences(tokens: Tokens) -> tuple[np.ndarray, np.ndarray]:
    """(S, L): each sequence's summed log-ratio and its length, in order of sequence id."""
    ids, inverse = np.unique(tokens.sequence, return_inverse=True)
    summed = np.zeros(len(ids))
    np.add.at(summed, inverse, tokens.log_ratio)
    return summed, np.bincount(inverse, minlength=len(ids)).astype(np.float64)


def sequence_figures(tokens: Tokens) -> dict[str, float]:
    """Drift of the summed log-ratio with length: the slope of |S| on L (per 1,000 tokens), and
    mean |S|, mean L, and the mean per-sequence ratio exp(S) (the sequence-level importance weight)."""
    s, length = sequences(tokens)
    if not s.size:
        return {}
    return {"sequences": float(s.size), "mean length": float(length.mean()),
            "drift per 1k tokens": float(1000 * np.sum(np.abs(s) * length) / np.sum(length ** 2)),
            "mean abs(S)": float(np.mean(np.abs(s))),
            "sequence ratio q01": float(np.quantile(np.exp(s), 0.01)),
            "sequence ratio q99": float(np.quantile(np.exp(s), 0.99))}


def index_flipped(own: np.ndarray, engine: np.ndarray) -> np.ndarray:
    """[N, layers] bool: the token's key set at that indexer layer differs between trainer and
    engine (sets of offsets [N, layers, k], order ignored)."""
    return np.any(np.sort(own, axis=-1) != np.sort(engine, axis=-1), axis=-1)


def index_figures(tokens: Tokens, bands: Sequence[tuple[float, float]], clip: tuple[float, float],
                  position_bins: int, longest: int | None = None) -> dict:
    """A DSA model's index flips (overall, per indexer layer, by decile of the trainer's
    probability and by position bin) and the per-token figures without and with index replay."""
    flipped = index_flipped(tokens.index_own, tokens.index_engine)
    p = np.exp(np.asarray(tokens.trainer, np.float64))
    longest = int(longest or (tokens.position.max() + 1 if tokens.position.size else 1))
    width = max(1, -(-longest // position_bins))
    where = np.asarray(tokens.position) // width
    engine = np.asarray(tokens.engine, np.float64)
    return {"flip_frac": float(flipped.mean()) if flipped.size else math.nan,
            "flip_frac per layer": [float(x) for x in flipped.mean(0)] if flipped.size else [],
            "by_probability": [{"p_low": float(p[part].min()), "p_high": float(p[part].max()),
                                "flip_frac": float(flipped[part].mean())}
                               for part in np.array_split(np.argsort(p, kind="stable"), 10) if part.size],
            "by_position": [{"from": b * width, "to": min((b + 1) * width, longest),
                             "flip_frac": float(flipped[where == b].mean()) if np.any(where == b) else math.nan}
                            for b in range(-(-longest // width))],
            "own keys": token_figures(np.asarray(tokens.own_keys, np.float64) - engine, bands, clip),
            "engine's keys": token_figures(np.asarray(tokens.engine_keys, np.float64) - engine, bands, clip)}


def census_figures(tokens: Tokens, *, bands: Sequence[tuple[float, float]], clip: tuple[float, float],
                   position_bins: int, longest: int | None = None) -> dict:
    """Everything the census reports of one engine and one seed."""
    figures = {"tokens": token_figures(tokens.log_ratio, bands, clip),
               "sequences": sequence_figures(tokens),
               "by_probability": by_probability(tokens, bands, clip),
               "by_position": by_position(tokens, bands, clip, position_bins, longest)}
    if tokens.index_engine is not None:
        figures["index"] = index_figures(tokens, bands, clip, position_bins, longest)
    return figures
