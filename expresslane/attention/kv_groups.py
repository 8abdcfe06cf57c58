"""Which KV-cache slab each attention layer uses, when layers differ in their sliding window."""

from __future__ import annotations

import math


def layer_groups(windows: list[int | None]) -> tuple[list[int], list[int], tuple[int | None, ...]]:
    """KV groups of equal size g (the gcd of the layer counts of each window): each layer's group
    and slab (its index in the group: every group's j-th layer shares slab j, so a block id names
    the same bytes in every group), and each group's window. One group when every layer has the
    same window::

        windows [W, W, W, W, W, None]  ->  g 1, groups 0..5, slabs all 0
        windows [W, None, W, None]     ->  g 2, groups [0, 1, 0, 1], slabs [0, 0, 1, 1]
    """
    counts = {w: windows.count(w) for w in windows}  # one entry a window, in order of first use
    g = math.gcd(*counts.values()) if counts else 1
    first_group, group_windows = {}, []
    for w, count in counts.items():
        first_group[w] = len(group_windows)
        group_windows += [w] * (count // g)
    group_of, slab_of, seen = [], [], dict.fromkeys(counts, 0)
    for w in windows:
        group_of.append(first_group[w] + seen[w] // g)
        slab_of.append(seen[w] % g)
        seen[w] += 1
    return group_of, slab_of, tuple(group_windows) or (None,)
