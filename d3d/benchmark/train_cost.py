"""What a D3D training step costs: time, packed tokens per second and peak memory of one forward + backward of the
training losses on randomly initialised drafters of real shapes (no download: only costs matter, not weights).

Two loss paths on the same batch: `full-logits` (every packed position's logits, upcast to float32, as the losses were
before they read hidden states; kept here as the baseline and as the tests' reference) and `hidden-states`
(`d3d.trainer.d3d_trainer.d3d_loss_terms`: logits only at supervised positions, a chunk at a time, each chunk's
gradients formed in the forward pass). Peak memory is the step's own: CUDA `max_memory_allocated` above what was
allocated before the step; CPU the process's peak resident set (`VmHWM`, reset through `/proc/self/clear_refs`) above
its resident set before the step. Gradients are freed before each step, so their allocation is part of the peak
(`gradient_bytes`: the parameters' gradients after the step); optimizer states are not measured (see `projection`).
"""

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from d3d.common.host_memory import release_freed_memory
from d3d.common.report import table, write_report
from d3d.trainer.collator import D3DCollator
from d3d.trainer.d3d_trainer import d3d_loss_terms
from d3d.trainer.losses import DFLASH_GAMMA, IGNORE_INDEX, LOGITS_CHUNK_ELEMENTS, adjust_teacher, position_weights
from modeling_d3d import D3DForBlockDiffusion
from modeling_d3d.streams_d3d import synchronize

from .random_models import random_drafter

LOSS_PATHS = ("full-logits", "hidden-states")


@dataclass(frozen=True)
class TrainShape:
    """A drafter (Qwen3 shape) and one batch: `batch` rows of `prompt + response` tokens with `anchors` blocks."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    prompt: int
    response: int
    anchors: int
    block: int
    batch: int

    @property
    def packed_positions(self) -> int:
        """Positions of one packed training sequence: the shared part and the K blocks."""
        return self.prompt + self.response + self.anchors * self.block

    def config(self) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, tie_word_embeddings=self.tied, max_position_embeddings=32768,
        )


# `d3d bench-train` adds the quickstart's own drafter (`d3d.cli.bench_train.drafter_shapes`).
SHAPES = {
    "tiny": TrainShape(32, 64, 2, 4, 2, 8, 96, False, 8, 24, 6, 4, 2),
    # Qwen3-8B's vocabulary, width and layer shape with one layer; a 2k-token response and K = 64.
    "qwen3-8b-vocab": TrainShape(4096, 12288, 1, 32, 8, 128, 151936, False, 128, 2048, 64, 16, 1),
}
# The paper's recipe (D3D-8B from Qwen3-8B, K = 128, global batch 16 on 8 GPUs: 2 sequences per device).
PAPER_8B = TrainShape(4096, 12288, 36, 32, 8, 128, 151936, False, 128, 4096, 128, 16, 2)


def random_drafter_of(shape: TrainShape, device: str, dtype: torch.dtype, attn: str = "sdpa") -> D3DForBlockDiffusion:
    """A D3D drafter of `shape` with random weights, built on `device` in `dtype`."""
    config = shape.config()
    config._attn_implementation = attn
    return random_drafter(config, device, dtype, shape.block, shape.vocab - 1, seed=0).train()


def random_batch(shape: TrainShape, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    examples = [
        {"prompt": torch.randint(0, shape.vocab - 1, (shape.prompt,), generator=generator).tolist(),
         "completion": torch.randint(0, shape.vocab - 1, (shape.response,), generator=generator).tolist()}
        for _ in range(shape.batch)
    ]
    batch = D3DCollator(block_size=shape.block, num_anchors=shape.anchors, seed=seed)(examples)
    return {name: value.to(device) for name, value in batch.items()}


def full_logits_loss_terms(model, inputs: dict[str, torch.Tensor], gamma: float, ar_weight: float, teacher=None,
                           kl_margin: float = 0.01) -> dict[str, torch.Tensor]:
    """The losses as they were before they read hidden states: logits at every packed position, upcast to at least
    float32, the supervised ones picked by their labels. Same terms as `d3d_loss_terms`."""
    packed = {name: inputs[name] for name in ("input_ids", "anchors", "attention_mask") if name in inputs}
    outputs = model(**packed)
    block_labels, ar_labels = inputs["block_labels"], inputs["ar_labels"]
    wide = torch.promote_types(outputs.diffusion_logits.dtype, torch.float32)
    diffusion_logits = outputs.diffusion_logits.to(wide)
    weights = position_weights(block_labels.shape[-1], gamma, block_labels.device, wide) * (block_labels != IGNORE_INDEX)
    nll = F.cross_entropy(diffusion_logits.flatten(0, -2), block_labels.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none").view_as(block_labels)
    terms = {"diffusion": (nll * weights).sum() / weights.sum().clamp_min(1e-12),
             "ar": F.cross_entropy(outputs.ar_logits.to(wide).flatten(0, -2), ar_labels.flatten(), ignore_index=IGNORE_INDEX)}
    terms["loss"] = terms["diffusion"] + ar_weight * terms["ar"]
    if teacher is not None:
        with torch.no_grad():
            teacher_logits = teacher(**packed).diffusion_logits.to(wide)
        adjusted = adjust_teacher(teacher_logits.softmax(-1), block_labels.clamp_min(0), kl_margin)
        kl = (adjusted * (adjusted.clamp_min(1e-30).log() - diffusion_logits.log_softmax(-1))).sum(-1)
        terms["kl"] = (kl * weights).sum() / weights.sum().clamp_min(1e-12)
        terms["loss"] = terms["loss"] + terms["kl"]
    return terms


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """The peak memory a block of work adds (bytes): CUDA allocator peak, or the CPU process's peak resident set."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            release_freed_memory()  # the resident set is then the memory in use, whatever the allocator kept
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set (Linux)
            self.base = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = _status_bytes("VmHWM") - self.base
        return False


@dataclass
class StepCost:
    shape: str
    loss_path: str
    gradient_checkpointing: bool
    layers: int
    packed_positions: int
    seconds: float
    tokens_per_second: float
    peak_bytes: int
    gradient_bytes: int
    loss: float


def step_costs(name: str, shape: TrainShape, loss_paths: list[str], device: str, dtype: torch.dtype, repeats: int,
               gradient_checkpointing: bool = False, autocast: bool = False) -> list[StepCost]:
    """Per loss path: the median seconds and the largest peak memory of `repeats` forward + backward steps (after one
    warm-up step each when `repeats > 1`) on one random drafter and batch of `shape`, the paths interleaved step by
    step so that a busy machine slows each alike."""
    model = random_drafter_of(shape, device, dtype).train()
    if gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    batch = random_batch(shape, device)
    target = torch.device(device)

    def step(path: str) -> float:
        losses = full_logits_loss_terms if path == "full-logits" else d3d_loss_terms
        with torch.autocast(target.type, dtype=torch.bfloat16, enabled=autocast):
            loss = losses(model, batch, DFLASH_GAMMA, 1.0)["loss"]
        loss.backward()
        return loss.item()

    if repeats > 1:
        for path in loss_paths:
            model.zero_grad(set_to_none=True)
            step(path)
    times, peaks, losses = ({path: [] for path in loss_paths} for _ in range(3))
    gradient_bytes = {}
    for _ in range(max(repeats - 1, 1)):
        for path in loss_paths:
            model.zero_grad(set_to_none=True)
            with PeakMemory(target) as memory:
                start = time.perf_counter()
                losses[path].append(step(path))
                synchronize(target)
                times[path].append(time.perf_counter() - start)
            peaks[path].append(memory.peak)
            gradient_bytes[path] = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    positions = shape.packed_positions * shape.batch
    costs = []
    for path in loss_paths:
        seconds = sorted(times[path])[len(times[path]) // 2]
        costs.append(StepCost(name, path, gradient_checkpointing, shape.layers, positions, seconds, positions / seconds,
                              max(peaks[path]), gradient_bytes[path], losses[path][-1]))
    return costs


def parameter_count(shape: TrainShape) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3ForCausalLM(shape.config()).parameters())


def _bytes_saved(model: D3DForBlockDiffusion, batch: dict[str, torch.Tensor], autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward pass of the training losses (nothing
    is run backward)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    device = next(model.parameters()).device
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        del d3d_loss_terms(model, batch, DFLASH_GAMMA, 1.0)["loss"]
    return sum(storages.values())


def layer_activation_bytes(shape: TrainShape, device: str, dtype: torch.dtype, autocast: bool = False) -> float:
    """What one more decoder layer keeps for backward per packed position (bytes, no gradient checkpointing), counted
    rather than inferred from memory peaks: the storages autograd saves in forward passes at `shape.layers` and one
    more layer, each with one and with two sequences of `shape`. The double difference keeps only what grows with
    both depth and positions: weights and their autocast copies, and what the layers share (the attention mask, the
    rotary tables, the embedding output, the loss's buffers), cancel."""
    one = replace(shape, batch=1)
    saved = {}
    for layers in (one.layers, one.layers + 1):
        model = random_drafter_of(replace(one, layers=layers), device, dtype).train()
        for rows in (1, 2):
            batch = random_batch(replace(one, layers=layers, batch=rows), device)
            saved[layers, rows] = _bytes_saved(model, batch, autocast)
    deeper, shallower = one.layers + 1, one.layers
    grown = (saved[deeper, 2] - saved[deeper, 1]) - (saved[shallower, 2] - saved[shallower, 1])
    return grown / one.packed_positions


def projection(costs: list[StepCost], layer_bytes: float, measured: TrainShape, itemsize: int,
               paper: TrainShape = PAPER_8B, chunk_elements: int = LOGITS_CHUNK_ELEMENTS) -> dict:
    """Per-device memory of the paper's recipe, projected from per-position figures at `measured`'s width.

    `layer_bytes`: one layer's activations per packed position (`layer_activation_bytes`). With gradient checkpointing
    a layer keeps its input (`itemsize * hidden` per position) and one layer at a time is recomputed. Logits: the
    full-logits step's measured peak less the hidden-states step's, per position (when both were measured). Weights
    and gradients in bf16, 8-bit AdamW: 2 + 2 + 2 bytes per parameter. `itemsize`: bytes per element of the measured
    steps' parameters."""
    def rows(path):
        return {c.layers: c for c in costs if c.loss_path == path and not c.gradient_checkpointing}

    plain_rows, full_rows = rows("hidden-states"), rows("full-logits")
    positions = measured.packed_positions * measured.batch
    both = sorted(set(plain_rows) & set(full_rows))
    logits_per_position = ((full_rows[both[0]].peak_bytes - plain_rows[both[0]].peak_bytes) / positions
                           if both else None)
    kept = itemsize * measured.hidden
    parameters = parameter_count(paper)
    paper_positions = paper.packed_positions * paper.batch
    states = {"weights (bf16)": 2 * parameters, "gradients (bf16)": 2 * parameters, "8-bit AdamW states": 2 * parameters}
    activations = {"activations, no checkpointing": layer_bytes * paper.layers * paper_positions,
                   "activations, gradient checkpointing": (kept * paper.layers + layer_bytes) * paper_positions}
    logits = {"logits, full-logits losses": logits_per_position * paper_positions if logits_per_position else None,
              "logits, hidden-states losses (one chunk, ~4 float32 copies)": 4 * 4 * chunk_elements}
    return {"parameters": parameters, "paper_positions_per_device": paper_positions, "states": states,
            "activations": activations, "logits": logits, "per_position": {
                "layer_activation_bytes": layer_bytes,
                "layer_activation_method": "counted: storages saved for backward per added layer",
                "checkpointed_layer_bytes": kept, "full_logits_bytes": logits_per_position}}


def cost_table(costs: list[StepCost]) -> str:
    return "\n".join(table(
        ["shape", "loss path", "grad. ckpt", "layers", "packed positions", "step s", "positions/s", "peak GiB",
         "gradients GiB", "loss"],
        [[c.shape, c.loss_path, "yes" if c.gradient_checkpointing else "no", c.layers, c.packed_positions,
          f"{c.seconds:.3f}", f"{c.tokens_per_second:,.0f}", f"{c.peak_bytes / 2**30:.2f}",
          f"{c.gradient_bytes / 2**30:.2f}", f"{c.loss:.4f}"] for c in costs]))


def projection_table(result: dict, paper: TrainShape = PAPER_8B) -> str:
    """Totals against 80 GB and 141 GB devices, replicated (DDP) and with states sharded over 8 devices."""
    gb = 1e9
    states = sum(result["states"].values())
    lines = [
        f"PROJECTION (not measured): D3D-8B ({result['parameters'] / 1e9:.2f}B parameters, {paper.layers} layers), "
        f"K = {paper.anchors}, {paper.prompt}-token prompt + {paper.response}-token response, {paper.batch} sequences "
        f"per device ({result['paper_positions_per_device']} packed positions), global batch 16 on 8 GPUs; per packed "
        f"position: one layer's activations {result['per_position']['layer_activation_bytes'] / 1e3:.1f} kB "
        f"({result['per_position']['layer_activation_method']}), kept per layer under checkpointing "
        f"{result['per_position']['checkpointed_layer_bytes'] / 1e3:.1f} kB, full logits "
        + (f"{result['per_position']['full_logits_bytes'] / 1e6:.2f} MB" if result['per_position']['full_logits_bytes'] else "n/a"),
        ""]
    lines += table(["component", "GB per device"],
                   [[name, "n/a" if value is None else f"{value / gb:.1f}"]
                    for name, value in {**result["states"], **result["activations"], **result["logits"]}.items()])
    configurations = []
    for sharded in (False, True):
        state_bytes = states / 8 if sharded else states
        for activation_name, activation in result["activations"].items():
            for logits_name, logits in result["logits"].items():
                if activation is None or logits is None:
                    continue
                total = state_bytes + activation + logits
                label = (f"{'states sharded /8 (ZeRO-3/FSDP: not run by d3d train today)' if sharded else 'DDP'}, "
                         f"{activation_name.split(', ')[1]}, {logits_name.split(', ')[1].split(' (')[0]}")
                configurations.append([label, f"{total / gb:.1f}", "yes" if total < 80 * gb else "no",
                                       "yes" if total < 141 * gb else "no"])
    return "\n".join(lines + [""] + table(["configuration", "GB", "fits 80 GB", "fits 141 GB"], configurations))


def write(costs: list[StepCost], projected: dict | None, output: Path) -> None:
    """`bench-train.json` and `bench-train.md` (the cost table, and the projection if any) in `output`."""
    write_report({"steps": [asdict(c) for c in costs], "projection": projected}, output, "bench-train",
                 lambda _: cost_table(costs) + ("\n\n" + projection_table(projected) if projected else "") + "\n")


__all__ = ["LOSS_PATHS", "PAPER_8B", "SHAPES", "PeakMemory", "StepCost", "TrainShape", "cost_table",
           "full_logits_loss_terms", "layer_activation_bytes", "projection", "projection_table", "random_batch",
           "random_drafter_of", "step_costs", "write"]
