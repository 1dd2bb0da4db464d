"""Compute dtypes and the dynamic loss scaler used with fp16."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DynamicLossScaler:
    """Scales the loss so fp16 gradients do not underflow; backs off when they overflow.

    A step whose gradients contain inf/NaN (on any rank) is skipped and the scale is
    multiplied by ``backoff_factor``; after ``growth_interval`` clean steps it grows.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    clean_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if key in self.__dataclass_fields__:
                setattr(self, key, value)


def needs_loss_scaling(dtype: torch.dtype) -> bool:
    return dtype == torch.float16
