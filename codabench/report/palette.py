"""One colour per implementation, the same in every plot and table of a report, and no two alike.

The implementations this project knows have fixed colours (:data:`FIXED`), pairwise at least :data:`MIN_DISTANCE`
apart (CIE76 distance in CIELAB, :func:`distance`). Any other implementation (a plugin's) takes, in the alphabetical
order of the report's other names, the colour of :data:`CANDIDATES` farthest from every fixed colour and from the
colours already given: a plugin's colour depends only on the other plugins of the report, so it is the same in every
figure and table of one report; the first ten stay :data:`MIN_DISTANCE` apart from the fixed colours and each other.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from codabench.matrix import BASELINE_ORDER

FIXED = {"torch-eager": "#8c8c8c", "torch-compile": "#222222", "coda-triton": "#1f77b4", "liger": "#ff7f0e",
         "flashinfer": "#2ca02c", "quack": "#9467bd", "coda-example": "#17becf",
         "hf-coda": "#d62728", "hf-liger": "#8c564b", "hf-compile": "#bcbd22", "hf-eager": "#e377c2",
         "hf-coda-lora": "#7a0010", "hf-liger-lora": "#ffbb78", "hf-compile-lora": "#98df8a",
         "hf-eager-lora": "#c5b0d5"}
MIN_DISTANCE = 25.0
"""The least CIE76 distance between two implementations' colours (about 2.3 is a just-noticeable difference; 25 is
two colours no one confuses in a legend)."""
LIGHTEST = 85.0
"""Candidates lighter than this CIELAB L* vanish against the white page and are not used."""


def to_lab(color: str) -> np.ndarray:
    """CIELAB (D65) of a ``#rrggbb`` sRGB colour."""
    rgb = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ linear
    xyz /= np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def distance(a: str, b: str) -> float:
    """The CIE76 distance (Euclidean in CIELAB) of two ``#rrggbb`` colours."""
    return float(np.linalg.norm(to_lab(a) - to_lab(b)))


CANDIDATES = [c for c in (f"#{r:02x}{g:02x}{b:02x}" for r in range(0, 256, 51) for g in range(0, 256, 51)
                          for b in range(0, 256, 51)) if to_lab(c)[0] < LIGHTEST]
"""The colours a plugin may take: the 216 web-safe colours not too light for a white page."""
_CANDIDATE_LAB = np.array([to_lab(c) for c in CANDIDATES])


def impl_order(impls: Iterable[str]) -> list[str]:
    """The baselines first (torch-eager, torch-compile), then this project's implementations, then the others
    alphabetically."""
    known = list(BASELINE_ORDER) + [i for i in FIXED if i not in BASELINE_ORDER]
    names = set(impls)
    return [i for i in known if i in names] + sorted(names - set(known))


def impl_colors(impls: Iterable[str]) -> dict[str, str]:
    """A ``#rrggbb`` colour for each implementation name (module docstring)."""
    names = set(impls)
    colors = {i: FIXED[i] for i in names & set(FIXED)}
    taken = [to_lab(c) for c in FIXED.values()]
    for name in sorted(names - set(FIXED)):
        nearest = np.min(np.linalg.norm(_CANDIDATE_LAB[:, None, :] - np.array(taken)[None], axis=2), axis=1)
        k = int(np.argmax(nearest))
        colors[name] = CANDIDATES[k]
        taken.append(_CANDIDATE_LAB[k])
    return colors
