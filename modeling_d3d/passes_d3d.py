"""One forward pass over rows of a `StaticKVCache`, for the target (verify, prefill) and the drafter alike.

A `PassLayout` says, per row and input column, the token, its rotary position, the cache column it is written to
and what it sees (`masking_d3d.interval_mask`); a `PassLayoutBuilder` writes one span by span (the drafter's block
and successor passes); `run_pass` plans the cache, builds the mask and runs the model (or its `compiled_forward`);
`prefill` commits a prompt to one slot.
"""

import threading
import types
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .caches_d3d import CachePool, StaticKVCache
from .guards_d3d import GUARD_FILTER, model_fingerprint
from .masking_d3d import interval_mask
from .shapes_d3d import attended_columns, fixed_by_default
from .streams_d3d import move, upload
from .versions_d3d import check_torch

check_torch()  # the compiled path's torch (an ImportError naming the supported range)


@dataclass
class PassLayout:
    """Inputs of one pass over rows `0..rows-1`, all `(rows, width)` long on the host: ids, rotary positions, cache
    columns written, and the visibility of each query (see `masking_d3d.interval_mask`)."""

    ids: torch.Tensor
    positions: torch.Tensor
    write_index: torch.Tensor
    prefix_end: torch.Tensor
    own_start: torch.Tensor
    own_end: torch.Tensor

    @classmethod
    def causal(cls, ids: torch.Tensor, starts: torch.Tensor) -> "PassLayout":
        """Every row causal: ids `(rows, width)` at positions `starts[r]..` `(rows,)`, each written at the cache
        column of its position and seeing its prefix (`PassLayoutBuilder.put_causal` for all rows at once)."""
        positions = starts[:, None] + torch.arange(ids.shape[1])
        return cls(ids, positions, positions.clone(), positions + 1, torch.zeros_like(positions),
                   torch.zeros_like(positions))

    @classmethod
    def branched(cls, ids: torch.Tensor, starts: torch.Tensor, split: int) -> "PassLayout":
        """Two branches after one anchor: ids `(rows, width)`, columns `0..split-1` causal from `starts[r]` (the
        anchor and the first branch), columns `split..` a second branch at the positions after the anchor, written
        after the first and seeing the prefix, the anchor and its own tokens before it (not the first branch)."""
        layout = cls.causal(ids, starts)
        second = torch.arange(ids.shape[1] - split)
        layout.positions[:, split:] = starts[:, None] + 1 + second
        layout.prefix_end[:, split:] = starts[:, None] + 1
        layout.own_start[:, split:] = starts[:, None] + split
        layout.own_end[:, split:] = starts[:, None] + split + 1 + second
        return layout

    def padded(self, rows: int) -> "PassLayout":
        """This layout with rows added up to `rows` (fixed shapes): each added row writes its input columns to the
        same cache columns of its (unused) slot and sees only itself."""
        extra, width = rows - self.ids.shape[0], self.ids.shape[1]
        if extra <= 0:
            return self
        columns = torch.arange(width).expand(extra, width)
        added = PassLayout(torch.zeros(extra, width, dtype=torch.long), columns, columns, torch.zeros_like(columns),
                           columns, columns + 1)
        return PassLayout(*(torch.cat([mine, theirs]) for mine, theirs in zip(self.fields(), added.fields())))

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.positions, self.write_index, self.prefix_end, self.own_start, self.own_end

    def kv_length(self) -> int:
        """Columns the pass must attend over: every column it writes or a query sees."""
        return int(torch.maximum(self.write_index.max() + 1, self.prefix_end.max()))

    def sees_every_column(self, kv_length: int) -> bool:
        """Whether each row is one query that sees all of columns `0..kv_length-1` (a plain decoding step of rows of
        one length): its attention then needs no mask."""
        return (self.ids.shape[1] == 1 and bool((self.prefix_end == kv_length).all())
                and bool((self.own_end <= self.own_start).all()))


class PassLayoutBuilder:
    """A `PassLayout` of `rows` rows of `width` input columns, written span by span (`put_causal`, `put_block`,
    `put_padding`; columns left unwritten hold `fill_id` at position 0, write to cache column 0 and see nothing) in
    Python lists, and made tensors in one conversion (`build`): a drafting pass writes a few short spans per row, each
    too small to be worth tensor operations of its own."""

    def __init__(self, rows: int, width: int, fill_id: int):
        self.width = width
        self.ids = [[fill_id] * width for _ in range(rows)]
        self.positions, self.write_index, self.prefix_end, self.own_start, self.own_end = (
            [[0] * width for _ in range(rows)] for _ in range(5))

    def put_causal(self, row: int, column: int, tokens: list[int], start: int) -> None:
        """Tokens at positions `start..` written at the cache columns of their positions, each seeing its prefix."""
        span = self._span(column, len(tokens))
        self.ids[row][span] = tokens
        self.positions[row][span] = self.write_index[row][span] = range(start, start + len(tokens))
        self.prefix_end[row][span] = range(start + 1, start + len(tokens) + 1)

    def put_block(self, row: int, column: int, tokens: list[int], anchor_position: int, cache_column: int) -> None:
        """A block `tokens = [anchor, M, ...]` in scratch columns `cache_column..`, seeing the prefix before its
        anchor and itself."""
        size = len(tokens)
        span = self._span(column, size)
        self.ids[row][span] = tokens
        self.positions[row][span] = range(anchor_position, anchor_position + size)
        self.write_index[row][span] = range(cache_column, cache_column + size)
        self.prefix_end[row][span] = [anchor_position] * size
        self.own_start[row][span] = [cache_column] * size
        self.own_end[row][span] = [cache_column + size] * size

    def put_padding(self, row: int, column: int, count: int, cache_column: int, room: int) -> None:
        """`count` unused input columns from `column`: written to the `room` scratch columns from `cache_column`, in
        turn (a row padded for another row far behind has more padding than room; what padding writes and reads is
        never used), each seeing only the column it writes."""
        span = self._span(column, count)
        columns = [cache_column + k % room for k in range(count)]
        self.write_index[row][span] = self.own_start[row][span] = columns
        self.own_end[row][span] = [c + 1 for c in columns]

    def _span(self, column: int, count: int) -> slice:
        if column < 0 or count < 0 or column + count > self.width:
            raise RuntimeError(f"Input columns {column}..{column + count} are outside a {self.width}-column layout")
        return slice(column, column + count)

    def build(self) -> PassLayout:
        """The layout as `(rows, width)` long tensors on the host."""
        return PassLayout(*torch.tensor([self.ids, self.positions, self.write_index, self.prefix_end, self.own_start,
                                         self.own_end], dtype=torch.long))


@torch.no_grad()
def run_pass(model, cache: StaticKVCache, layout: PassLayout, logits_to_keep: int | torch.Tensor, first_row: int = 0,
             forward=None, tail: torch.Tensor | None = None, float32: bool = True) -> torch.Tensor:
    """One forward of `model` (a target or a drafter) over `layout` on cache rows `first_row..`; returns the logits of
    the last `logits_to_keep` input columns (a host tensor: those input columns, eager passes only), `(rows, kept,
    vocab)`, float32 (or the model's dtype with
    `float32=False`, for callers that only rank them). A pass attends over the columns its rows use
    (`shapes_d3d.attended_columns`); one with fixed shapes over every cache column and every slot (the added rows'
    logits are dropped). `forward`: a `CompiledForward` to use instead; its logits are a copy (a CUDA graph's outputs
    are overwritten by its next replay).
    tail: `(rows, n)` token ids already on a device (a verify pass's drafts), put in the last `n` input columns on the
    device, so they never go through the host.

    The layout goes to the device in one copy (`streams_d3d.upload`), queued without blocking the host."""
    device = cache.device
    rows, fixed = layout.ids.shape[0], fixed_shapes(forward)
    if fixed:
        layout = layout.padded(cache.slots - first_row)
    kv_length = (cache.capacity if fixed
                 else attended_columns(layout.kv_length(), cache.capacity, device, forward is not None))
    fields = upload(torch.stack([layout.ids, layout.positions, layout.write_index, layout.prefix_end,
                                 layout.own_start, layout.own_end]), device)
    ids, positions, write_index, prefix_end, own_start, own_end = fields.unbind(0)
    if forward is not None:  # a compiled pass's inputs, each its own tensor: given views of `fields`, it would guard
        # on `fields`' sizes too, which are not marked dynamic (one more compile at the first new width or cache size)
        ids, positions, write_index = ids.clone(), positions.clone(), write_index.clone()
    if tail is not None:
        ids[:rows, ids.shape[1] - tail.shape[1]:] = move(tail, device)
    cache.plan(ids.shape[0], write_index, kv_length, first_row, forward is not None and not fixed)
    # a plain decoding step attends without a mask, as `generate`'s does (sdpa's unmasked kernel is faster; compiled
    # passes always take one: a mask or none would be two graphs)
    mask = (None if forward is None and layout.sees_every_column(kv_length)
            else interval_mask(model.config, prefix_end, own_start, own_end, kv_length, model.dtype))
    keep = logits_to_keep if isinstance(logits_to_keep, int) else move(logits_to_keep, device)
    if forward is not None and isinstance(keep, int):  # the kept columns as a tensor: its length is a dynamic
        width = ids.shape[1]  # dimension, an int a guard
        keep = torch.arange(width - logits_to_keep, width, device=device)
    output = (forward or model)(
        input_ids=ids, position_ids=positions, attention_mask={"full_attention": mask}, past_key_values=cache,
        use_cache=True, logits_to_keep=keep,
    )
    logits = output.logits[:rows]
    if float32:
        return logits.to(torch.float32, copy=forward is not None)
    return logits.clone() if forward is not None else logits


PASS_KINDS = ("verify", "block", "successor", "prefill")  # prefill: a target's, with dynamic shapes (`prefill`)


def _forward_of(model) -> Callable:
    def pass_forward(**kwargs):
        return model.forward(**kwargs)
    return pass_forward


def pass_function(model, kind: str) -> Callable:
    """`model.forward` behind a function of its own: `pass_forward` with a copy of its code object, named after
    `kind`. Dynamo keeps compiled code, guards and its recompile limit per code object, so each pass kind compiles,
    is cached and (on CUDA) is captured on its own, never sharing a compiled graph with another kind or thread."""
    function = _forward_of(model)
    code = function.__code__.replace(co_name=f"d3d_{kind}_pass", co_qualname=f"d3d_{kind}_pass")
    return types.FunctionType(code, function.__globals__, code.co_name, None, function.__closure__)


@dataclass
class CompiledForward:
    """The forward of one pass kind (`PASS_KINDS`), compiled; with fixed shapes called from one thread (CUDA-graph
    trees keep per-thread state; `threads` records the callers, which tests check).

    The only dimensions of a compiled pass that change are rows, input width, the attended columns and the cache's
    size, marked dynamic up front (`mark_dynamic_inputs`): one compilation serves them all (a
    dimension of size 1 compiles once more: PyTorch specialises 0 and 1). With `fixed_shapes` (CUDA graphs,
    "reduce-overhead") the shapes of a pass kind are fixed besides: rows padded to the cache's slots, drafting
    widths to their largest round, slots and cache sizes bucketed by the caller (`generation_d3d`), so a CUDA graph
    is recorded once per bucket and replayed.

    `one_column`: the verify pass's one-column calls (plain steps), compiled from a code object of their own. In one
    code object dynamo checks the guards of the graph used last first, and a wider graph's guards reject a
    one-column call only at their last check (the width's, after every parameter's): the first plain step after a
    wider round paid a whole failed check (0.5 ms a call on the quickstart's 12-layer target on a CPU, more on a
    deeper model; docs/results.md 2026-12-07). None: every call to `function`."""

    function: Callable
    fixed_shapes: bool
    kind: str = "verify"
    threads: set[threading.Thread] = field(default_factory=set)  # the threads themselves: an ident may be reused
    one_column: Callable | None = None

    def __call__(self, **kwargs):
        self.threads.add(threading.current_thread())
        mark_dynamic_inputs(kwargs)
        if self.one_column is not None and kwargs["input_ids"].shape[1] == 1:
            return self.one_column(**kwargs)
        return self.function(**kwargs)


def mark_dynamic_inputs(kwargs: dict) -> None:
    """Mark the dimensions a compiled pass changes dynamic before its first call (so no length, row count or cache
    size compiles again): ids and positions `(rows, width)`, the mask `(rows, 1, width, attended)`, the cache's
    write index `(rows, width)` and, with dynamic shapes, its `attended` tensor `(attended,)`, the kept columns
    `(n,)` (the cache's buffers are marked when allocated, `StaticKVCache`)."""
    for name in ("input_ids", "position_ids"):
        torch._dynamo.maybe_mark_dynamic(kwargs[name], [0, 1])
    torch._dynamo.maybe_mark_dynamic(kwargs["attention_mask"]["full_attention"], [0, 2, 3])
    torch._dynamo.maybe_mark_dynamic(kwargs["past_key_values"].write_index, [0, 1])
    if kwargs["past_key_values"].attended is not None:  # None: fixed shapes, every column attended
        torch._dynamo.maybe_mark_dynamic(kwargs["past_key_values"].attended, 0)
    torch._dynamo.maybe_mark_dynamic(kwargs["logits_to_keep"], 0)


def compiled_forward(model, kind: str = "verify", fixed: bool | None = None, compile: bool = True) -> CompiledForward:
    """`model.forward` for pass `kind`, compiled: CUDA graphs ("reduce-overhead") with fixed shapes on CUDA,
    inductor elsewhere with its wrapper code in C++ (`cpp_wrapper`: the kernels are the same, the per-call Python
    that launches them is gone); the verify pass's one-column calls from a function of their own
    (`CompiledForward.one_column`); without dynamo's guards on the model (`guards_d3d`: `CompiledPasses` checks the
    model instead). fixed: fixed shapes (None: on CUDA); compile=False: the eager forward with the compiled path's
    shapes (what CPU tests check the CUDA path's layouts with)."""
    if kind not in PASS_KINDS:
        raise RuntimeError(f"No pass kind {kind!r}; the kinds are {PASS_KINDS}")
    cuda = model.device.type == "cuda"
    fixed = fixed_by_default(model.device) if fixed is None else fixed
    function = pass_function(model, kind)
    if not compile:
        return CompiledForward(function, fixed, kind)

    def compiled(pass_forward: Callable) -> Callable:  # "reduce-overhead" is inductor's `triton.cudagraphs`; a mode
        # and options cannot be given together, and torch.compile takes `guard_filter_fn` out of the dict it is given
        options = {"triton.cudagraphs": True} if cuda else {"cpp_wrapper": True}
        if GUARD_FILTER is not None:
            options["guard_filter_fn"] = GUARD_FILTER
        return torch.compile(pass_forward, options=options)

    one_column = compiled(pass_function(model, "step")) if kind == "verify" else None
    return CompiledForward(compiled(function), fixed, kind, one_column=one_column)


class CompiledPasses:
    """What a compiled model keeps across `generate` calls, so nothing compiles or records again: one
    `CompiledForward` per pass kind and the caches its graphs captured (`CachePool`, keyed by slots and size).
    Held by the model (`compiled_passes`); released with it or by `release_compiled_passes(model)`. Its compiled
    forwards skip dynamo's guards on the model: `forward` compiles them anew when the model changed since
    (`guards_d3d.model_fingerprint`; fingerprint: the model's when they were compiled)."""

    def __init__(self, model, fixed: bool | None = None, compile: bool = True):
        self.model, self.fixed, self.compile = model, fixed, compile
        self.forwards: dict[str, CompiledForward] = {}
        self.caches = CachePool()
        self._worker: ThreadPoolExecutor | None = None
        self.fingerprint: tuple | None = None  # set by the first `forward`

    @property
    def fixed_shapes(self) -> bool:
        return fixed_by_default(self.model.device) if self.fixed is None else self.fixed

    def forward(self, kind: str) -> CompiledForward:
        """The forward of pass `kind` (compiled on first use, and again after the model changed: `guards_d3d`)."""
        return self.forwards_of((kind,))[0]

    def forwards_of(self, kinds: tuple[str, ...]) -> list[CompiledForward]:
        """`forward` of each of `kinds`, the model's fingerprint taken once for all of them."""
        if self.compile:
            fingerprint = model_fingerprint(self.model)
            if fingerprint != self.fingerprint:
                self.forwards.clear()
                self.fingerprint = fingerprint
        for kind in kinds:
            if kind not in self.forwards:
                self.forwards[kind] = compiled_forward(self.model, kind, self.fixed, self.compile)
        return [self.forwards[kind] for kind in kinds]

    def worker(self) -> ThreadPoolExecutor | None:
        """With fixed shapes (CUDA graphs, whose trees keep per-thread state): the one thread background passes (the
        successor pass) run on, call after call (it exits when these passes are released). Otherwise None: each call
        runs them on a thread of its own that ends with it. A thread that outlives its call would keep the OpenMP
        team its CPU kernels started, and while more OpenMP threads live than the machine has cores, libgomp stops
        spin-waiting: every parallel CPU operation of the process then pays a thread wake-up (a small bf16 matmul
        ~3x slower; docs/results.md)."""
        if not self.fixed_shapes:
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d3d-drafter")
        return self._worker

    def close(self) -> None:
        """Let the worker thread end."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)


def compiled_passes(model) -> CompiledPasses:
    """The model's `CompiledPasses` (created on first use, kept on the model as `model.d3d_compiled_passes`)."""
    passes = getattr(model, "d3d_compiled_passes", None)
    if passes is None:
        passes = CompiledPasses(model)
        model.d3d_compiled_passes = passes
    return passes


def release_compiled_passes(model) -> None:
    """Drop what `compiled_passes(model)` holds (its caches' memory, its compiled forwards)."""
    passes = model.__dict__.pop("d3d_compiled_passes", None)
    if passes is not None:
        passes.close()


def fixed_shapes(forward) -> bool:
    """Whether passes through `forward` (None: eager) must keep one shape."""
    return getattr(forward, "fixed_shapes", False)


PADDING_WASTE = 1.25  # a prefill pass pads its rows to its longest: a group of rows grows while its columns stay
# within this factor of its tokens (ragged prompts on a compute-bound device must not pay much for padding)
GROUP_COLUMNS = 8192  # and while its columns (rows x longest) stay within this many: a pass's attention mask holds
# columns x attended columns entries, so long prompts prefill a few rows at a time (one 4k-token row is a group)


def prefill(model, cache: StaticKVCache, first_slot: int, token_rows: list[list[int]],
            starts: int | list[int] = 0, last_logits: bool = False, forward=None) -> torch.Tensor | None:
    """Commit `token_rows[i]` to cache row `first_slot + i`, whose first `starts[i]` columns hold its first tokens
    already (an int: every row's start), in one pass per group of consecutive rows (`prefill_groups`, by what
    each row has left), each row's part as wide as its group's widest: a row with less left re-reads tokens before its
    start (the same keys and values again) where it has them, else is right-padded, so a padding column writes only
    past a row's end within its group's width, which nothing has committed and no real column sees (the next pass
    overwrites it) and which lies in the cache (a row padded past its own start could reach past the cache's last
    column). `cache.committed[first_slot + i]` becomes `len(token_rows[i])`.
    last_logits: return the logits `(rows, 1, vocab)` float32 of each row's last token (every row must have one left),
    whose keys and values are written but not committed (`len(token_rows[i]) - 1`): that token is the anchor of the
    round the logits decide, as a verify pass writes its anchor before the round keeps it.
    forward: the model's compiled prefill pass (a `CompiledForward` of kind "prefill", whose graphs are apart from
    the decoding passes') to prefill a group of rows from cache row 0 through, where its shapes are dynamic (its
    graphs serve every prompt length: on a CPU a compiled 140-token prefill of the quickstart's target takes 11 ms
    against 19 ms eager, docs/results.md 2026-12-07); eager where it is None, has fixed shapes (a CUDA graph would be
    recorded per prompt length) or for groups from other rows (the row a pass starts at is a constant of its graphs:
    each would compile once more)."""
    forward = None if fixed_shapes(forward) else forward
    starts = [starts] * len(token_rows) if isinstance(starts, int) else starts
    if any(not 0 <= start <= len(tokens) for tokens, start in zip(token_rows, starts)):
        raise RuntimeError("A prefill from past a row's tokens (its cache would hold more than its context)")
    left = [len(tokens) - start for tokens, start in zip(token_rows, starts)]
    if last_logits and not all(left):
        raise RuntimeError("A prefill for the logits of a row's last token with no token left to read")
    kept: list[torch.Tensor] = []
    for first, count in prefill_groups(left):
        rows = range(first, first + count)
        width = max(left[row] for row in rows)
        if width:
            group_starts = [max(0, min(starts[row], len(token_rows[row]) - width)) for row in rows]
            tails = [token_rows[row][start:] for row, start in zip(rows, group_starts)]
            ids = torch.tensor([tail + [0] * (width - len(tail)) for tail in tails])
            columns = sorted({len(tail) - 1 for tail in tails})  # each row's last token (right-padded rows: earlier)
            keep = torch.tensor(columns) if last_logits and columns != [width - 1] else 1  # an int where it can be
            logits = run_pass(model, cache, PassLayout.causal(ids, torch.tensor(group_starts)), keep,
                              first_row=first_slot + first, forward=forward if first_slot + first == 0 else None,
                              float32=False)
            if last_logits:
                kept += [logits[i, columns.index(len(tail) - 1)] for i, tail in enumerate(tails)]
    for i, tokens in enumerate(token_rows):
        cache.commit(first_slot + i, len(tokens) - last_logits)
    return torch.stack(kept)[:, None].float() if last_logits else None


def prefill_groups(lengths: list[int]) -> list[tuple[int, int]]:
    """Consecutive groups `(first, count)` of rows of `lengths` tokens, each as long as its padded columns (`count`
    times its longest) stay within `PADDING_WASTE` times its tokens and within `GROUP_COLUMNS`."""
    groups, first = [], 0
    for end in range(1, len(lengths) + 1):
        grown = lengths[first : end + 1]
        columns = len(grown) * max(grown)
        if end == len(lengths) or columns > PADDING_WASTE * sum(grown) or columns > GROUP_COLUMNS:
            groups.append((first, end - first))
            first = end
    return groups


__all__ = ["CompiledForward", "CompiledPasses", "PASS_KINDS", "PassLayout", "PassLayoutBuilder", "compiled_forward",
           "compiled_passes", "fixed_shapes", "mark_dynamic_inputs", "pass_function", "prefill", "prefill_groups",
           "release_compiled_passes", "run_pass"]
