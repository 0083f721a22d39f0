"""What a drafter folder says about how it was made (`d3d_training.json`), for its model card."""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROVENANCE = "d3d_training.json"


@dataclass
class DrafterProvenance:
    """target: the model it drafts for; base_model: what its weights were initialised from; training_data and
    recipe: what it learned from and how (None: not recorded); layers_before_pruning / pruning_stages: acceptance-guided pruning;
    dtype: what it was trained in and why, e.g. `"float32 (cpu without native bf16)"`."""

    target: str | None
    base_model: str | None
    training_data: str | None
    recipe: dict = field(default_factory=dict)
    layers_before_pruning: int | None = None
    pruning_stages: int = 0
    dtype: str | None = None

    def save(self, folder: str | Path) -> None:
        (Path(folder) / PROVENANCE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, folder: str | Path) -> "DrafterProvenance | None":
        """The folder's provenance, or None when it has none."""
        path = Path(folder) / PROVENANCE
        return cls(**json.loads(path.read_text())) if path.exists() else None


def _depth(folder: str | Path) -> int:
    return json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]


def record_pruning(source: str | Path, pruned: str | Path) -> None:
    """Give the pruned drafter in `pruned` the provenance of `source`, plus the layers pruning removed (one a stage)."""
    provenance = DrafterProvenance.load(source) or DrafterProvenance(None, None, None)
    before, after = _depth(source), _depth(pruned)
    provenance.layers_before_pruning = provenance.layers_before_pruning or before
    provenance.pruning_stages += before - after
    provenance.save(pruned)


__all__ = ["PROVENANCE", "DrafterProvenance", "record_pruning"]
