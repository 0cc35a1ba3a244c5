"""DeviceExperts: the few experts of a layer kept on the device, dequantized to the model's dtype.

They are computed by the device with torch (``torch_experts.run_experts``) while the CPU engine
works on the rest. The set can change at run time (dynamic re-placement): ``add`` dequantizes an
expert from its CPU-side stored form and copies it over, ``remove`` frees it.
"""

from __future__ import annotations

import torch

from .torch_experts import Activation, ExpertWeights, run_experts


class DeviceExperts:
    def __init__(self, num_experts: int, act: Activation, device: torch.device | str) -> None:
        self.num_experts = num_experts
        self.act = act
        self.device = torch.device(device)
        self._weights: dict[int, ExpertWeights] = {}
        # Tokens each expert processed here: lets tests check every (token, expert) pair runs once.
        self.counts = torch.zeros(num_experts, dtype=torch.int64)

    @property
    def ids(self) -> list[int]:
        return sorted(self._weights)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._weights.values())

    def mask(self) -> torch.Tensor:
        m = torch.zeros(self.num_experts, dtype=torch.bool)
        m[self.ids] = True
        return m

    def add(self, expert: int, weights: ExpertWeights) -> None:
        self._weights[expert] = weights

    def remove(self, expert: int) -> None:
        self._weights.pop(expert, None)

    def __len__(self) -> int:
        return len(self._weights)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This device's share of the layer for ``x [T, H]`` (zeros where no device expert was routed)."""
        return run_experts(x, ids, weights, self._weights.get, self.act, self.counts)
