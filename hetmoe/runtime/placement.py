"""Which experts of each MoE layer live on the device.

A plan maps each MoE layer to the sorted ids of its device experts. The budget is given per layer
(``per_layer``) or for the whole model (``total``); strategies decide how it is spread and filled:

- ``uniform``: the same number in every layer (a total is split evenly, the remainder to the
  first layers); within a layer the most used experts when routing statistics are given, else the
  lowest ids.
- ``frequency``: the most used experts from recorded routing statistics. With a total budget the
  choice is global, by each expert's share of its layer's routed tokens, so layers with
  concentrated routing get more device experts.
- ``front-loading``: the budget spread with weights falling linearly from the first MoE layer to
  the last (early layers' hidden states are the ones later layers wait for).
- ``random``: the same count per layer as uniform, experts drawn with a seeded generator.

``choose_swaps`` is the decision rule of dynamic re-placement: from live counts, which device
experts to trade for hotter CPU ones, with a hysteresis margin so near-equal experts do not
ping-pong between the two sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

STRATEGIES = ("uniform", "frequency", "front-loading", "random")


def plan_placement(
    strategy: str,
    layers: Sequence[int],
    num_experts: int,
    per_layer: int = 0,
    total: int | None = None,
    frequencies: Mapping[int, torch.Tensor] | None = None,
    seed: int = 0,
) -> dict[int, list[int]]:
    """``{layer: sorted device expert ids}`` for every layer in ``layers``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if per_layer < 0 or (total is not None and total < 0):
        raise ValueError(f"expert budgets must be >= 0 (per layer {per_layer}, total {total})")
    if strategy == "frequency" and not frequencies:
        raise ValueError("placement 'frequency' needs routing statistics (record them with record_routing=PATH)")
    layers = list(layers)
    if not layers:
        return {}
    budget = total if total is not None else per_layer * len(layers)
    budget = min(budget, num_experts * len(layers))
    if strategy == "frequency" and total is not None:
        return _global_frequency(layers, num_experts, budget, frequencies or {})
    if strategy == "front-loading":
        counts = _front_loaded(len(layers), num_experts, budget)
    elif total is not None:
        counts = _even(len(layers), num_experts, budget)
    else:
        counts = [min(per_layer, num_experts)] * len(layers)
    gen = torch.Generator().manual_seed(seed)
    plan: dict[int, list[int]] = {}
    for layer, n in zip(layers, counts, strict=True):
        if strategy == "random":
            chosen = torch.randperm(num_experts, generator=gen)[:n].tolist()
        else:
            chosen = _most_used(frequencies.get(layer) if frequencies else None, num_experts, n)
        plan[layer] = sorted(chosen)
    return plan


def _most_used(counts: torch.Tensor | None, num_experts: int, n: int) -> list[int]:
    if counts is None:
        return list(range(n))
    # Stable: among equal counts the lower id wins, so plans are reproducible.
    order = sorted(range(num_experts), key=lambda e: (-float(counts[e]), e))
    return order[:n]


def _even(n_layers: int, cap: int, budget: int) -> list[int]:
    base, extra = divmod(budget, n_layers)
    return [min(cap, base + (1 if i < extra else 0)) for i in range(n_layers)]


def _front_loaded(n_layers: int, cap: int, budget: int) -> list[int]:
    """Integer counts proportional to n_layers, n_layers - 1, ..., 1, capped at ``cap``, summing to budget."""
    weights = [float(n_layers - i) for i in range(n_layers)]
    counts = [0] * n_layers
    left = budget
    while left > 0:
        open_ = [i for i in range(n_layers) if counts[i] < cap]
        if not open_:
            break
        share = sum(weights[i] for i in open_)
        given = 0
        for i in open_:
            add = min(cap - counts[i], int(left * weights[i] / share))
            counts[i] += add
            given += add
        if given == 0:  # rounding left a remainder: one more each, front first
            for i in open_:
                if left - given == 0:
                    break
                counts[i] += 1
                given += 1
        left -= given
    return counts


def _global_frequency(
    layers: list[int], num_experts: int, budget: int, frequencies: Mapping[int, torch.Tensor]
) -> dict[int, list[int]]:
    scored = []
    for layer in layers:
        counts = frequencies.get(layer)
        if counts is None:
            continue
        total = float(counts.sum()) or 1.0
        scored += [(-float(counts[e]) / total, layer, e) for e in range(num_experts)]
    scored.sort()
    plan: dict[int, list[int]] = {layer: [] for layer in layers}
    for _, layer, e in scored[:budget]:
        plan[layer].append(e)
    return {layer: sorted(ids) for layer, ids in plan.items()}


def choose_swaps(
    counts: torch.Tensor, device_ids: Sequence[int], margin: float = 0.25, min_gain: float = 1.0
) -> list[tuple[int, int]]:
    """``[(leaving, entering)]``: device experts to replace by hotter CPU experts.

    A CPU expert enters only if its count exceeds the device expert's it replaces by the factor
    ``1 + margin`` and by at least ``min_gain``: the hysteresis that keeps two experts of nearly the
    same heat from swapping back and forth at every re-placement.
    """
    on_device = set(device_ids)
    coldest = sorted(on_device, key=lambda e: (float(counts[e]), e))
    hottest = sorted((e for e in range(counts.numel()) if e not in on_device), key=lambda e: (-float(counts[e]), e))
    swaps = []
    for out, inn in zip(coldest, hottest, strict=False):
        c_out, c_in = float(counts[out]), float(counts[inn])
        if c_in > c_out * (1.0 + margin) and c_in - c_out >= min_gain:
            swaps.append((out, inn))
        else:
            break  # both lists are ordered: no later pair can qualify
    return swaps
