"""Acceptance-guided progressive layer pruning with distillation recovery (docs/method.md, the paper's section 3.3).

Repeat: measure τ on the selection set with each remaining layer removed; remove the layer whose removal costs
least; recover with `L_rec` from the fixed, unpruned teacher; re-measure τ and decoding speedup on the disjoint
checkpoint set. Stop at `min_layers` or when τ falls below `min_tau_fraction` of the unpruned τ. The chosen
drafter is the stage with the best measured speedup.
"""

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from d3d.common.measure import MethodRun, acceptance_length, decode_one
from d3d.common.report import pyplot, save_figure, table, write_report
from modeling_d3d.generation_d3d import speculative_generate

from .d3d_trainer import D3DTrainer, D3DTrainingArguments

MIN_TAU_FRACTION = 0.95  # stop pruning once τ falls below this fraction of the unpruned drafter's
MAX_NEW_TOKENS = 128  # tokens decoded per dev prompt when τ and speedup are measured


@dataclass
class PruningStage:
    depth: int
    removed_layer: int | None
    tau: float
    tokens_per_second: float
    speedup: float
    path: str


def drop_layer(drafter, index: int):
    """A copy of `drafter` without decoder layer `index` (config and cache indices updated)."""
    pruned = copy.deepcopy(drafter)
    del pruned.model.layers[index]
    for position, layer in enumerate(pruned.model.layers):
        layer.self_attn.layer_idx = position
    pruned.config.num_hidden_layers -= 1
    pruned.config.layer_types = pruned.config.layer_types[: pruned.config.num_hidden_layers]
    return pruned


def decoding_speed(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int) -> tuple[float, float, float]:
    """(τ, D3D tokens/s, speedup over the target alone at its fastest) on `prompts`: D3D through the engine with the
    drafter's block every round (`policy=False`, so stages compare as drafters, not as the verify policy's choices),
    the target alone through plain `generate` and through the engine, interleaved per prompt."""
    generate, alone, d3d = MethodRun("target generate"), MethodRun("target alone, engine"), MethodRun("d3d")
    for prompt in tqdm(prompts, desc="speed", leave=False):
        decode_one(target, prompt, max_new_tokens, generate)
        decode_one(target, prompt, max_new_tokens, alone, custom_generate=speculative_generate, drafter=None)
        decode_one(target, prompt, max_new_tokens, d3d, custom_generate=speculative_generate, drafter=drafter,
                   policy=False)
    fastest = max(generate.tokens_per_second, alone.tokens_per_second)
    return d3d.tau, d3d.tokens_per_second, d3d.tokens_per_second / fastest


def prune(
    drafter,
    target,
    train_dataset,
    selection_prompts: list[torch.Tensor],
    checkpoint_prompts: list[torch.Tensor],
    output_dir: str | Path,
    recovery_args: D3DTrainingArguments,
    min_layers: int = 1,
    min_tau_fraction: float = MIN_TAU_FRACTION,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[PruningStage]:
    """Prune `drafter` layer by layer; writes `stage-<depth>/`, `drafter/` (the chosen one) and the report."""
    output = Path(output_dir)
    teacher = drafter.eval()
    stages = [_record(target, teacher, checkpoint_prompts, max_new_tokens, output / f"stage-{_depth(teacher)}", None)]
    current = teacher
    while _depth(current) > min_layers:
        costs = [
            acceptance_length(target, drop_layer(current, i).eval(), selection_prompts, max_new_tokens, f"without {i}")
            for i in range(_depth(current))
        ]
        removed = max(range(len(costs)), key=lambda i: costs[i])
        candidate = drop_layer(current, removed)
        args = copy.deepcopy(recovery_args)
        args.output_dir = str(output / f"recovery-{_depth(candidate)}")
        D3DTrainer(candidate.train(), args, teacher_model=teacher, train_dataset=train_dataset).train()
        stage = _record(target, candidate.eval(), checkpoint_prompts, max_new_tokens, output / f"stage-{_depth(candidate)}", removed)
        stages.append(stage)
        current = candidate
        if stage.tau < min_tau_fraction * stages[0].tau:
            break
    best = max(stages, key=lambda stage: stage.speedup)
    type(drafter).from_pretrained(best.path).save_pretrained(output / "drafter")
    report_stages(stages, best, output)
    return stages


def _depth(drafter) -> int:
    return drafter.config.num_hidden_layers


def _record(target, drafter, prompts, max_new_tokens, path: Path, removed: int | None) -> PruningStage:
    drafter.save_pretrained(path)
    tau, tokens_per_second, speedup = decoding_speed(target, drafter, prompts, max_new_tokens)
    return PruningStage(_depth(drafter), removed, tau, tokens_per_second, speedup, str(path))


def report_stages(stages: list[PruningStage], chosen: PruningStage, output: Path) -> None:
    """`pruning.json`, `pruning.md` (a table of depth, τ, speedup) and `pruning.png`."""
    rows = [[f"{s.depth}{' (chosen)' if s is chosen else ''}", "-" if s.removed_layer is None else s.removed_layer,
             f"{s.tau:.2f}", f"{s.tokens_per_second:.1f}", f"{s.speedup:.2f}x"] for s in stages]
    write_report({"stages": [asdict(s) for s in stages], "chosen": chosen.depth}, output, "pruning",
                 lambda _: "\n".join(table(["depth", "removed layer", "τ", "tok/s", "speedup"], rows)) + "\n",
                 lambda _, path: plot_stages(stages, path))


def plot_stages(stages: list[PruningStage], path: Path) -> None:
    """τ and speedup against the drafter's depth."""
    plt = pyplot()
    figure, tau_axis = plt.subplots(figsize=(6, 3.5))
    depths = [s.depth for s in stages]
    tau_axis.plot(depths, [s.tau for s in stages], "o-", color="tab:blue", label="τ")
    tau_axis.set_xlabel("drafter layers")
    tau_axis.set_ylabel("τ", color="tab:blue")
    tau_axis.invert_xaxis()
    speed_axis = tau_axis.twinx()
    speed_axis.plot(depths, [s.speedup for s in stages], "s--", color="tab:orange")
    speed_axis.set_ylabel("speedup over target", color="tab:orange")
    tau_axis.set_title("Acceptance-guided pruning")
    save_figure(figure, path)


__all__ = ["PruningStage", "decoding_speed", "drop_layer", "prune", "report_stages"]
