"""The correctness checks of `d3d gpu-check`: the engine's tokens against `target.generate` (float32 identity,
bfloat16 divergences with their margins) and its compiled passes (what PyTorch compiled, recompiled and refused to
capture as CUDA graphs)."""

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from modeling_d3d.streams_d3d import synchronize
from modeling_d3d.versions_d3d import check_compiled_async

from .gpu_check_models import Context, Shapes, error_summary, forced_head, random_prompts, worst
from .identity import NEAR_TIE

BF16_TIE_TOLERANCE = NEAR_TIE  # a bf16 divergence whose score gap is within this fraction of the top score: a near-tie

MODES = {  # the drafter's block every round (policy=False): these checks exercise drafting, not the verify policy
    "sync": {"policy": False},
    "async": {"asynchronous": True, "policy": False},
    "cross-device": {"asynchronous": True, "drafter_device": "cpu", "coverage": 2, "fanout": 1, "policy": False},
}


def processor_settings(eos: int, suppress: list[int]) -> dict:
    """generate settings whose logits processors the engine must apply as generate does."""
    return {"eos_token_id": eos, "min_new_tokens": 6, "suppress_tokens": suppress, "repetition_penalty": 1.3}


def reference(target, ids, mask, settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own greedy `generate`: sequences `(rows, P + n)` and processed scores `(rows, n, vocab)` (CPU)."""
    output = target.generate(ids, attention_mask=mask, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **settings)
    return output.sequences.cpu(), torch.stack(output.scores, dim=1).float().cpu()


def decode(target, drafter, ids, mask, settings: dict, mode: str, compile: bool = False) -> torch.Tensor:
    """The engine through its front door, the drafter placed on the mode's `drafter_device` for the call (the front
    door checks where the drafter is, it never moves it) and put back after."""
    home = drafter.device
    drafter.to(MODES[mode].get("drafter_device", home))
    try:
        return drafter.generate_batch(target, ids, attention_mask=mask, do_sample=False, compile=compile,
                                      **MODES[mode], **settings).cpu()
    finally:
        drafter.to(home)


def compare(reference_ids: torch.Tensor, scores: torch.Tensor, output: torch.Tensor, prompt_width: int,
            tie_tolerance: float | None = None) -> list[dict]:
    """Per row: the first generated position where `output` leaves the reference (None: identical), the reference's
    top-2 margin there and the score gap between the reference's token and the engine's (both in the reference's
    processed scores). With `tie_tolerance` (relative to the top score) each divergence is called a near-tie or not."""
    rows = []
    for r in range(reference_ids.shape[0]):
        expected, got = reference_ids[r, prompt_width:].tolist(), output[r, prompt_width:].tolist()
        index = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        if index is None and len(expected) != len(got):
            index = min(len(expected), len(got))
        row = {"row": r, "identical": index is None, "first_divergence": index}
        if index is not None and index < scores.shape[1]:
            step = scores[r, index]
            top = step.topk(2).values
            row["reference_top2_margin"] = float(top[0] - top[1])
            row["reference_token"] = expected[index] if index < len(expected) else None
            row["engine_token"] = got[index] if index < len(got) else None
            if row["engine_token"] is not None:
                row["score_gap"] = float(step.max() - step[row["engine_token"]])
            if tie_tolerance is not None:
                row["near_tie"] = row.get("score_gap", float("inf")) <= tie_tolerance * max(1.0, float(top[0].abs()))
        rows.append(row)
    return rows


def stats_summary(drafter) -> dict:
    record = drafter.round_record
    if record is None:
        return {}
    return {"rounds": record.rounds, "tau": round(record.tau, 3), "accepted": dict(sorted(record.accepted.items())),
            "compilations": record.compilations}


@dataclass
class AcceptanceSetup:
    """How a random pair is made to accept some drafts and not others: the drafter always proposes `token`; the
    target's head gets `bias` on it, tuned so that the target produces it at about `fraction` of its greedy
    positions (runs of it end at unpredictable places: rounds accept 0..B-1 drafts)."""

    token: int
    bias: float
    fraction: float

    @contextlib.contextmanager
    def applied(self, target, drafter) -> Iterator[None]:
        with forced_head(target, self.token, self.bias), forced_head(drafter, self.token):
            yield


def token_fraction(target, ids, mask, settings: dict, token: int, bias: float) -> float:
    with forced_head(target, token, bias):
        sequences, _ = reference(target, ids, mask, settings)
    return float((sequences[:, ids.shape[1]:] == token).float().mean())


def calibrate(target, ids, mask, settings: dict, goal: float = 0.75, steps: int = 8) -> AcceptanceSetup:
    """Bisect the bias on the target's most frequent greedy token until it makes about `goal` of the tokens."""
    sequences, scores = reference(target, ids, mask, settings)
    token = int(sequences[:, ids.shape[1]:].reshape(-1).mode().values)
    low, high = 0.0, float(scores.max() - scores.min()) + 1.0
    bias, fraction = high, 1.0
    for _ in range(steps):
        middle = (low + high) / 2
        found = token_fraction(target, ids, mask, settings, token, middle)
        if abs(found - goal) < abs(fraction - goal):
            bias, fraction = middle, found
        if abs(found - goal) <= 0.1:
            break
        low, high = (middle, high) if found < goal else (low, middle)
    return AcceptanceSetup(token, bias, fraction)


@dataclass
class IdentitySetup:
    """What every mode of one dtype shares: the acceptance setup, the EOS of the processor cases, the references."""

    acceptance: AcceptanceSetup
    eos: int
    suppress: list[int]
    references: dict = field(default_factory=dict)


def identity_setup(context: Context, kind: str) -> IdentitySetup:
    """Built once per model kind (the modes reuse it): calibrate, pick an EOS that row 0 produces early (so rows end
    at different rounds), then the reference of every case."""
    if kind in context.setups:
        return context.setups[kind]
    s = context.shapes
    target, drafter = context.models.get(kind)
    ids, mask = random_prompts(list(s.prompt_lengths), s.vocab, context.device, seed=1)
    plain = {"max_new_tokens": s.max_new_tokens, "pad_token_id": 0}
    acceptance = calibrate(target, ids, mask, plain)
    with forced_head(target, acceptance.token, acceptance.bias):
        sequences, _ = reference(target, ids, mask, plain)
    generated = sequences[:, ids.shape[1]:]
    others = [t for t in generated[0].tolist() if t != acceptance.token] or [acceptance.token + 1]
    counts = Counter(generated.reshape(-1).tolist()).most_common()
    frequent = [t for t, _ in counts if t not in (acceptance.token, others[0])]
    setup = IdentitySetup(acceptance, others[0], frequent[:2] or [others[0] + 1])
    with acceptance.applied(target, drafter):
        for batch, with_processors in identity_cases(s):
            ids, mask = random_prompts(list(s.prompt_lengths[:batch]), s.vocab, context.device, seed=1)
            settings = {**plain, **(processor_settings(setup.eos, setup.suppress) if with_processors else {})}
            setup.references[(batch, with_processors)] = (ids, mask, settings, *reference(target, ids, mask, settings))
    context.setups[kind] = setup
    return setup


def identity_cases(shapes: Shapes) -> list[tuple[int, bool]]:
    """(rows, with processors): batch 1 and the ragged batch, plain and with processors."""
    return [(batch, processors) for batch in (1, len(shapes.prompt_lengths)) for processors in (False, True)]


def identity_mode(context: Context, kind: str, mode: str,
                  tie_tolerance: float | None = None) -> tuple[list[dict], dict]:
    """Every case of one mode against its reference (see `identity_setup`)."""
    target, drafter = context.models.get(kind)
    setup = identity_setup(context, kind)
    cases = []
    with setup.acceptance.applied(target, drafter):
        for batch, with_processors in identity_cases(context.shapes):
            case = {"case": f"rows={batch}{' +processors' if with_processors else ''}"}
            try:
                ids, mask, settings, expected, scores = setup.references[(batch, with_processors)]
                output = decode(target, drafter, ids, mask, settings, mode)
                case["rows"] = compare(expected, scores, output, ids.shape[1], tie_tolerance)
                case["round_record"] = stats_summary(drafter)
                ok = [row["identical"] or (tie_tolerance is not None and row.get("near_tie")) for row in case["rows"]]
                case["status"] = "pass" if all(ok) else "fail"
            except Exception as error:
                case.update(status="error", error=error_summary(error))
            cases.append(case)
    return cases, {"acceptance": asdict(setup.acceptance), "eos_with_processors": setup.eos,
                   "suppressed_with_processors": setup.suppress}


def identity_check(kind: str, mode: str, tie_tolerance: float | None = None) -> Callable:
    def check(context: Context):
        cases, extra = identity_mode(context, kind, mode, tie_tolerance)
        status = worst([case["status"] for case in cases])
        diverged = [(case["case"], row) for case in cases for row in case.get("rows", []) if not row["identical"]]
        summary = f"{sum(c['status'] == 'pass' for c in cases)}/{len(cases)} cases pass"
        if diverged:
            margins = ", ".join(f"{name} row {row['row']} @{row['first_divergence']}: margin "
                                f"{row.get('reference_top2_margin', float('nan')):.3g}" for name, row in diverged[:4])
            summary += f"; divergences: {margins}"
        errors = [case["case"] for case in cases if case["status"] == "error"]
        if errors:
            summary += f"; errors in: {', '.join(errors)}"
        return status, summary, {"mode": mode, "dtype": kind, "cases": cases, **extra}
    return check


# ------------------------------------------------------------------------------------------------ compile checks

class CompileWatch:
    """What PyTorch compiled while inside: deltas of `torch._dynamo.utils.counters` (unique graphs, frames, CUDA-graph
    skips) and the recompile, recompile-limit and CUDA-graph-skip messages of dynamo's and inductor's logs."""

    MARKERS = {"recompiles": "Recompiling function", "limit_hits": "hit config.",
               "cudagraph_skips": "skipping cudagraphs"}

    def __init__(self):
        self.messages: dict[str, list[str]] = {key: [] for key in self.MARKERS}
        self.deltas: dict[str, dict[str, int]] = {}
        self._handler = logging.Handler()
        self._handler.emit = self._emit

    def _emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for key, marker in self.MARKERS.items():
            if marker in message:
                self.messages[key].append(" ".join(message.split())[:400])

    def __enter__(self) -> "CompileWatch":
        counters = torch._dynamo.utils.counters
        self._before = {group: dict(values) for group, values in counters.items()}
        torch._logging.set_logs(recompiles=True, perf_hints=True)
        for name in ("torch._dynamo", "torch._inductor"):
            logging.getLogger(name).addHandler(self._handler)
        return self

    def __exit__(self, *exc_info) -> None:
        for name in ("torch._dynamo", "torch._inductor"):
            logging.getLogger(name).removeHandler(self._handler)
        torch._logging.set_logs()
        for group, values in torch._dynamo.utils.counters.items():
            before = self._before.get(group, {})
            changed = {key: value - before.get(key, 0) for key, value in values.items() if value != before.get(key, 0)}
            if changed:
                self.deltas[group] = changed

    @property
    def recompiles(self) -> int:
        return len(self.messages["recompiles"])

    @property
    def cudagraph_skips(self) -> int:
        return self.deltas.get("inductor", {}).get("cudagraph_skips", 0)

    def report(self) -> dict:
        return {"recompiles": self.recompiles, "cudagraph_skips": self.cudagraph_skips,
                "unique_graphs": self.deltas.get("stats", {}).get("unique_graphs", 0),
                "limit_hits": len(self.messages["limit_hits"]), "counter_deltas": self.deltas,
                "messages": {key: values[:8] for key, values in self.messages.items()}}


def finishing_rounds(drafter) -> list[int]:
    """The rounds (1-based) in which rows finished, from the round record's history."""
    record = drafter.round_record
    if record is None:
        return []
    return [i + 1 for i, (outcomes, _) in enumerate(record.history) for outcome in outcomes if outcome.finished]


def ragged_eos(generated: torch.Tensor, forced: int, fallback: int) -> int:
    """An EOS that ends row 0 early and the other rows later or never: the first token of row 0 (other than the
    forced one) that the other rows do not produce before that point, else row 0's first other token."""
    row0 = generated[0].tolist()
    for index, token in enumerate(row0):
        if token != forced and all(token not in row[: index + 1] for row in generated[1:].tolist()):
            return token
    return next((t for t in row0 if t != forced), fallback)


def compiled_call(context: Context, mode: str, lengths: list[int], seed: int) -> dict:
    """One compiled engine call on a batch that ends raggedly (EOS = a token row 0 produces early), against
    `target.generate` and the eager engine, with what PyTorch compiled meanwhile."""
    s = context.shapes
    target, drafter = context.models.get("float32")
    setup = identity_setup(context, "float32")
    ids, mask = random_prompts(lengths, s.vocab, context.device, seed=seed)
    plain = {"max_new_tokens": s.max_new_tokens, "pad_token_id": 0}
    with setup.acceptance.applied(target, drafter):
        first, _ = reference(target, ids, mask, plain)
        settings = {**plain, "eos_token_id": ragged_eos(first[:, ids.shape[1]:], setup.acceptance.token, setup.eos)}
        expected, scores = reference(target, ids, mask, settings)
        eager = decode(target, drafter, ids, mask, settings, mode)
        start = time.perf_counter()
        with CompileWatch() as watch:
            output = decode(target, drafter, ids, mask, settings, mode, compile=True)
            synchronize(context.device)
        seconds = time.perf_counter() - start
    rows = compare(expected, scores, output, ids.shape[1])
    return {"rows_in_batch": len(lengths), "seconds": round(seconds, 2),
            "identical_to_generate": all(row["identical"] for row in rows),
            "identical_to_eager_engine": torch.equal(eager, output), "rows": rows,
            "round_record": stats_summary(drafter), "finishing_rounds": finishing_rounds(drafter), **watch.report()}


def compile_verdict(calls: list[dict], cuda: bool, no_recompiles: bool) -> tuple[str, str]:
    """fail: a mismatch, a CUDA-graph skip on CUDA, a recompile limit hit, or (no_recompiles) any recompile."""
    problems = []
    for i, call in enumerate(calls, 1):
        if not (call["identical_to_generate"] and call["identical_to_eager_engine"]):
            problems.append(f"call {i} not identical")
        if cuda and call["cudagraph_skips"]:
            problems.append(f"call {i}: {call['cudagraph_skips']} cudagraph skips")
        if call["limit_hits"]:
            problems.append(f"call {i}: recompile limit hit (runs eager)")
        if no_recompiles and call["recompiles"]:
            problems.append(f"call {i}: {call['recompiles']} recompiles")
    counts = "; ".join(f"call {i}: {c['seconds']} s, {c['unique_graphs']} graphs, {c['recompiles']} recompiles, "
                       f"{c['cudagraph_skips']} cudagraph skips, rows finished in rounds {c['finishing_rounds']}"
                       for i, c in enumerate(calls, 1))
    return ("fail" if problems else "pass"), "; ".join(problems + [counts])


def compiled_async_refusal(context: Context, reason: str):
    """Where this torch cannot run compiled passes on the drafter's worker thread (`reason`: the refusal
    `versions_d3d.check_compiled_async` words): the engine must refuse compile=True with asynchronous=True in that
    one line, before anything compiles."""
    try:
        compiled_call(context, "async", list(context.shapes.prompt_lengths), seed=1)
    except ValueError as error:
        if str(error) == reason:
            return "pass", f"refused as it must be on torch {torch.__version__}: {reason}", {"refusal": reason}
        raise
    return "fail", f"compile=True with asynchronous=True ran on torch {torch.__version__}; expected: {reason}", {}


def compile_check(mode: str) -> Callable:
    def check(context: Context):
        if mode == "sync":  # the first compile check starts from nothing compiled
            torch._dynamo.reset()
        if mode == "async":
            try:
                check_compiled_async(context.device)
            except ValueError as refusal:
                return compiled_async_refusal(context, str(refusal))
        call = compiled_call(context, mode, list(context.shapes.prompt_lengths), seed=1)
        status, summary = compile_verdict([call], context.device.type == "cuda", no_recompiles=False)
        return status, summary, {"mode": mode, "calls": [call]}
    return check


def back_to_back_check(context: Context):
    """Two calls after the first (compile-sync's) on the same prompts: after a warm-up none may compile again."""
    lengths = list(context.shapes.prompt_lengths)
    calls = [compiled_call(context, "sync", lengths, seed=1) for _ in range(2)]
    status, summary = compile_verdict(calls, context.device.type == "cuda", no_recompiles=True)
    return status, summary, {"calls": calls}


def new_prompts_check(context: Context):
    """Warm calls on prompts of other lengths and batch sizes: a server's traffic; none may compile again."""
    lengths = [length + 37 for length in context.shapes.prompt_lengths]
    calls = [compiled_call(context, "sync", lengths, seed=3), compiled_call(context, "sync", lengths[:1], seed=4)]
    status, summary = compile_verdict(calls, context.device.type == "cuda", no_recompiles=True)
    return status, summary, {"calls": calls}
