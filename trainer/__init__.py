"""Training a D3D drafter for a target: target-aligned data, packing collator, losses, `D3DTrainer`, pruning."""
