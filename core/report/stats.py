"""Statistics of a study: interquartile means, stratified-bootstrap intervals, P(X > Y).

The estimators are rliable's (Agarwal et al., "Deep RL at the Edge of the Statistical
Precipice", NeurIPS 2021): the interquartile mean (25 % trimmed mean) of the final
scores over runs, the stratified bootstrap over runs for 95 % confidence intervals
(percentile method), and the probability of improvement P(X > Y) (the Mann-Whitney U
statistic over all run pairs, ties counting one half). Across tasks, the IQM of scores
normalised per task, with the same stratified bootstrap (:func:`stratified_iqm`).

rliable 1.2.0 builds its bootstraps with ``random_state=``, which arch >= 8 no longer
accepts; the two small subclasses below construct the same bootstraps through arch's
current signature and keep rliable's resampling (``update_indices``) unchanged. The
resampling draws from NumPy's global generator, so :func:`_seeded` fixes and restores it
to make every interval reproducible.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

CI_SIZE = 0.95  # coverage of every interval in the report


@dataclass
class Interval:
    """A point estimate with its confidence interval."""

    value: float
    low: float
    high: float

    def fmt(self, digits: int = 3) -> str:
        if not np.isfinite(self.value):
            return "—"
        return f"{self.value:.{digits}g} [{self.low:.{digits}g}, {self.high:.{digits}g}]"


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def _bootstraps() -> tuple[type, type]:
    """rliable's stratified bootstraps, built through arch's current constructor."""
    import arch.bootstrap as arch_bs
    from rliable import library as rly

    class Stratified(rly.StratifiedBootstrap):  # resample runs within each task
        def __init__(self, scores: np.ndarray) -> None:
            arch_bs.IIDBootstrap.__init__(self, scores)
            self._args_shape = scores.shape
            self._num_tasks = scores.shape[1]
            self._parameters = [self._num_tasks, False]
            self._task_bootstrap = False
            self._strata_indices = self._get_strata_indices()

    class StratifiedIndependent(rly.StratifiedIndependentBootstrap):  # each arm on its own
        def __init__(self, *scores: np.ndarray) -> None:
            arch_bs.IndependentSamplesBootstrap.__init__(self, *scores)
            self._args_shapes = [s.shape for s in scores]
            self._kwargs_shapes: dict[str, tuple[int, ...]] = {}
            self._args_strata_indices = [self._get_strata_indices(s) for s in self._args_shapes]
            self._kwargs_strata_indices: dict[str, list[np.ndarray]] = {}

    return Stratified, StratifiedIndependent


def iqm(scores: np.ndarray) -> float:
    """Interquartile mean of all values (rliable's ``aggregate_iqm``)."""
    from rliable import metrics

    return float(metrics.aggregate_iqm(np.asarray(scores, dtype=float)))


def _intervals(
    func: Callable[..., np.ndarray], *scores: np.ndarray, reps: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Point estimates and (2, k) percentile-bootstrap bounds of ``func`` over runs."""
    stratified, independent = _bootstraps()
    point = np.atleast_1d(np.asarray(func(*scores), dtype=float))
    n_runs = min(s.shape[0] for s in scores)
    if n_runs < 2:  # one run: nothing to resample, the interval is the point
        return point, np.stack([point, point])
    bootstrap = stratified(scores[0]) if len(scores) == 1 else independent(*scores)
    with _seeded(seed):
        bounds = bootstrap.conf_int(func, reps=reps, size=CI_SIZE, method="percentile")
    return point, np.asarray(bounds, dtype=float).reshape(2, -1)


def final_score_intervals(values: list[float], reps: int = 2000, seed: int = 0) -> tuple[Interval, Interval]:
    """IQM and mean of one arm's final scores on one task, each with a 95 % CI."""
    from rliable import metrics

    if not values:
        nan = Interval(float("nan"), float("nan"), float("nan"))
        return nan, nan
    scores = np.asarray(values, dtype=float)[:, None]  # (runs, tasks=1)

    def both(s: np.ndarray) -> np.ndarray:
        return np.array([metrics.aggregate_iqm(s), metrics.aggregate_mean(s)])

    point, bounds = _intervals(both, scores, reps=reps, seed=seed)
    return (Interval(point[0], bounds[0, 0], bounds[1, 0]), Interval(point[1], bounds[0, 1], bounds[1, 1]))


def improvement(x: list[float], y: list[float], reps: int = 2000, seed: int = 0) -> Interval:
    """P(X > Y) over the runs of two arms on one task, with a 95 % CI."""
    from rliable import metrics

    if not x or not y:
        return Interval(float("nan"), float("nan"), float("nan"))
    sx, sy = np.asarray(x, dtype=float)[:, None], np.asarray(y, dtype=float)[:, None]
    point, bounds = _intervals(
        lambda a, b: np.array([metrics.probability_of_improvement(a, b)]), sx, sy, reps=reps, seed=seed
    )
    return Interval(point[0], bounds[0, 0], bounds[1, 0])


#: a one-sided level: "X beats Y" needs the exact rank test below it (two-sided 95 %)
ALPHA_ONE_SIDED = 0.025


def rank_test_p(x: list[float], y: list[float]) -> float:
    """One-sided p-value of the Mann-Whitney U test that X tends to exceed Y (exact on small samples).

    The bootstrap interval of P(X > Y) collapses to ``1 [1, 1]`` whenever every X beats every
    Y, however few runs there are: with 3 runs against 3, a complete separation happens by
    chance 1 time in 20. The exact test states that chance, so a "beats" needs both.
    """
    from scipy.stats import mannwhitneyu

    if len(x) < 1 or len(y) < 1:
        return float("nan")
    return float(mannwhitneyu(x, y, alternative="greater", method="auto").pvalue)


def _p_greater(x: np.ndarray, y: np.ndarray) -> float:
    """P(X > Y) over all run pairs, ties counting one half (the Mann-Whitney U over n * m)."""
    diff = x[:, None] - y[None, :]
    return float(np.mean((diff > 0) + 0.5 * (diff == 0)))


def average_improvement(pairs: list[tuple[list[float], list[float]]], reps: int = 2000, seed: int = 0) -> Interval:
    """The mean over tasks of P(X > Y), with a 95 % CI (rliable's average probability of improvement).

    ``pairs`` holds, per task, X's and Y's scores. Each replication resamples each arm's
    runs within each task, with replacement and independently of the other arm (rliable's
    ``StratifiedIndependentBootstrap``); the interval is the percentile one. Tasks may have
    different numbers of runs.
    """
    groups = [(np.asarray(x, dtype=float), np.asarray(y, dtype=float)) for x, y in pairs if len(x) and len(y)]
    if not groups:
        return Interval(float("nan"), float("nan"), float("nan"))
    point = float(np.mean([_p_greater(x, y) for x, y in groups]))
    rng = np.random.default_rng(seed)
    draws = [
        np.mean([_p_greater(x[rng.integers(0, len(x), len(x))], y[rng.integers(0, len(y), len(y))]) for x, y in groups])
        for _ in range(reps)
    ]
    low, high = np.percentile(draws, [100 * (1 - CI_SIZE) / 2, 100 * (1 + CI_SIZE) / 2])
    return Interval(point, float(low), float(high))


def normalised(value: float, low: float, high: float) -> float:
    """``value`` on the scale where ``low`` is 0 and ``high`` is 1: ``(value - low) / (high - low)``."""
    return (value - low) / (high - low)


def stratified_iqm(per_task: list[list[float]], reps: int = 2000, seed: int = 0) -> Interval:
    """The IQM over every (task, run) score, with a 95 % stratified-bootstrap CI.

    Each replication resamples the runs within each task, with replacement (rliable's
    ``StratifiedBootstrap``), so every task keeps its number of runs; the interval is the
    percentile one. rliable holds scores as a (runs, tasks) array, which cannot hold tasks
    with different numbers of runs (a task with more seeds, a seed not run yet); this is the
    same bootstrap over a list per task. Tasks of one run only are the point.
    """
    groups = [np.asarray(g, dtype=float) for g in per_task if len(g)]
    if not groups:
        return Interval(float("nan"), float("nan"), float("nan"))
    point = iqm(np.concatenate(groups))
    if all(len(g) < 2 for g in groups):  # nothing to resample
        return Interval(point, point, point)
    rng = np.random.default_rng(seed)
    draws = [iqm(np.concatenate([g[rng.integers(0, len(g), len(g))] for g in groups])) for _ in range(reps)]
    low, high = np.percentile(draws, [100 * (1 - CI_SIZE) / 2, 100 * (1 + CI_SIZE) / 2])
    return Interval(point, float(low), float(high))


def curve_band(matrix: np.ndarray, reps: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQM over runs at each point of a (runs, points) matrix, with 95 % CI bands."""
    from rliable import metrics

    scores = np.asarray(matrix, dtype=float)[:, None, :]  # (runs, tasks=1, points)

    def per_point(s: np.ndarray) -> np.ndarray:
        return np.array([metrics.aggregate_iqm(s[..., j]) for j in range(s.shape[-1])])

    point, bounds = _intervals(per_point, scores, reps=reps, seed=seed)
    return point, bounds[0], bounds[1]
