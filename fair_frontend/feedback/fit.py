"""The batch-time fit: ``seconds ≈ fixed + per_row * rows + per_token * tokens``.

Exponentially forgotten, weighted, non-negative least squares over decayed sufficient
statistics; the choices are explained once in the package docstring (``feedback``). This
module is plain arithmetic on at most 3 x 3 matrices, in pure Python: a fit costs tens of
microseconds, less than numpy's per-call overhead at this size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TERMS = ("fixed", "per_row", "per_token")
"""The model's terms, in the order of the feature vector ``x = [1, rows, tokens]``."""

MIN_SPREAD = 0.1
"""A term is identified only if its feature varies by at least this much, relative to its
size, independently of the other chosen terms: each column of the normalised Gram matrix
must keep ``1 - R^2 >= MIN_SPREAD ** 2`` against the others (for one slope next to the
fixed term that is a coefficient of variation of about 10 %). Below it the data cannot tell
the terms apart, and a slope fitted there would be noise."""

_TIE = 1e-9  # BIC scores closer than this count as equal (the simpler model wins)
_RSS_FLOOR = 1e-12  # residuals below this fraction of sum(w y^2) are float noise
_PIVOT = 1e-12  # a smaller pivot makes the normalised matrix singular


@dataclass(frozen=True, slots=True)
class BatchTime:
    """A batch-time model: ``fixed_s + per_row_s * rows + per_token_s * tokens`` seconds.

    ``terms`` names the terms the data determined (a subset of ``TERMS``; the others are 0
    because they were not identified or would have been negative). Empty: no data, these
    are the configured defaults.
    """

    fixed_s: float
    per_row_s: float
    per_token_s: float
    terms: tuple[str, ...] = ()

    def seconds(self, rows: float, tokens: float) -> float:
        return self.fixed_s + self.per_row_s * rows + self.per_token_s * tokens

    @property
    def basis(self) -> str:
        """``"fixed+per_token"`` and the like; ``"default"`` without data."""
        return "+".join(self.terms) if self.terms else "default"

    def scaled(self, factor: float) -> BatchTime:
        return BatchTime(
            self.fixed_s * factor, self.per_row_s * factor, self.per_token_s * factor, self.terms
        )


class DecayedStats:
    """Exponentially decayed sufficient statistics of ``(x = [1, rows, tokens], seconds)``.

    ``sxx[i][j] = sum w x_i x_j``, ``sxy[i] = sum w x_i y``, ``syy = sum w y^2``; the
    weights ``w`` shrink by the factor given to ``decay``. Everything the feedback loop
    estimates is a ratio of these sums, so it is unchanged by a common scale: ``sxx[0][0]``
    is the decayed batch count, ``sxx[0][1] / sxx[0][0]`` the mean rows per batch,
    ``sxy[0] / sxx[0][1]`` the busy seconds per row, and so on.
    """

    __slots__ = ("sww", "sxx", "sxy", "syy", "updated_at")

    def __init__(self) -> None:
        self.sxx = [[0.0] * 3 for _ in range(3)]
        self.sxy = [0.0] * 3
        self.syy = 0.0
        self.sww = 0.0  # sum of w^2: the effective number of observations is W^2 / sww
        self.updated_at: float | None = None

    @property
    def weight(self) -> float:
        return self.sxx[0][0]

    @property
    def effective_count(self) -> float:
        """Independent observations the decayed sums are worth: ``W^2 / sum(w^2)``."""
        return self.weight**2 / self.sww if self.sww > 0 else 0.0

    def decay(self, factor: float) -> None:
        for row in self.sxx:
            for j in range(3):
                row[j] *= factor
        for i in range(3):
            self.sxy[i] *= factor
        self.syy *= factor
        self.sww *= factor * factor

    def add(self, rows: float, tokens: float, seconds: float, weight: float = 1.0) -> None:
        """One observation: a batch (weight 1), or the mean of ``weight`` batches."""
        x = (1.0, float(rows), float(tokens))
        for i in range(3):
            wx = weight * x[i]
            row = self.sxx[i]
            for j in range(3):
                row[j] += wx * x[j]
            self.sxy[i] += wx * seconds
        self.syy += weight * seconds * seconds
        self.sww += weight * weight

    def mean(self) -> tuple[float, float, float]:
        """Mean ``(rows, tokens, seconds)`` per batch; zeros without data."""
        w = self.weight
        if w <= 0:
            return 0.0, 0.0, 0.0
        return self.sxx[0][1] / w, self.sxx[0][2] / w, self.sxy[0] / w

    def fit(self, unit: int) -> BatchTime | None:
        """The non-negative least-squares batch-time model, ``None`` without data.

        ``unit`` is the index (1 rows, 2 tokens) of the endpoint's cost unit: among fits
        that explain the data equally well, those using it are preferred, so data that
        cannot separate the terms (every batch alike) yields "seconds proportional to the
        cost unit", never an invented slope (see the package docstring).
        """
        if self.weight <= 0:
            return None
        scale = [math.sqrt(self.sxx[i][i]) for i in range(3)]
        # Normalised Gram matrix and right-hand side: scale-free conditioning checks.
        g = [
            [
                self.sxx[i][j] / (scale[i] * scale[j]) if scale[i] > 0 and scale[j] > 0 else 0.0
                for j in range(3)
            ]
            for i in range(3)
        ]
        b = [self.sxy[i] / scale[i] if scale[i] > 0 else 0.0 for i in range(3)]
        other = 3 - unit
        n = max(self.effective_count, 1.0)
        floor = _RSS_FLOOR * self.syy + 1e-300
        best: tuple[float, tuple[int, ...], list[float]] | None = None
        # Simplest first; a larger model must score strictly better to be chosen.
        for subset in ((unit,), (0,), (other,), (0, unit), (0, other), (unit, other), (0, 1, 2)):
            if any(scale[i] == 0 for i in subset):
                continue  # a feature that is always 0 says nothing
            coefs = _solve_identified([[g[i][j] for j in subset] for i in subset], subset, b)
            if coefs is None or any(c < 0 for c in coefs):
                continue
            rss = self.syy - sum(c * b[i] for c, i in zip(coefs, subset, strict=True))
            # BIC: n ln(RSS / W) + k ln(n), with n the effective number of batches.
            score = n * math.log(max(rss, floor) / self.weight) + len(subset) * math.log(n)
            if best is None or score < best[0] - _TIE:
                best = (score, subset, coefs)
        if best is None:
            return None
        theta = [0.0, 0.0, 0.0]
        for c, i in zip(best[2], best[1], strict=True):
            theta[i] = c / scale[i]
        return BatchTime(theta[0], theta[1], theta[2], tuple(TERMS[i] for i in sorted(best[1])))


def _solve_identified(
    g: list[list[float]], subset: tuple[int, ...], b: list[float]
) -> list[float] | None:
    """Solve ``g c = b[subset]`` if every column of ``g`` is identified, else ``None``.

    Identified: ``1 / inv(g)[j][j] >= MIN_SPREAD ** 2`` for every ``j`` (that quantity is
    ``1 - R^2`` of column ``j`` regressed on the others, ``g`` having a unit diagonal).
    """
    inv = _inverse(g)
    if inv is None:
        return None
    if any(inv[j][j] <= 0 or 1.0 / inv[j][j] < MIN_SPREAD**2 for j in range(len(g))):
        return None
    rhs = [b[i] for i in subset]
    coefs = [sum(inv[r][k] * rhs[k] for k in range(len(rhs))) for r in range(len(rhs))]
    # Round-off can leave a term that belongs at 0 a hair below it.
    return [0.0 if -1e-12 < c < 0 else c for c in coefs]


def _inverse(m: list[list[float]]) -> list[list[float]] | None:
    """Gauss-Jordan with partial pivoting; ``None`` if (numerically) singular."""
    n = len(m)
    a = [[*row, *(1.0 if i == j else 0.0 for j in range(n))] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < _PIVOT:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        a[col] = [v / p for v in a[col]]
        for r in range(n):
            if r != col and a[r][col] != 0.0:
                f = a[r][col]
                a[r] = [v - f * pc for v, pc in zip(a[r], a[col], strict=True)]
    return [row[n:] for row in a]
