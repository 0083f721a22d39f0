"""The recipe a quickstart folder is made with: its `sizes.json` (the sizes, the time plan, each stage's seconds),
chosen by the folder's first run (`budget.fit`) and kept by every rerun, so that resumed stages match finished ones."""

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .budget import scaled
from .sizes import QuickstartSizes

RECIPE = "sizes.json"
PLAN_KEYS = ("scale", "time_budget_seconds", "unit_costs", "projected_seconds")  # what it says of the time plan


@dataclass
class Recipe:
    """The sizes a folder's stages run with, their time plan (`PLAN_KEYS`; `scale` 1.0: the sizes as given) and each
    finished stage's wall seconds (in the run that did it)."""

    sizes: QuickstartSizes
    plan: dict = field(default_factory=lambda: {"scale": 1.0})
    seconds: dict[str, float] = field(default_factory=dict)

    def write(self, output: Path, dtype: str) -> None:
        """Write `output/sizes.json` whole or not at all (a run killed while writing leaves the previous one)."""
        scratch = output / f".{RECIPE}.partial"
        scratch.write_text(json.dumps({"dtype": dtype, **asdict(self.sizes), **self.plan, "seconds": self.seconds},
                                      indent=2))
        os.replace(scratch, output / RECIPE)

    @contextmanager
    def stage(self, name: str, output: Path, dtype: str) -> Iterator[None]:
        """Time the stage `name` and record its seconds in `output/sizes.json` as soon as it finishes."""
        start = time.monotonic()
        yield
        self.seconds[name] = round(time.monotonic() - start, 1)
        self.write(output, dtype)


def recorded_recipe(output: Path, base: QuickstartSizes) -> Recipe | None:
    """The recipe `output/sizes.json` records (a folder from before the time plan: scale 1.0), None where there is
    none; `ValueError` where it is unreadable or not `base` at its recorded scale (a folder of another recipe, such as
    `--micro` into a folder of the default one)."""
    path = output / RECIPE
    if not path.exists():
        return None
    try:
        recorded = json.loads(path.read_text())
        sizes = QuickstartSizes.from_dict(recorded)
    except (json.JSONDecodeError, TypeError) as error:
        raise ValueError(f"{path} is not a quickstart recipe ({error}): use another --output") from None
    plan = {"scale": 1.0, **{key: recorded[key] for key in PLAN_KEYS if key in recorded}}
    if scaled(base, plan["scale"]) != sizes:
        raise ValueError(f"{output} holds a quickstart of other sizes ({path}): use another --output, or the same "
                         "options as its first run")
    return Recipe(sizes, plan, dict(recorded.get("seconds", {})))


__all__ = ["PLAN_KEYS", "RECIPE", "Recipe", "recorded_recipe"]
