"""`d3d bench`: every decoding method through one harness in one process (the target's `generate`, the target alone
through the engine, HF assisted generation, prompt lookup, D3D sync / async through the engine, eager and compiled,
and D3D via `assistant_model=`); with `--concurrency 1,4,8,16`, batched D3D against the target's own batched
greedy decoding at each concurrency; with `--engine vllm --concurrency 1,4,16`, vLLM alone, vLLM n-gram and vLLM with
the D3D drafter (real servers, the vLLM environment) beside this project's engine."""

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig

from d3d.benchmark import concurrency, vllm_bench
from d3d.benchmark.bench import COMPILE_CHOICES, benchmark, build_methods
from d3d.common import report
from d3d.common.prompts import encode_prompt
from modeling_d3d import D3DForBlockDiffusion

from d3d.common import dtype

from . import vllm_env
from .errors import UserError
from .inputs import model_source, non_negative_int, positive_float, positive_int, top_p
from .loading import load_target, read_prompts


def parse_grid(text: str | None) -> list[tuple[int, int]] | None:
    """`"4x2,12x2"` -> `[(4, 2), (12, 2)]` (coverage x fanout); `ValueError` for anything else."""
    if not text:
        return None
    items = [item.split("x") for item in text.split(",")]
    if not all(len(parts) == 2 and all(part.strip().isdigit() for part in parts) for parts in items):
        raise ValueError(f"{text!r} is not a list of CxF budgets such as 4x2,12x1")
    return [(int(coverage), int(fanout)) for coverage, fanout in items]


def parse_levels(text: str) -> list[int]:
    """`"1,4,8"` -> `[1, 4, 8]` (positive ints); `ValueError` for anything else."""
    if not all(level.strip().isdigit() and int(level) > 0 for level in text.split(",")):
        raise ValueError(f"--concurrency {text!r} is not a list of positive ints such as 1,4,8")
    return [int(level) for level in text.split(",")]


def prompt_set(name: str) -> list[str]:
    """`humaneval`, `pydoc`, `repetitive` (the embedded sets) or a `.jsonl`/`.txt` file; `ValueError` if none or
    empty."""
    from d3d.common.corpus import humaneval_prompts, pydoc_prompts, repetitive_prompts

    sets = {"humaneval": humaneval_prompts, "pydoc": pydoc_prompts, "repetitive": repetitive_prompts}
    if name in sets:
        return sets[name]()
    if not Path(name).is_file():
        raise ValueError(f"--prompts {name!r} is neither humaneval, pydoc, repetitive nor a file")
    prompts = read_prompts(name)
    if not prompts:
        raise ValueError(f"--prompts {name!r} holds no prompts")
    return prompts


SAMPLING_FLAGS = ("temperature", "top_p", "top_k")


def sampling_settings(args: argparse.Namespace) -> dict | None:
    """The benchmark's sampling (None: greedy): `--sampling generation-config` takes the target's own
    `generation_config.json` (Qwen3's: T=0.6, top_p=0.95, top_k=20), `--do-sample` the flags given."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.sampling == "generation-config":
        if args.do_sample or given:
            raise ValueError("--sampling generation-config takes the target's own settings: drop --do-sample, "
                             "--temperature, --top-p and --top-k, or drop --sampling")
        try:
            config = GenerationConfig.from_pretrained(args.target)
        except OSError as error:
            raise UserError(f"--sampling generation-config: the target has no generation_config.json ({error})") from None
        if not config.do_sample:
            raise UserError("--sampling generation-config: the target's generation config decodes greedily")
        return {"do_sample": True, **{name: getattr(config, name) for name in SAMPLING_FLAGS}}
    if given and not args.do_sample:
        raise ValueError(f"--{'/--'.join(name.replace('_', '-') for name in given)} set without --do-sample")
    return {"do_sample": True, **given} if args.do_sample else None


def check_arguments(args: argparse.Namespace) -> dict[str, list[str]]:
    """Check the cheap inputs before any model loads; returns the prompt texts by set name."""
    parse_grid(args.sweep)
    if args.methods is not None:
        names = [m.name for m in build_methods(None, "assistant", (1, 1), (1, 1), [False, True], sampled=True)]
        unknown = [part for part in args.methods.split(",") if not part or not any(part in n for n in names)]
        if unknown:
            raise ValueError(f"--methods {unknown[0]!r} is part of no method's name; the methods: {'; '.join(names)}")
    if sampling_settings(args) and (args.concurrency or args.engine == "vllm"):
        raise ValueError("sampled decoding is measured in the method comparison, not with --concurrency yet")
    if args.concurrency:
        parse_levels(args.concurrency)
        if len(parse_grid(args.async_budget)) != 1:
            raise ValueError(f"--async-budget {args.async_budget!r} must be one CxF budget")
    if args.engine == "vllm" and not args.concurrency:
        raise ValueError("--engine vllm measures serving: give --concurrency, e.g. 1,4,16")
    texts = {Path(name).stem: prompt_set(name)[: args.num_prompts] for name in args.prompts.split(",")}
    positions = getattr(AutoConfig.from_pretrained(args.target).get_text_config(), "max_position_embeddings", None)
    if positions is not None and args.max_new_tokens >= positions:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} does not fit the target's {positions} positions "
                        "(a prompt and its new tokens must)")
    return texts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=model_source)
    parser.add_argument("--drafter", required=True, type=model_source)
    parser.add_argument("--assistant", default=None, type=model_source, help="an AR assistant for HF assisted generation (optional)")
    parser.add_argument("--prompts", default="humaneval",
                        help="comma-separated: humaneval, pydoc, repetitive (code asked for again) or FILE.jsonl")
    parser.add_argument("--do-sample", action="store_true", help="sample (with --temperature, --top-p, --top-k)")
    parser.add_argument("--temperature", type=positive_float, default=None)
    parser.add_argument("--top-p", type=top_p, default=None)
    parser.add_argument("--top-k", type=non_negative_int, default=None)
    parser.add_argument("--sampling", choices=("generation-config",), default=None,
                        help="generation-config: sample as the target's own generation_config.json says")
    parser.add_argument("--num-prompts", type=positive_int, default=40, help="first N prompts of each set")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--methods", default=None,
                        help="comma-separated parts of method names to measure, e.g. 'D3D sync,lookup' (the target "
                             "alone always runs); default: every method")
    parser.add_argument("--sweep", default=None, help="(C, F) grid for the async sweep, e.g. 4x2,8x1,12x2")
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="also measure the engine with its compiled verify pass: both (eager and compiled), none "
                             "(eager only), auto (both on CUDA, eager only on CPUs, where compiling takes minutes)")
    parser.add_argument("--concurrency", default=None,
                        help="e.g. 1,4,8,16: measure batched D3D against the target's batched greedy decoding at each "
                             "number of concurrent requests (instead of the method comparison)")
    parser.add_argument("--async-budget", default="4x1",
                        help="CxF: coverage x fanout of asynchronous batched drafting with --concurrency (default 4x1)")
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                        help="vllm: vLLM's servers (alone, n-gram, D3D drafter) beside this engine, with --concurrency")
    parser.add_argument("--num-speculative-tokens", type=positive_int, default=None,
                        help="drafts per round for vLLM's speculation (default block_size-1, as D3D's engine drafts)")
    vllm_env.add_argument(parser)
    parser.add_argument("--output", default=None,
                        help="folder for bench.json, bench.md, bench.png (concurrency.* with --concurrency)")
    dtype.add_argument(parser, ". Token identity with the target holds exactly in float32; in bfloat16, verifying "
                               "several tokens in one pass rounds differently from one-token steps, so near-ties can "
                               "flip (for every speculative method)")


def run(args: argparse.Namespace) -> int:
    texts = check_arguments(args)
    python = vllm_env.vllm_python(args.vllm_python) if args.engine == "vllm" else None
    choice = dtype.choose_dtype(args.dtype)
    print(choice)
    target, tokenizer = load_target(args.target, choice.dtype)
    drafter = D3DForBlockDiffusion.from_pretrained(args.drafter, dtype=target.dtype).to(target.device).eval()
    drafter.check_compatibility(target, tokenizer)
    assistant = load_target(args.assistant, dtype=target.dtype)[0].to(target.device) if args.assistant else None
    sets = {name: [torch.tensor([encode_prompt(tokenizer, text)]) for text in prompts] for name, prompts in texts.items()}
    if python is not None:
        return run_vllm(python, target, drafter, sets, args, choice)
    if args.concurrency:
        return run_concurrency(target, drafter, sets, args, choice)
    results = {"dtype": choice.description,
               **benchmark(target, drafter, sets, args.max_new_tokens, assistant, parse_grid(args.sweep),
                          compile=args.compile, sampling=sampling_settings(args),
                          methods_named=args.methods.split(",") if args.methods else None)}
    table = report.write(results, Path(args.output)) if args.output else report.markdown(results)
    print(table)
    lossless = all(row["lossless"] or row["divergences"] == 0  # near-ties of a low-precision run do not fail
                   for s in results["prompt_sets"].values() for row in s["methods"])
    return 0 if lossless else 1


def run_concurrency(target, drafter, sets: dict[str, list[torch.Tensor]], args: argparse.Namespace,
                    choice: dtype.DtypeChoice) -> int:
    """The concurrency benchmark on all prompts of all sets together; 0 if every D3D row equals the baseline's."""
    levels = parse_levels(args.concurrency)
    prompts = [prompt for prompts in sets.values() for prompt in prompts]
    (coverage, fanout), = parse_grid(args.async_budget)
    results = concurrency.concurrency_benchmark(target, drafter, prompts, levels, args.max_new_tokens, coverage, fanout)
    results["prompt_sets"] = list(sets)
    results["dtype"] = choice.description
    table = concurrency.write(results, Path(args.output)) if args.output else concurrency.markdown(results)
    print(table)
    return 0 if all(row[name]["lossless"] for row in results["levels"] for name in ("sync", "async", "server")) else 1


def run_vllm(python: str, target, drafter, sets: dict[str, list[torch.Tensor]], args: argparse.Namespace,
             choice: dtype.DtypeChoice) -> int:
    """vLLM's servers and this project's engine on the same prompts and levels; 0 if every output is lossless."""
    levels = parse_levels(args.concurrency)
    prompts = [prompt for prompts in sets.values() for prompt in prompts]
    (coverage, fanout), = parse_grid(args.async_budget)
    tokens = args.num_speculative_tokens or drafter.config.block_size - 1
    engine = concurrency.concurrency_benchmark(target, drafter, prompts, levels, args.max_new_tokens, coverage, fanout)
    output = Path(args.output) if args.output else Path("d3d-output") / "vllm-bench"
    served = vllm_bench.vllm_benchmark(
        python, str(Path(args.target).resolve()), str(Path(args.drafter).resolve()),
        [prompt[0].tolist() for prompt in prompts], levels, args.max_new_tokens, tokens, choice.name,
        output / "server-logs",
    )
    results = {"requests": len(prompts), "max_new_tokens": args.max_new_tokens, "num_speculative_tokens": tokens,
               "dtype": choice.description, "prompt_sets": list(sets), **vllm_bench.combine(served, engine),
               "engine": engine}
    print(vllm_bench.write(results, output))
    return 0 if all(row["lossless"] for row in results["rows"]) else 1
