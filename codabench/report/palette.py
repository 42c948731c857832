"""One colour per implementation, the same in every plot and table of a report, and no two alike.

The implementations this project knows have fixed colours (:data:`FIXED`), pairwise at least :data:`MIN_DISTANCE`
apart (CIEDE2000 colour difference, :func:`distance`). Any other implementation (a plugin's) takes, in the alphabetical
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
         "hf-coda": "#d62728", "hf-liger": "#e6ab02", "hf-compile": "#006d2c", "hf-eager": "#f781bf",
         "hf-coda-lora": "#7a0010", "hf-liger-lora": "#a6761d", "hf-compile-lora": "#98df8a",
         "hf-eager-lora": "#aec7e8"}
MIN_DISTANCE = 15.0
"""The least CIEDE2000 distance between two implementations' colours (about 1 is a just-noticeable difference; 15
keeps two colours apart in a legend and in a small marker)."""
LIGHTNESS = (30.0, 85.0)
"""The CIELAB L* range of the candidates: lighter ones vanish against the white page, darker ones read as black in a
small marker."""
MIN_CHROMA = 20.0
"""The least CIELAB chroma of a candidate: the greys and near-greys are the baselines'."""


def to_lab(color: str) -> np.ndarray:
    """CIELAB (D65) of a ``#rrggbb`` sRGB colour."""
    rgb = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ linear
    xyz /= np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def distance(a: str, b: str) -> float:
    """The CIEDE2000 colour difference of two ``#rrggbb`` colours."""
    return float(ciede2000(to_lab(a), to_lab(b)))


def ciede2000(lab1: np.ndarray, lab2: np.ndarray) -> np.ndarray:
    """CIEDE2000 between CIELAB colours (arrays broadcast over all but the last axis, which holds L*, a*, b*)."""
    (l1, a1, b1), (l2, a2, b2) = np.moveaxis(lab1, -1, 0), np.moveaxis(lab2, -1, 0)
    c_mean = (np.hypot(a1, b1) + np.hypot(a2, b2)) / 2
    g = 0.5 * (1 - np.sqrt(c_mean ** 7 / (c_mean ** 7 + 25.0 ** 7)))
    a1, a2 = (1 + g) * a1, (1 + g) * a2
    c1, c2 = np.hypot(a1, b1), np.hypot(a2, b2)
    h1, h2 = np.degrees(np.arctan2(b1, a1)) % 360, np.degrees(np.arctan2(b2, a2)) % 360
    chroma = c1 * c2 != 0
    dh = h2 - h1
    dh = np.where(chroma, np.where(dh > 180, dh - 360, np.where(dh < -180, dh + 360, dh)), 0)
    d_hue = 2 * np.sqrt(c1 * c2) * np.sin(np.radians(dh) / 2)
    l_mean, c_mean = (l1 + l2) / 2, (c1 + c2) / 2
    h_sum = h1 + h2
    h_mean = np.where(~chroma, h_sum, np.where(np.abs(h1 - h2) <= 180, h_sum / 2,
                                               np.where(h_sum < 360, (h_sum + 360) / 2, (h_sum - 360) / 2)))
    t = (1 - 0.17 * np.cos(np.radians(h_mean - 30)) + 0.24 * np.cos(np.radians(2 * h_mean))
         + 0.32 * np.cos(np.radians(3 * h_mean + 6)) - 0.20 * np.cos(np.radians(4 * h_mean - 63)))
    rotation = -np.sin(np.radians(60 * np.exp(-((h_mean - 275) / 25) ** 2))) * 2 * np.sqrt(
        c_mean ** 7 / (c_mean ** 7 + 25.0 ** 7))
    dl = (l2 - l1) / (1 + 0.015 * (l_mean - 50) ** 2 / np.sqrt(20 + (l_mean - 50) ** 2))
    dc = (c2 - c1) / (1 + 0.045 * c_mean)
    dhh = d_hue / (1 + 0.015 * c_mean * t)
    return np.sqrt(dl ** 2 + dc ** 2 + dhh ** 2 + rotation * dc * dhh)


def _usable(lab: np.ndarray) -> bool:
    return bool(LIGHTNESS[0] <= lab[0] <= LIGHTNESS[1] and np.hypot(lab[1], lab[2]) >= MIN_CHROMA)


CANDIDATES = [c for c in (f"#{r:02x}{g:02x}{b:02x}" for r in range(0, 256, 51) for g in range(0, 256, 51)
                          for b in range(0, 256, 51)) if _usable(to_lab(c))]
"""The colours a plugin may take: those of the 216 web-safe colours within :data:`LIGHTNESS` and
:data:`MIN_CHROMA`."""
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
        nearest = np.min(ciede2000(_CANDIDATE_LAB[:, None, :], np.array(taken)[None]), axis=1)
        k = int(np.argmax(nearest))
        colors[name] = CANDIDATES[k]
        taken.append(_CANDIDATE_LAB[k])
    return colors
