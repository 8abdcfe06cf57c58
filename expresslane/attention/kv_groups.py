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
    kinds = list(dict.fromkeys(windows))
    counts = [windows.count(w) for w in kinds]
    g = math.gcd(*counts) if counts else 1
    group_of, slab_of, group_windows, seen = [], [], [], {w: 0 for w in kinds}
    first_group = {}
    for w in kinds:
        first_group[w] = len(group_windows)
        group_windows += [w] * (windows.count(w) // g)
    for w in windows:
        i = seen[w]
        seen[w] += 1
        group_of.append(first_group[w] + i // g)
        slab_of.append(i % g)
    return group_of, slab_of, tuple(group_windows) or (None,)
