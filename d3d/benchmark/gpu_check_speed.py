"""The speed and memory checks of `d3d gpu-check` at Qwen3-8B shape: engine rounds measured with acceptance forced by
biased heads, passes timed with CUDA events, the round projected at the paper's tau, the successor pass beside the
verify pass, and a server-sized engine's allocation against an estimate."""

import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from d3d.common.measure import timed
from modeling_d3d import speculative_generate
from modeling_d3d.streams_d3d import Clock, Fence, handoff, seconds, side_stream, synchronize, use_stream

from .gpu_check_identity import MODES
from .gpu_check_models import PAPER_TAU, Context, Shapes, forced_head, random_prompts, release_memory


@dataclass
class PassShape:
    """A forward pass to time: `rows` x `width` new tokens after a `prefix`-token cache, keeping `keep` logits."""

    rows: int
    width: int
    prefix: int
    keep: int


class PassTimer:
    """A model with a `prefix`-token DynamicCache per row count, passes of `width` tokens after it timed with CUDA
    events (the cache is cropped back after each). The mask is an explicit boolean 4D mask, as the engine passes."""

    def __init__(self, model, shape: PassShape, device: torch.device, seed: int = 0):
        self.model, self.shape, self.device = model, shape, device
        generator = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size - 1
        prefix_ids = torch.randint(0, vocab, (shape.rows, shape.prefix), generator=generator).to(device)
        self.ids = torch.randint(0, vocab, (shape.rows, shape.width), generator=generator).to(device)
        self.positions = (shape.prefix + torch.arange(shape.width, device=device)).expand(shape.rows, -1)
        columns = torch.arange(shape.prefix + shape.width, device=device)
        self.mask = (columns[None, :] <= self.positions[0, :, None])[None, None].expand(shape.rows, 1, -1, -1)
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prefix_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)

    def tensors(self) -> list[torch.Tensor]:
        """What a pass reads: its inputs, mask and every layer's cached keys and values."""
        cached = [t for layer in self.cache.layers for t in (layer.keys, layer.values) if t is not None]
        return [self.ids, self.positions, self.mask, *cached]

    @torch.no_grad()
    def run(self) -> torch.Tensor:
        """One pass `(rows, keep, vocab)` float32 logits; the cache is back at the prefix after it."""
        output = self.model(input_ids=self.ids, position_ids=self.positions,
                            attention_mask={"full_attention": self.mask}, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=self.shape.keep)
        self.cache.crop(-self.shape.width)
        return output.logits.float()

    def milliseconds(self, repeats: int = 8) -> float:
        """Median time of one pass (CUDA events on CUDA), after two warm-up passes."""
        clock = Clock(self.device)
        times = []
        for i in range(repeats + 2):
            start = clock.mark()
            self.run()
            if i >= 2:
                times.append(1e3 * seconds(start, clock.mark()))
        return statistics.median(times)


def pass_shapes(shapes: Shapes, rows: int, tau: float) -> dict[str, tuple[str, PassShape]]:
    """The engine's passes at the timing shape: target alone (1 token), verify (B), block draft (the tokens accepted
    last round + B), successor (2B causal + ((C-1)F + 1) blocks), each with its model."""
    b, p = shapes.block_size, shapes.prefix
    blocks = (shapes.coverage - 1) * shapes.fanout + 1
    return {
        "target_step": ("target", PassShape(rows, 1, p, 1)),
        "verify": ("target", PassShape(rows, b, p, b)),
        "block_draft": ("drafter", PassShape(rows, b + round(tau), p, b - 1)),
        "successor": ("drafter", PassShape(rows, 2 * b + blocks * b, p, blocks * b)),
    }


def record_split(record, seconds: float) -> dict:
    """ms per round (verify / exposed / hidden / host: the engine's own round record), tokens per row per round, and
    tokens/s over the call's wall time `seconds` (prefill included, as for `generate`)."""
    rounds = max(record.rounds, 1)
    return {"rounds": record.rounds, "tau": round(record.tau, 3),
            "verify_ms": round(1e3 * record.verify_seconds / rounds, 3),
            "exposed_draft_ms": round(1e3 * record.exposed_draft_seconds / rounds, 3),
            "hidden_draft_ms": round(1e3 * record.hidden_draft_seconds / rounds, 3),
            "host_ms": round(1e3 * record.host_seconds / rounds, 3),
            "round_ms": round(1e3 * record.seconds / rounds, 3),
            "tokens_per_s": round(record.new_tokens / seconds, 1)}


def engine_tau(target, drafter, ids, mask, settings: dict, token: int, bias: float) -> float:
    """Tokens per row per round of the synchronous engine with `token` biased by `bias` (drafter forced to it)."""
    with forced_head(target, token, bias), forced_head(drafter, token):
        drafter.generate_batch(target, ids, attention_mask=mask, policy=False, **settings)
    return drafter.round_record.tau


def calibrate_tau(target, drafter, ids, mask, settings: dict, token: int, goal: float = PAPER_TAU,
                  steps: int = 7) -> tuple[float, float]:
    """Bisect the target's bias on `token` until the engine accepts about `goal` tokens a round: (bias, tau)."""
    low, high = 0.0, 64.0
    best = (high, engine_tau(target, drafter, ids, mask, settings, token, high))
    if best[1] < goal:
        return best
    for _ in range(steps):
        middle = (low + high) / 2
        tau = engine_tau(target, drafter, ids, mask, settings, token, middle)
        if abs(tau - goal) < abs(best[1] - goal):
            best = (middle, tau)
        if abs(tau - goal) <= 0.4:
            break
        low, high = (middle, high) if tau < goal else (low, middle)
    return best


def timing_rows(context: Context, rows: int) -> dict:
    """Measured: `generate`, the engine alone, D3D sync/async with the random drafter (tau about 1; the drafter's
    block every round, and sync with the default verify policy) and with the acceptance forced to about tau 7.88
    (biased heads); projected: the round from CUDA-event pass times at 7.88."""
    s, device = context.shapes, context.device
    target, drafter = context.models.get("8b")
    ids, mask = random_prompts([s.prefix] * rows, s.vocab, device, seed=5)
    n = s.timing_new_tokens
    settings = {"max_new_tokens": n, "do_sample": False, "pad_token_id": 0}

    def greedy(tokens: int) -> dict:
        return {**settings, "attention_mask": mask, "max_new_tokens": tokens}

    def generate_without_cudnn(tokens: int):  # cuDNN's attention builds a plan for every new length (shapes_d3d)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return target.generate(ids, **greedy(tokens))

    methods = {  # each measured call, by its name in the report, taking max_new_tokens
        "generate": lambda tokens: target.generate(ids, **greedy(tokens)),
        "generate_without_cudnn_attention": generate_without_cudnn,
        "engine_alone": lambda tokens: target.generate(ids, custom_generate=speculative_generate, **greedy(tokens)),
        **{f"{mode}_random_drafter": lambda tokens, mode=mode: drafter.generate_batch(target, ids, **greedy(tokens),
                                                                                      **MODES[mode])
           for mode in ("sync", "async")},
        # the front door's default, the verify policy: with a drafter that keeps nothing it should run as the target
        "sync_random_drafter_policy": lambda tokens: drafter.generate_batch(target, ids, **greedy(tokens)),
    }
    for method in methods.values():  # warm-up: every method's first call (allocations, kernels, the worker)
        method(4)
    out = {"rows": rows, "prefix": s.prefix, "new_tokens": n}
    measured = {}
    for name, method in methods.items():
        seconds = timed(partial(method, n), device)[1]
        if name in ("generate", "generate_without_cudnn_attention", "engine_alone"):
            out[f"{name}_tokens_per_s"] = round(rows * n / seconds, 1)
        else:
            measured[name] = record_split(drafter.round_record, seconds)
    # speedups are against the target at its fastest: torch's default attention backends or without cuDNN's
    fastest = out["target_fastest_tokens_per_s"] = max(out["generate_tokens_per_s"],
                                                       out["generate_without_cudnn_attention_tokens_per_s"])
    measured["sync_random_drafter_policy"]["speedup_vs_generate"] = round(
        measured["sync_random_drafter_policy"]["tokens_per_s"] / fastest, 2)
    token = 7
    forced = {**settings, "max_new_tokens": 8 * s.block_size}
    bias, tau = calibrate_tau(target, drafter, ids, mask, {**settings, "max_new_tokens": 4 * s.block_size}, token)
    out["forced_acceptance"] = {"label": "measured with biased heads on random weights", "token": token,
                                "bias": round(bias, 3), "calibrated_tau": round(tau, 3)}
    with forced_head(target, token, bias), forced_head(drafter, token):
        for mode in ("sync", "async"):
            seconds = timed(lambda: drafter.generate_batch(target, ids, attention_mask=mask, **forced,
                                                                    **MODES[mode]), device)[1]
            split = record_split(drafter.round_record, seconds)
            split["speedup_vs_generate"] = round(split["tokens_per_s"] / fastest, 2)
            measured[f"{mode}_forced_tau"] = split
    out["engine_measured"] = measured
    models = {"target": target, "drafter": drafter}
    passes = {name: round(PassTimer(models[model], shape, device).milliseconds(), 3)
              for name, (model, shape) in pass_shapes(s, rows, PAPER_TAU).items()}
    release_memory()
    out["pass_ms_cuda_events"] = passes
    host = measured["sync_forced_tau"]["host_ms"]
    rounds = {"sync": passes["block_draft"] + passes["verify"] + host,
              "async_all_hits": passes["verify"] + host,
              "async_all_misses": passes["block_draft"] + passes["verify"] + host}
    out["projection_tau_7_88"] = {
        "label": "projection: CUDA-event pass times + the engine's measured host ms a round, at the paper's tau 7.88",
        **{f"{name}_round_ms": round(ms, 3) for name, ms in rounds.items()},
        **{f"{name}_tokens_per_s": round(rows * PAPER_TAU / ms * 1e3, 1) for name, ms in rounds.items()},
        **{f"{name}_speedup_vs_generate": round(rows * PAPER_TAU / ms * 1e3 / fastest, 2)
           for name, ms in rounds.items()},
    }
    return out


def timing_check(context: Context):
    results = []
    for rows in context.shapes.timing_rows:
        if context.remaining() < 30:
            results.append({"rows": rows, "skipped": "time budget"})
            continue
        results.append(timing_rows(context, rows))
    summary = "; ".join(
        f"rows {r['rows']}: generate {r['generate_tokens_per_s']} tok/s "
        f"({r['generate_without_cudnn_attention_tokens_per_s']} without cuDNN attention), "
        f"engine alone {r['engine_alone_tokens_per_s']}, "
        f"random drafter with the verify policy {r['engine_measured']['sync_random_drafter_policy']['tokens_per_s']}, "
        f"forced tau {r['engine_measured']['sync_forced_tau']['tau']}: sync "
        f"{r['engine_measured']['sync_forced_tau']['tokens_per_s']} / async "
        f"{r['engine_measured']['async_forced_tau']['tokens_per_s']} tok/s measured; at tau 7.88 sync "
        f"{r['projection_tau_7_88']['sync_tokens_per_s']} / async "
        f"{r['projection_tau_7_88']['async_all_hits_tokens_per_s']}"
        f" tok/s (projection)" for r in results if "skipped" not in r)
    return "measured", summary, {"per_rows": results}


def overlapped_ms(verify: PassTimer, successor: PassTimer, device: torch.device, worker: ThreadPoolExecutor,
                  side) -> float:
    """One verify pass on this thread's stream beside one successor pass submitted from `worker` on stream `side`, as
    the engine does: ms from before both to after both. The successor's inputs and cache were made on this thread's
    stream, so they are handed off to `side` (`record_stream`): else the allocator reuses their memory for the
    verify pass while the side stream still reads them."""
    clock = Clock(device)
    begin, start = clock.mark(), Fence(device, "the overlap's start").record()

    def on_side() -> Fence:
        with use_stream(side):
            start.wait()
            handoff(successor.tensors(), side)
            successor.run()
            return Fence(device, "the successor pass").record()

    pending = worker.submit(on_side)
    verify.run()
    pending.result(timeout=120).wait()
    return 1e3 * seconds(begin, clock.mark())


def overlap_check(context: Context):
    """The successor pass (C, F) submitted from a worker thread on its own stream, as the engine does, beside the
    verify pass on the default stream: overlap = (t_verify + t_successor - t_both) / min(t_verify, t_successor)."""
    s, device = context.shapes, context.device
    target, drafter = context.models.get("8b")
    rows = max(s.timing_rows)
    shapes = pass_shapes(s, rows, PAPER_TAU)
    verify = PassTimer(target, shapes["verify"][1], device)
    successor = PassTimer(drafter, shapes["successor"][1], device)
    alone = {"verify_ms": verify.milliseconds(), "successor_ms": successor.milliseconds()}
    side = side_stream(device)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-check-worker") as worker:
        both = [overlapped_ms(verify, successor, device, worker, side) for _ in range(10)][2:]
    together = statistics.median(both)
    overlap = (alone["verify_ms"] + alone["successor_ms"] - together) / min(alone.values())
    details = {"rows": rows, "coverage": s.coverage, "fanout": s.fanout, **{k: round(v, 3) for k, v in alone.items()},
               "together_ms": round(together, 3), "overlap_fraction": round(overlap, 3)}
    verdict = "overlaps" if overlap >= 0.5 else "mostly serialised" if overlap < 0.2 else "partly overlaps"
    return "measured", (f"successor {alone['successor_ms']:.1f} ms beside verify {alone['verify_ms']:.1f} ms: "
                        f"{together:.1f} ms together, overlap {overlap:.0%} ({verdict})"), details


def cache_bytes(config, slots: int, columns: int) -> int:
    """Keys and values of a static cache: 2 x layers x slots x kv_heads x columns x head_dim elements."""
    return 2 * config.num_hidden_layers * slots * config.num_key_value_heads * columns * config.head_dim


def memory_check(context: Context):
    """A D3DBatchServer of `server_rows` x `server_length` (async, C and F) with both 8B-shaped models, one short
    request per row; peak allocation above the weights against caches + the successor pass's logits."""
    s, device = context.shapes, context.device
    target, drafter = context.models.get("8b")
    element = torch.finfo(target.dtype).bits // 8
    blocks = (s.coverage - 1) * s.fanout + 1
    estimate = {
        "target_cache": cache_bytes(target.config, s.server_rows, s.server_length + s.block_size) * element,
        "drafter_cache": cache_bytes(drafter.config, s.server_rows,
                                     s.server_length + 1 + (blocks + 3) * s.block_size) * element,
        # raw logits in the model dtype, then float32 twice (the float copy and the processed one)
        "successor_logits": s.server_rows * blocks * s.block_size * s.vocab * (element + 8),
    }
    weights = sum(p.numel() * p.element_size() for m in (target, drafter) for p in m.parameters())
    synchronize(device)
    release_memory()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    prompt_length = min(s.prefix, s.server_length // 2)
    ids, _ = random_prompts([prompt_length] * s.server_rows, s.vocab, "cpu", seed=6)
    # policy=False: every round drafts, so the peak holds the successor pass's logits
    with drafter.batch_server(target, max_batch_size=s.server_rows, asynchronous=True, coverage=s.coverage,
                              fanout=s.fanout, max_length=s.server_length, policy=False) as server:
        handles = [server.submit(row.tolist(), max_new_tokens=2 * s.block_size) for row in ids]
        for handle in handles:
            handle.result(timeout=300)
        synchronize(device)
        held = torch.cuda.memory_allocated(device) - base
    peak = torch.cuda.max_memory_allocated(device) - base
    total = sum(estimate.values())
    gib = lambda n: round(n / 2**30, 2)  # noqa: E731
    details = {"weights_gib": gib(weights), "allocated_before_gib": gib(base), "held_by_server_gib": gib(held),
               "peak_above_weights_gib": gib(peak), "estimate_gib": {k: gib(v) for k, v in estimate.items()},
               "estimate_total_gib": gib(total), "peak_over_estimate": round(peak / total, 2),
               "device_total_gib": gib(torch.cuda.get_device_properties(device).total_memory)}
    status = "pass" if peak <= 1.5 * total else "fail"
    return status, (f"weights {gib(weights)} GiB; server peak {gib(peak)} GiB above them vs estimate {gib(total)} GiB "
                    f"(x{peak / total:.2f})"), details
