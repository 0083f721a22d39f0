"""`d3d train`: train a D3D drafter for a target on its regenerated responses."""

import argparse
import gc
import importlib.util
from pathlib import Path

import torch
from transformers.trainer_utils import get_last_checkpoint

from d3d.trainer.d3d_trainer import D3DTrainer, D3DTrainingArguments
from d3d.trainer.data import load_responses
from d3d.trainer.losses import DFLASH_GAMMA
from d3d.trainer.provenance import DrafterProvenance
from modeling_d3d import D3DForBlockDiffusion

from d3d.common import dtype
from d3d.common.host_memory import keep_freed_memory_on_cpu
from .errors import UserError
from .inputs import model_source, non_negative_float, positive_float, positive_int
from .loading import load_target

KEPT_CHECKPOINTS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=model_source,
                        help="target model folder or Hub id (its tokenizer is saved too)")
    parser.add_argument("--data", required=True, help="a `d3d generate-data` output folder")
    parser.add_argument("--output", required=True, help="folder for the trained drafter (trust_remote_code)")
    parser.add_argument("--init", default=None, type=model_source,
                        help="Qwen3 checkpoint to initialise from (default: the target)")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--mask-token-id", type=int, default=None)
    parser.add_argument("--epochs", type=positive_float, default=3.0)
    parser.add_argument("--max-steps", type=positive_int, default=None, help="optimizer steps (default: --epochs)")
    parser.add_argument("--save-steps", type=positive_int, default=500,
                        help=f"save a checkpoint every N optimizer steps, OUTPUT/checkpoint-N (the last {KEPT_CHECKPOINTS} "
                             "are kept): weights, optimizer, scheduler, RNG states and the place in the data")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in --output, where an interrupted run left it")
    add_recipe_arguments(parser)


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The optimisation and objective settings shared by `train` and `prune` (its recovery training)."""
    parser.add_argument("--learning-rate", type=positive_float, default=1e-5)
    parser.add_argument("--min-learning-rate", type=non_negative_float, default=1e-6)
    parser.add_argument("--global-batch-size", type=positive_int, default=16)
    parser.add_argument("--per-device-batch-size", type=positive_int, default=1)
    parser.add_argument("--num-anchors", type=positive_int, default=128, help="K: diffusion blocks per example")
    parser.add_argument("--gamma", type=positive_float, default=DFLASH_GAMMA,
                        help="position-weight decay (default: DFlash's value for B=16)")
    parser.add_argument("--ar-weight", type=non_negative_float, default=1.0, help="lambda: weight of the AR loss")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each decoder layer in backward instead of keeping its activations (less memory, "
                             "about one more forward pass of time)")
    parser.add_argument("--attn-implementation", choices=("auto", "sdpa", "eager", "flex_attention"), default="auto",
                        help="attention of the packed training pass: auto = flex_attention on CUDA (the block mask as "
                             "a sparse BlockMask), sdpa elsewhere")
    dtype.add_argument(parser)


def recipe_arguments(args: argparse.Namespace, output_dir: str, max_steps: int, choice: dtype.DtypeChoice,
                     save_steps: int | None = None) -> D3DTrainingArguments:
    """The paper's recipe: cosine lr to a floor, 1% warmup, no weight decay, clip 1, 8-bit AdamW on GPUs; bf16
    autocast exactly when `choice` is bfloat16. A checkpoint in `output_dir` every `save_steps` steps (None: none)."""
    saving = ({"save_strategy": "steps", "save_steps": save_steps, "save_total_limit": KEPT_CHECKPOINTS}
              if save_steps is not None else {"save_strategy": "no"})
    on_gpu = torch.cuda.is_available()
    eight_bit = on_gpu and importlib.util.find_spec("bitsandbytes") is not None
    training_args = D3DTrainingArguments(
        output_dir=output_dir,
        num_train_epochs=args.epochs,
        max_steps=max_steps,
        per_device_train_batch_size=args.per_device_batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": args.min_learning_rate},
        warmup_steps=0.01,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=choice.bf16,
        optim="adamw_bnb_8bit" if eight_bit else "adamw_torch",
        num_anchors=args.num_anchors,
        gamma=args.gamma,
        ar_weight=args.ar_weight,
        attn_implementation=args.attn_implementation,
        activation_checkpointing=args.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=10,
        **saving,
        report_to=[],
        seed=args.seed,
        use_cpu=not on_gpu,
    )
    per_step = args.per_device_batch_size * training_args.world_size
    training_args.gradient_accumulation_steps = max(1, args.global_batch_size // per_step)
    return training_args


def _as_recorded(model: str) -> str:
    """A Hub id as given; a local folder as its absolute path (so no one mistakes it for a Hub id later)."""
    return str(Path(model).resolve()) if Path(model).exists() else model


def checkpoint_to_resume(output: str, resume: bool) -> str | None:
    """The last `checkpoint-N` of `output` with `resume`, else None; refused (`UserError`) when `resume` finds none,
    and when a fresh run would train into an earlier run's checkpoints (rotating them out would delete them)."""
    last = get_last_checkpoint(output) if Path(output).is_dir() else None
    if resume and last is None:
        raise UserError(f"--resume: {output} holds no checkpoint-N folder to continue from")
    if not resume and last is not None:
        raise UserError(f"{output} holds {Path(last).name} of an earlier run: pass --resume to continue it, or choose "
                        "another --output")
    return last


def run(args: argparse.Namespace) -> int:
    dataset = load_responses(args.data)  # a wrong --data fails before the target loads
    checkpoint = checkpoint_to_resume(args.output, args.resume)
    keep_freed_memory_on_cpu()
    choice = dtype.choose_dtype(args.dtype)
    print(choice)
    target, tokenizer = load_target(args.target, choice.dtype, device_map="cpu" if not torch.cuda.is_available() else None)
    drafter = D3DForBlockDiffusion.from_backbone(
        args.init or target, block_size=args.block_size, mask_token_id=args.mask_token_id, tokenizer=tokenizer
    )
    del target
    max_steps = args.max_steps if args.max_steps is not None else -1  # -1: transformers trains for --epochs
    training_args = recipe_arguments(args, args.output, max_steps, choice, args.save_steps)
    trainer = D3DTrainer(drafter, training_args, train_dataset=dataset)
    result = trainer.train(resume_from_checkpoint=checkpoint)
    if trainer.is_world_process_zero():
        trainer.accelerator.unwrap_model(trainer.model).save_pretrained(args.output)
        tokenizer.save_pretrained(args.output)
        batch = trainer.args.per_device_train_batch_size
        global_batch = batch * trainer.accelerator.num_processes * trainer.args.gradient_accumulation_steps
        DrafterProvenance(
            target=_as_recorded(args.target), base_model=_as_recorded(args.init or args.target),
            training_data=f"{len(trainer.train_dataset)} target-regenerated responses from `{args.data}`",
            recipe={"steps": result.global_step, "global batch": global_batch, "learning rate": args.learning_rate,
                    "loss": f"L_diff (gamma {args.gamma}) + {args.ar_weight} L_AR", "anchors per example": args.num_anchors},
            dtype=choice.description,
        ).save(args.output)
        print(
            f"trained {result.global_step} steps on {trainer.accelerator.num_processes} process(es), global batch "
            f"{global_batch}; final loss "
            f"{result.training_loss:.4f}; drafter saved to {args.output}"
        )
    leave_process_group(trainer)
    return 0


def leave_process_group(trainer: D3DTrainer) -> None:
    """End distributed training in an order that cannot deadlock: a last barrier (every process waits for the save),
    then the DDP-wrapped model is released, then the process group is destroyed, all while this function holds the
    barrier's work.

    Why: gloo's worker threads free a finished collective's tensors themselves, which takes the GIL, and gloo's
    barrier keeps every collective still in flight when it was issued (here the trainer's last gather, whose tensors
    Python made) until the barrier itself is freed. Destroying the process group joins those threads while holding
    the GIL; had a worker not yet let go of the barrier, it would wait for the GIL and the join for it, forever (this
    hung `accelerate launch` on loaded CPUs). Holding the barrier's work until the group is gone means no worker
    frees it: this thread does, after the join."""
    if not torch.distributed.is_initialized():
        trainer.accelerator.end_training()
        return
    last = torch.distributed.barrier(async_op=True)
    last.wait()
    trainer.model_wrapped = None  # the DDP wrapper: its reducer holds the process group too
    trainer.accelerator.free_memory()
    gc.collect()
    trainer.accelerator.end_training()  # the last reference: the group and its threads end here
    del last
