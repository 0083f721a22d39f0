"""`D3DTrainer`: a `transformers.Trainer` for D3D drafters (diffusion + AR loss; + distillation for recovery)."""

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from modeling_d3d.masking_d3d import MASK_CAPABLE_ATTENTION

from .collator import D3DCollator
from .losses import DFLASH_GAMMA, LOGITS_CHUNK_ELEMENTS, training_losses


@dataclass
class D3DTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the D3D objective's settings (as TRL's trainers extend it)."""

    num_anchors: int = field(default=128, metadata={"help": "K: anchors (diffusion blocks) sampled per example."})
    gamma: float = field(default=DFLASH_GAMMA, metadata={"help": "Decay of the position weights exp(-(j-1)/gamma)."})
    ar_weight: float = field(default=1.0, metadata={"help": "lambda in L_train = L_diff + lambda * L_AR."})
    kl_margin: float = field(default=0.01, metadata={"help": "delta: margin the adjusted teacher gives the label."})
    logits_chunk_elements: int = field(
        default=LOGITS_CHUNK_ELEMENTS,
        metadata={"help": "Positions x vocabulary entries of the logits formed at once by the losses (chunked LM head)."},
    )
    attn_implementation: str = field(
        default="auto",
        metadata={"help": "Attention for the packed training pass: auto (flex_attention on CUDA, where the block mask "
                          "becomes a sparse BlockMask, sdpa elsewhere; flex has no CPU backward), sdpa, eager or "
                          "flex_attention. The drafter leaves training with its own implementation back."},
    )
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep prompt/completion for the collator."})


def d3d_loss_terms(
    model, inputs: dict[str, torch.Tensor], gamma: float, ar_weight: float, teacher=None, kl_margin: float = 0.01,
    head=None, teacher_head=None, chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> dict[str, torch.Tensor]:
    """One packed forward pass and the loss terms: `loss`, `diffusion`, `ar` and, with a teacher, `kl`.
    `model` may be wrapped (DDP): the packed pass goes through its `forward` (`anchors=...`) and returns final hidden
    states; the losses read `head`'s weight (default: `model.get_output_embeddings()`, pass the unwrapped model's) only
    at supervised positions, `chunk_elements` logits at a time, gradients formed chunk by chunk (`losses.py`).

    `loss = L_diff + ar_weight * L_AR (+ L_KL)`, differentiable; the terms are detached (for logging). Inputs as
    produced by `D3DCollator`."""
    packed = {name: inputs[name] for name in ("input_ids", "anchors", "attention_mask") if name in inputs}
    head = head if head is not None else model.get_output_embeddings()
    outputs = model(**packed, hidden_states_only=True)
    teacher_hidden = None
    if teacher is not None:
        teacher_head = teacher_head if teacher_head is not None else teacher.get_output_embeddings()
        with torch.no_grad():
            teacher_hidden = teacher(**packed, hidden_states_only=True).diffusion_hidden_states
    return training_losses(
        outputs.ar_hidden_states, outputs.diffusion_hidden_states, head, inputs["ar_labels"], inputs["block_labels"],
        gamma, ar_weight, teacher_hidden, teacher_head, kl_margin, chunk_elements,
    )


def training_attention(requested: str, device: torch.device) -> str:
    """`auto`: flex_attention on CUDA (the block mask as a BlockMask, no dense `(positions, positions)` mask), sdpa
    elsewhere (flex attention has no backward on CPUs); anything else as given."""
    if requested == "auto":
        return "flex_attention" if device.type == "cuda" else "sdpa"
    if requested not in MASK_CAPABLE_ATTENTION:
        raise ValueError(f"attn_implementation {requested!r}: use auto, {', '.join(MASK_CAPABLE_ATTENTION)}")
    return requested


class CollatorEpoch(TrainerCallback):
    """Tells the `D3DCollator` which epoch begins (also the one a resumed run continues), so that its anchors depend
    on the example and the epoch only."""

    def __init__(self, collator: D3DCollator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = math.floor(state.epoch or 0)


class D3DTrainer(Trainer):
    """Trains a `D3DForBlockDiffusion` on `{"prompt", "completion"}` token-id datasets.

    With `teacher_model` (the fixed, unpruned drafter) it runs recovery training with `L_rec = L_diff + lambda L_AR +
    L_KL`. Each term is logged separately (`loss_diffusion`, `loss_ar`, `loss_kl`)."""

    def __init__(self, model, args: D3DTrainingArguments, teacher_model=None, data_collator=None, **kwargs):
        if data_collator is None:
            data_collator = D3DCollator(
                block_size=model.config.block_size,
                num_anchors=args.num_anchors,
                pad_token_id=model.config.pad_token_id or 0,
                seed=args.seed,
            )
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        if isinstance(data_collator, D3DCollator):
            self.add_callback(CollatorEpoch(data_collator))
        self.model_accepts_loss_kwargs = False
        self.teacher_model = None
        if teacher_model is not None:
            teacher_model.eval().requires_grad_(False)
            self.teacher_model = self.accelerator.prepare_model(teacher_model, evaluation_mode=True)
        self._term_sums: dict[str, float] = defaultdict(float)
        self._term_steps = 0

    def train(self, *args, **kwargs):
        """Train with `args.attn_implementation`, then give the drafter its own attention back and drop the
        mixed-precision wrapper accelerate put on `forward`: the drafter leaves training exactly as it would load from
        disk (an autocast forward is slower and not what was saved)."""
        own = self.model.config._attn_implementation
        self.model.set_attn_implementation(training_attention(self.args.attn_implementation, self.args.device))
        try:
            output = super().train(*args, **kwargs)
        finally:
            self.model.set_attn_implementation(own)
        self.accelerator.unwrap_model(self.model, keep_fp32_wrapper=False)
        return output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        unwrap = self.accelerator.unwrap_model
        teacher_head = unwrap(self.teacher_model).get_output_embeddings() if self.teacher_model is not None else None
        with self.accelerator.autocast():  # the head runs outside `model.forward`, under the same mixed precision
            terms = d3d_loss_terms(
                model, inputs, self.args.gamma, self.args.ar_weight, self.teacher_model, self.args.kl_margin,
                unwrap(model).get_output_embeddings(), teacher_head, self.args.logits_chunk_elements,
            )
        for name, value in terms.items():
            if name != "loss":
                self._term_sums[f"loss_{name}"] += value.detach().item()
        self._term_steps += 1
        return (terms["loss"], terms) if return_outputs else terms["loss"]

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._term_steps and "loss" in logs:
            logs.update({name: total / self._term_steps for name, total in self._term_sums.items()})
            self._term_sums.clear()
            self._term_steps = 0
        super().log(logs, *args, **kwargs)


__all__ = ["D3DTrainer", "D3DTrainingArguments", "d3d_loss_terms", "training_attention"]
