"""`d3d gpu-check`: the first thing to run on a GPU machine. Random weights only (nothing is downloaded); about 7
minutes on one H200 (a 475 s budget, then a watchdog's minute); every check runs in its own try/except, so a failing
check is recorded with its traceback summary and the others go on. It prints first the torch and transformers it
found and whether they are in the supported ranges (`modeling_d3d.versions_d3d`). Results go to
`OUTPUT/gpu_check.json` and `OUTPUT/gpu_check.md`, rewritten after every check (a crash or the time-budget watchdog
leaves what was done).

Checks, in the order they run (see docs/gpu-check.md for what each one means):
- environment: versions, devices, the inductor CUDA-graph and TF32 settings;
- identity-float32-{sync,async,cross-device}: tokens against `target.generate` at Qwen3-8B width (2 target layers,
  1 drafter layer), batches of 1 and 3 ragged rows, with and without min_new_tokens / suppress_tokens /
  repetition_penalty; at a mismatch the reference's top-2 margin;
- compile-{sync,async,back-to-back,new-prompts}: compile=True against eager on the same models, CUDA-graph skips
  and recompiles counted from PyTorch's own counters and logs (compile-async before torch 2.13: the engine's
  one-line refusal);
- identity-bfloat16-{sync,async}: the same in bfloat16, each divergence with its margin (near-ties are expected);
- memory-server-8b, overlap-8b, timing-8b: Qwen3-8B shape (36 layers, bf16) with a 31-layer drafter: a
  server-sized engine's allocation against an estimate; the successor pass beside the verify pass; measured engine
  rounds, passes timed with CUDA events, and the round projected at the paper's tau 7.88 (labelled a projection).

`--smoke` runs the environment, float32 identity and overlap checks with tiny shapes (a CPU is enough: the
cross-device drafter then stays beside the target, the overlap's worker shares the CPU; a test runs it).
`--vllm` runs the vLLM checks instead (`d3d.benchmark.gpu_check_vllm`: vLLM alone against vLLM + D3D, in the vLLM
environment named by `--vllm-python`), reported in `OUTPUT/gpu_check_vllm.json` and `.md`.
"""

import argparse
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import transformers

from d3d.common.report import table, write_report
from modeling_d3d.versions_d3d import (COMPILED_ASYNC_TORCH, TORCH_RANGE, TRANSFORMERS_RANGE, release, requirement,
                                       supported)

from .gpu_check_identity import (BF16_TIE_TOLERANCE, MODES, back_to_back_check, compile_check, identity_check,
                                 new_prompts_check)
from .gpu_check_models import SMOKE_SHAPES, Context, ModelCache, Shapes, error_summary
from .gpu_check_speed import memory_check, overlap_check, timing_check

STATUSES = ("pass", "fail", "error", "skipped", "measured")


@dataclass
class CheckResult:
    """One check: status (`STATUSES`), a one-line summary, its details, the traceback summary of an error."""

    name: str
    status: str
    seconds: float = 0.0
    summary: str = ""
    details: dict = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Check:
    """A check: its function `(context) -> (status, summary, details)`, the models it uses, the seconds it needs at
    least (skipped when less is left), and whether it needs CUDA."""

    name: str
    function: Callable
    models: tuple[str, ...] = ()
    min_seconds: float = 5.0
    needs_cuda: bool = False


def run_check(check: Check, context: Context) -> CheckResult:
    start = time.monotonic()
    if check.needs_cuda and context.device.type != "cuda":
        return CheckResult(check.name, "skipped", summary="needs CUDA")
    if context.remaining() < check.min_seconds:
        return CheckResult(check.name, "skipped", summary=f"time budget: {context.remaining():.0f} s left, "
                                                           f"needs about {check.min_seconds:.0f} s")
    try:
        context.models.keep_only(check.models)
        status, summary, details = check.function(context)
        result = CheckResult(check.name, status, summary=summary, details=details)
    except Exception as error:  # a failing check is recorded and the others go on (the point of this command)
        result = CheckResult(check.name, "error", summary=type(error).__name__, error=error_summary(error))
    result.seconds = round(time.monotonic() - start, 2)
    return result


def versions_line() -> str:
    """The torch and transformers found, each against its supported range (`modeling_d3d.versions_d3d`)."""
    versions = (("torch", torch.__version__, TORCH_RANGE),
                ("transformers", transformers.__version__, TRANSFORMERS_RANGE))
    found = [(name, version, bounds, supported(version, bounds)) for name, version, bounds in versions]
    parts = [f"{name} {version} ({'in' if ok else 'NOT in'} the supported {requirement(name, bounds)})"
             for name, version, bounds, ok in found]
    if release(torch.__version__) < COMPILED_ASYNC_TORCH:
        parts.append("compile-async expects the engine's refusal (compiled asynchronous drafting on CUDA needs "
                     f"torch>={'.'.join(map(str, COMPILED_ASYNC_TORCH))})")
    return "d3d gpu-check: " + "; ".join(parts)


def environment_check(context: Context):
    details = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "versions": versions_line(),
        "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "check_device": str(context.device), "shapes": asdict(context.shapes),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "inductor_triton_cudagraphs": torch._inductor.config.triton.cudagraphs,
        "inductor_triton_cudagraph_trees": torch._inductor.config.triton.cudagraph_trees,
        "inductor_cudagraph_skip_dynamic_graphs": torch._inductor.config.triton.cudagraph_skip_dynamic_graphs,
        "dynamo_recompile_limit": torch._dynamo.config.recompile_limit,
    }
    if torch.cuda.is_available():
        details["devices"] = [
            {"name": torch.cuda.get_device_name(i),
             "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())
        ]
    names = ", ".join(d["name"] for d in details.get("devices", [])) or "no CUDA device"
    return "pass", f"torch {torch.__version__}, transformers {transformers.__version__}, {names}", details

def all_checks() -> list[Check]:
    """Every check, in the order it runs: the float32 checks (identity, then compile on the same models and
    references), bfloat16 identity, then the 8B-shaped measurements. Each `min_seconds` is what the check took on one
    H200 (2026-12-04, torch 2.11, docs/results.md; model builds included where a check is the first to use them);
    they add up to `DEFAULT_BUDGET_S` at most, so none is skipped for time when each takes what it needs."""
    identity = [Check(f"identity-float32-{mode}", identity_check("float32", mode), ("float32",), least)
                for mode, least in zip(MODES, (25, 20, 55))]
    compiled = [Check("compile-sync", compile_check("sync"), ("float32",), 50, True),
                Check("compile-async", compile_check("async"), ("float32",), 50, True),
                Check("compile-back-to-back", back_to_back_check, ("float32",), 5, True),
                Check("compile-new-prompts", new_prompts_check, ("float32",), 5, True)]
    bf16 = [Check(f"identity-bfloat16-{mode}", identity_check("bfloat16", mode, BF16_TIE_TOLERANCE), ("bfloat16",),
                  least) for mode, least in (("sync", 35), ("async", 20))]
    full = [Check("memory-server-8b", memory_check, ("8b",), 90, True), Check("overlap-8b", overlap_check, ("8b",), 5),
            Check("timing-8b", timing_check, ("8b",), 110, True)]
    return [Check("environment", environment_check), *identity, *compiled, *bf16, *full]


# the checks' least times (one H200, torch 2.11: about 420 s in all, compile-async being a refusal there); with the
# watchdog's minute a run ends within 9 minutes
DEFAULT_BUDGET_S = 475.0
SMOKE_CHECKS = ("environment", "identity-float32-sync", "identity-float32-async", "identity-float32-cross-device",
                "overlap-8b")


def markdown(results: list[CheckResult], header: dict) -> str:
    lines = [f"# {header['title']} ({header['started']}, {header['device']}{', smoke' if header['smoke'] else ''})", ""]
    lines += table(["check", "status", "seconds", "summary"],
                   [[r.name, r.status, r.seconds, (r.error or r.summary).replace("|", "/")] for r in results])
    return "\n".join(lines) + "\n"


class Report:
    """The results so far, rewritten to `NAME.json` and `NAME.md` after every check (thread-safe: the watchdog may
    write the last state)."""

    def __init__(self, folder: Path, header: dict, name: str = "gpu_check"):
        self.folder, self.header, self.name = folder, header, name
        self.results: list[CheckResult] = []
        self.running: str | None = None
        self._lock = threading.Lock()

    def add(self, result: CheckResult) -> None:
        with self._lock:
            self.results.append(result)
            self.running = None
            self._write(self.results)

    def write_timed_out(self, seconds: float) -> None:
        with self._lock:
            results = list(self.results)
            if self.running:
                results.append(CheckResult(self.running, "error", summary=f"still running when the {seconds:.0f} s "
                                                                          "budget ran out; the process was ended"))
            self._write(results)

    def _write(self, results: list[CheckResult]) -> None:
        payload = {**self.header, "checks": [asdict(r) for r in results]}
        write_report(payload, self.folder, self.name, lambda _: markdown(results, self.header))


def run_checks(checks: list[Check], shapes: Shapes, device: torch.device, folder: Path, budget_s: float,
               smoke: bool, name: str = "gpu_check", title: str = "d3d gpu-check",
               setups: dict | None = None) -> list[CheckResult]:
    """Run `checks` in order within `budget_s` seconds, reporting to `folder/NAME.json` and `.md` under `title`;
    `setups`: what the checks share from the start (`Context.setups`). A watchdog ends the process (results
    written) if a running check overruns the budget by a minute."""
    header = {"title": title, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": str(device),
              "smoke": smoke, "budget_s": budget_s}
    report = Report(folder, header, name)
    context = Context(shapes, device, ModelCache(shapes, device), time.monotonic() + budget_s, dict(setups or {}))

    def overrun():
        report.write_timed_out(budget_s)
        print(f"{title}: over the {budget_s:.0f} s budget; results so far in {folder}", flush=True)
        os._exit(1)

    watchdog = threading.Timer(budget_s + 60, overrun)
    watchdog.daemon = True
    watchdog.start()
    try:
        for check in checks:
            print(f"gpu-check: {check.name} ...", flush=True)
            report.running = check.name
            result = run_check(check, context)
            report.add(result)
            print(f"gpu-check: {check.name}: {result.status} ({result.seconds} s) {result.summary}", flush=True)
    finally:
        watchdog.cancel()
        context.models.keep_only(())
    return report.results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the docstring's list of checks
    parser.add_argument("--output", default="gpu-check",
                        help="folder for gpu_check.json and gpu_check.md (with --vllm: gpu_check_vllm.json and .md)")
    parser.add_argument("--smoke", action="store_true",
                        help="only the environment, float32 identity and overlap checks, with tiny shapes (runs on a "
                             "CPU; with --vllm: every vLLM check, tiny float32 models)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for all checks (default 300; 600 with --vllm); a check that would start with "
                             "less than it needs is skipped")
    parser.add_argument("--only", default=None, help="comma-separated check names to run (default: all)")
    for name, help_text in SIZE_OPTIONS.items():
        default = getattr(Shapes(), name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        parser.add_argument(f"--{name.replace('_', '-')}", default=None,
                            metavar="N[,N...]" if name == "timing_rows" else "N", help=f"{help_text} (default {shown})")


SIZE_OPTIONS = {  # Shapes fields settable from the command line (smaller GPUs, quicker runs)
    "max_new_tokens": "new tokens of the identity and compile checks",
    "full_target_layers": "layers of the 8B-shaped target",
    "full_drafter_layers": "layers of the 8B-shaped drafter",
    "prefix": "prompt tokens of the 8B timing checks",
    "timing_rows": "comma-separated batch sizes of the 8B timing check",
    "server_rows": "rows of the memory check's server",
    "server_length": "max_length of the memory check's server",
}


def size_overrides(args: argparse.Namespace) -> dict:
    """The `SIZE_OPTIONS` given, as `Shapes` fields; ValueError (exit 2) unless positive integers."""
    overrides = {}
    for name in SIZE_OPTIONS:
        text = getattr(args, name)
        if text is None:
            continue
        parts = text.split(",") if name == "timing_rows" else [text]
        if not all(part.strip().isdigit() and int(part) > 0 for part in parts):
            raise ValueError(f"--{name.replace('_', '-')} takes positive integers, got {text!r}")
        values = tuple(int(part) for part in parts)
        overrides[name] = values if name == "timing_rows" else values[0]
    return overrides


def choose_checks(only: str | None, smoke: bool) -> list[Check]:
    checks = [c for c in all_checks() if not smoke or c.name in SMOKE_CHECKS]
    if only is None:
        return checks
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    known = {c.name for c in checks}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    return [c for c in checks if c.name in wanted]


def budget_seconds(given: float | None, default: float) -> float:
    """`--budget-s`, or `default` when not given; ValueError (exit 2) unless positive."""
    if given is not None and given <= 0:
        raise ValueError(f"--budget-s must be positive, got {given}")
    return default if given is None else given


def require_cuda(smoke: bool, command: str = "gpu-check") -> None:
    """ValueError (exit 2) naming `d3d COMMAND --smoke` unless a CUDA GPU is visible or `smoke`."""
    if not smoke and not torch.cuda.is_available():
        raise ValueError(f"{command} needs a CUDA GPU (none is visible); on a CPU run `d3d {command} --smoke`")


def run(args: argparse.Namespace) -> int:
    """Returns 0 when no check failed or errored, 1 otherwise; raises ValueError (exit 2) without CUDA and --smoke."""
    require_cuda(args.smoke)
    budget_s = budget_seconds(args.budget_s, DEFAULT_BUDGET_S)
    shapes = replace(SMOKE_SHAPES if args.smoke else Shapes(), **size_overrides(args))
    checks = choose_checks(args.only, args.smoke)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    results = run_checks(checks, shapes, device, Path(args.output), budget_s, args.smoke)
    print((Path(args.output) / "gpu_check.md").read_text())
    return 0 if all(r.status in ("pass", "measured", "skipped") for r in results) else 1

