"""The worker of a plan launch (:func:`conftest.train_plan`): train each config of the plan one after the other in
this process group, as ``distaccum train``'s workers do (the components instantiated here, the public Trainer)."""

from __future__ import annotations

import sys
from typing import Any

from conftest import plan_worker


def train(values: dict[str, Any]) -> None:
    from distaccum.config import from_mapping
    from distaccum.preflight import instantiate_components
    from distaccum.trainer import Trainer

    cfg = from_mapping(values)
    Trainer.of(cfg, instantiate_components(cfg), check_components=False).fit()


if __name__ == "__main__":
    plan_worker(sys.argv[1], train)
