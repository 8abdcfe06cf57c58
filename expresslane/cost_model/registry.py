"""Which step-cost model the engine gets."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from expresslane.cost_model.base import StepCostModel
from expresslane.cost_model.piecewise import NominalStepCostModel, PiecewiseStepCostModel


def make_cost_model(choice: str | StepCostModel, max_tokens: int,
                    calibrate: Callable[[], StepCostModel]) -> StepCostModel:
    """A model handed in (as given), "calibrate", "nominal", or a JSON file (`to_dict`'s, fixed)."""
    if isinstance(choice, StepCostModel):
        return choice
    if choice == "calibrate":
        return calibrate()
    if choice == "nominal":
        return NominalStepCostModel(max_tokens)
    try:
        model = PiecewiseStepCostModel.from_dict(json.loads(Path(choice).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--step-cost-model {choice!r}: not calibrate, nominal or a readable JSON file of a "
                         f"step-cost model ({type(e).__name__}: {e})") from None
    model.refit_every = 0
    return model
