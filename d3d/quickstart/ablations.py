"""The paper's training ablations at the quickstart's scale, on a finished (or running) quickstart's target, assistant
and data: drafters trained with the same budget for lambda (the AR loss weight), pretrained (the assistant) or random
initialisation and the number of anchors K, each evaluated by tau on the same held-out prompts, with the spread over
prompts (standard error of the per-prompt tau, and the seed-to-seed range when `--seeds` has more than one).

    python -m d3d.quickstart.ablations --quickstart d3d-output --output d3d-output/ablations --steps 150

With `--pruning-curve DEPTH`, instead: the paper's pruning curve, a DEPTH-layer drafter started from the target's own
first layers (as D3D-8B starts from Qwen3-8B), trained, then pruned layer by layer with recovery down to one layer,
tau and measured speedup per depth (`pruning/pruning.md`, `pruning.png`).

Writes `ablations.json` and `ablations.md` into `--output` (never into the quickstart folder).
"""

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3ForCausalLM

from d3d.common.dtype import DtypeChoice, add_argument, choose_dtype
from d3d.common.host_memory import keep_freed_memory_on_cpu
from d3d.common.measure import MethodRun, decode_one
from d3d.common.report import table
from d3d.trainer.d3d_trainer import D3DTrainer
from d3d.trainer.data import load_responses
from d3d.trainer.pruning import drop_layer, prune
from modeling_d3d import D3DForBlockDiffusion
from modeling_d3d.generation_d3d import speculative_generate

from .pretrain import drafter_arguments
from .sizes import QuickstartSizes


@dataclass(frozen=True)
class Variant:
    ar_weight: float
    pretrained: bool
    num_anchors: int

    @property
    def name(self) -> str:
        return f"lambda={self.ar_weight:g}, {'pretrained' if self.pretrained else 'random'} init, K={self.num_anchors}"


@dataclass
class VariantResult:
    variant: str
    seed: int
    steps: int
    train_seconds: float
    final_loss: float
    tau: float
    tau_per_prompt: list[float]

    @property
    def standard_error(self) -> float:
        values = self.tau_per_prompt
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1) / len(values))


def quickstart_sizes(quickstart: Path) -> QuickstartSizes:
    """The sizes the quickstart ran with (its `sizes.json`), the drafter's recipe among them."""
    return QuickstartSizes.from_dict(json.loads((quickstart / "sizes.json").read_text()))


def parse_variants(text: str) -> list[Variant]:
    """`"1:pretrained:16,0:pretrained:16"` -> variants (lambda : pretrained|random : K); `ValueError` otherwise."""
    variants = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or parts[1] not in ("pretrained", "random") or not parts[2].isdigit():
            raise ValueError(f"variant {item!r} is not LAMBDA:pretrained|random:K such as 1:pretrained:16")
        variants.append(Variant(float(parts[0]), parts[1] == "pretrained", int(parts[2])))
    return variants


def initial_drafter(quickstart: Path, variant: Variant, block_size: int, tokenizer, seed: int) -> D3DForBlockDiffusion:
    """The assistant's weights as a drafter, or a drafter of the same shape with freshly initialised weights."""
    drafter = D3DForBlockDiffusion.from_backbone(str(quickstart / "assistant"), block_size=block_size,
                                                 tokenizer=tokenizer, dtype=torch.float32)
    if variant.pretrained:
        return drafter
    torch.manual_seed(seed)
    return D3DForBlockDiffusion._from_config(drafter.config, dtype=torch.float32)


def target_prefix_drafter(quickstart: Path, depth: int, block_size: int, tokenizer) -> D3DForBlockDiffusion:
    """A drafter with the target's embedding, first `depth` decoder layers, final norm and head: the paper's drafter
    starts from a pretrained model of its target's size (D3D-8B from Qwen3-8B); this is that start, cut to `depth`."""
    drafter = D3DForBlockDiffusion.from_backbone(str(quickstart / "target"), block_size=block_size,
                                                 tokenizer=tokenizer, dtype=torch.float32)
    if not 1 <= depth <= drafter.config.num_hidden_layers:
        raise ValueError(f"depth {depth}: the target has {drafter.config.num_hidden_layers} layers")
    while drafter.config.num_hidden_layers > depth:
        drafter = drop_layer(drafter, drafter.config.num_hidden_layers - 1)
    return drafter


def pruning_curve(drafter, output: Path, steps: int, train_data, prompts, target, sizes: QuickstartSizes,
                  choice: DtypeChoice) -> str:
    """Train `drafter` (a `target_prefix_drafter`) for `steps`, then prune it layer by layer down to one layer (the
    quickstart's recovery steps per stage; layers chosen on the first half of `prompts`, tau and speedup measured on
    the second half). Writes `output/trained/` and `output/pruning/`; returns the per-depth table (`pruning.md`)."""
    args = drafter_arguments(output / "trained", sizes, steps, choice)
    args.disable_tqdm = True
    D3DTrainer(drafter, args, train_dataset=train_data).train()
    drafter.eval().save_pretrained(output / "trained")
    half = len(prompts) // 2
    prune(drafter, target, train_data, prompts[:half], prompts[half:], output / "pruning",
          drafter_arguments(output / "pruning", sizes, sizes.recovery_steps, choice), min_layers=1,
          min_tau_fraction=0.0, max_new_tokens=sizes.response_tokens)
    return (output / "pruning" / "pruning.md").read_text()


def per_prompt_tau(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int) -> list[float]:
    """τ per prompt, greedy, the drafter's block every round (`policy=False`: the variant's own acceptance)."""
    taus = []
    for prompt in prompts:
        run = MethodRun("d3d")
        decode_one(target, prompt, max_new_tokens, run, custom_generate=speculative_generate, drafter=drafter,
                   policy=False)
        taus.append(run.tau)
    return taus


def run_variant(quickstart: Path, output: Path, variant: Variant, seed: int, steps: int, train_data, prompts,
                target, tokenizer, sizes: QuickstartSizes, choice: DtypeChoice) -> VariantResult:
    drafter = initial_drafter(quickstart, variant, sizes.block_size, tokenizer, seed)
    folder = output / f"lambda{variant.ar_weight:g}-{'pretrained' if variant.pretrained else 'random'}-K{variant.num_anchors}-seed{seed}"
    args = drafter_arguments(folder, sizes, steps, choice)
    args.ar_weight, args.num_anchors, args.seed, args.disable_tqdm = variant.ar_weight, variant.num_anchors, seed, True
    start = time.perf_counter()
    result = D3DTrainer(drafter, args, train_dataset=train_data).train()
    train_seconds = time.perf_counter() - start
    drafter.eval().save_pretrained(folder)
    taus = per_prompt_tau(target, drafter, prompts, sizes.response_tokens)
    run = VariantResult(variant.name, seed, steps, train_seconds, result.training_loss,
                        float(sum(t for t in taus)) / len(taus), taus)
    print(f"{variant.name} seed {seed}: tau {run.tau:.2f} ± {run.standard_error:.2f} (loss {run.final_loss:.3f}, "
          f"{train_seconds:.0f} s)", flush=True)
    return run


def paired_difference(first: list[float], second: list[float]) -> tuple[float, float]:
    """Mean of the per-prompt differences `first - second` and its standard error (the same prompts)."""
    differences = [a - b for a, b in zip(first, second)]
    mean = sum(differences) / len(differences)
    variance = sum((d - mean) ** 2 for d in differences) / max(len(differences) - 1, 1)
    return mean, math.sqrt(variance / len(differences))


def markdown(results: list[VariantResult], prompts: int, steps: int, choice: DtypeChoice) -> str:
    """One row per variant; the last column compares it with the first variant prompt by prompt (seed 0)."""
    lines = [f"{steps} training steps each ({choice.description}), tau on {prompts} held-out prompts (greedy, "
             "float32); ± = standard error over prompts (mean of per-prompt tau); the last column is the per-prompt "
             "(paired) difference from the first variant, ± its standard error", ""]
    first, table_rows = results[0], []
    for name in dict.fromkeys(r.variant for r in results):
        rows = [r for r in results if r.variant == name]
        taus = [r.tau for r in rows]
        difference = ("-" if rows[0] is first else
                      "{:+.2f} ± {:.2f}".format(*paired_difference(rows[0].tau_per_prompt, first.tau_per_prompt)))
        table_rows.append([name, len(rows), f"{sum(taus) / len(taus):.2f}",
                           f"{max(r.standard_error for r in rows):.2f}",
                           f"{min(taus):.2f}..{max(taus):.2f}" if len(rows) > 1 else "-",
                           f"{sum(r.final_loss for r in rows) / len(rows):.3f}",
                           f"{sum(r.train_seconds for r in rows) / len(rows):.0f}", difference])
    columns = ["variant", "seeds", "tau (mean of prompts)", "± s.e.", "seed range", "mean train loss", "train s",
               "minus first"]
    return "\n".join(lines + table(columns, table_rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quickstart", required=True, help="a quickstart output folder (target/, assistant/, data/)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--steps", type=int, default=150, help="training steps of every drafter (the same budget)")
    parser.add_argument("--variants", default=None,
                        help="LAMBDA:pretrained|random:K, comma-separated (default: lambda 1 and 0 from the assistant, "
                             "lambda 1 from random weights, each with the quickstart's K)")
    parser.add_argument("--seeds", default="0", help="training seeds, comma-separated")
    parser.add_argument("--held-out", type=int, default=48, help="last N prompts of the data: evaluation, not training")
    parser.add_argument("--pruning-curve", type=int, default=None, metavar="DEPTH",
                        help="instead of the variants: a DEPTH-layer drafter from the target's first layers, trained "
                             "--steps, pruned to one layer (layers chosen on half the held-out prompts, tau and "
                             "speedup measured on the other half)")
    add_argument(parser, " (of training; tau is always measured in float32)")
    args = parser.parse_args(argv)
    quickstart, output = Path(args.quickstart), Path(args.output)
    if output.resolve().is_relative_to(quickstart.resolve()):
        parser.error("--output must lie outside the quickstart folder")
    if args.pruning_curve is not None and (args.variants is not None or args.seeds != "0"):
        parser.error("--pruning-curve trains one drafter: --variants and --seeds do not apply")
    try:
        sizes = quickstart_sizes(quickstart)
    except OSError as error:
        parser.error(f"--quickstart {quickstart}: not a finished quickstart folder ({error.strerror})")
    k = sizes.num_anchors
    try:
        variants = parse_variants(args.variants or f"1:pretrained:{k},0:pretrained:{k},1:random:{k}")
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError as error:
        parser.error(str(error))
    data = load_responses(quickstart / "data")
    least = 2 if args.pruning_curve is not None else 1  # the curve splits them: layer choice, then tau and speedup
    if not least <= args.held_out < len(data):
        parser.error(f"--held-out {args.held_out}: between {least} and {len(data) - 1} of the data's {len(data)} prompts")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models time steadiest on one thread; restored for a caller in the same process
    try:
        run(parser, args, quickstart, output, sizes, variants, seeds, data)
    finally:
        torch.set_num_threads(threads)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, quickstart: Path, output: Path,
        sizes: QuickstartSizes, variants: list[Variant], seeds: list[int], data: Dataset) -> None:
    """Train and measure the variants (or the pruning curve) that `main` parsed; writes to `output`."""
    keep_freed_memory_on_cpu()
    choice = choose_dtype(args.dtype)
    print(choice)
    tokenizer = AutoTokenizer.from_pretrained(quickstart / "tokenizer")
    target = Qwen3ForCausalLM.from_pretrained(quickstart / "target", dtype=torch.float32).eval()
    train_data = data.select(range(len(data) - args.held_out))
    prompts = [torch.tensor([prompt]) for prompt in data[len(data) - args.held_out:]["prompt"]]
    output.mkdir(parents=True, exist_ok=True)
    if args.pruning_curve is not None:
        try:
            drafter = target_prefix_drafter(quickstart, args.pruning_curve, sizes.block_size, tokenizer)
        except ValueError as error:
            parser.error(f"--pruning-curve: {error}")
        print(pruning_curve(drafter, output, args.steps, train_data, prompts, target, sizes, choice))
        return
    results = []
    for seed in seeds:
        for variant in variants:
            results.append(run_variant(quickstart, output, variant, seed, args.steps, train_data, prompts, target,
                                       tokenizer, sizes, choice))
            (output / "ablations.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    table = markdown(results, len(prompts), args.steps, choice)
    (output / "ablations.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
