"""Preallocated KV caches for the engine: one key and one value tensor, each holding every layer, rows packed in
slots `0..rows-1`, per-row lengths.

A pass writes each row's new keys and values at the cache columns the caller chooses (`write_index`), and attends
over the first `kv_length` columns of every row, under a mask the caller builds (`masking_d3d.interval_mask`). A
slot's *committed* length (`StaticKVCache.committed[slot]`, host bookkeeping, owned here and only here: read-only
outside, changed only by `commit`, `move_row` and `reset`; the engine commits the target's, the drafter sources their
drafter's) is how many of its first columns hold its tokens; rejected tokens are rolled back by not counting them,
and the next pass overwrites their columns. Nothing is reallocated, cropped or concatenated in a round.

Compiled passes (`passes_d3d.CompiledForward`) read rows, widths and the attended columns from tensor shapes only
(`attended`: a tensor as long as the columns attended; no Python int of theirs reaches the compiled code), so a
compiler guards on nothing that changes from pass to pass; with fixed shapes (CUDA graphs) they attend over every
column. They write with `index_put_` on the whole buffer (`update`). The keys of every layer are one tensor, and the
values another, so a compiled pass takes the cache as two inputs, both written, whatever the model's depth: a
compiled call's host work grows with its input tensors (dynamo's guards before it, several of them Python per
tensor of dynamic size, and the handling of each written input), and with a buffer per layer it grew with the depth
(docs/results.md 2026-12-07: at 36 layers a compiled plain step 18 % faster with two buffers). The buffers are marked
static addresses (CUDA graphs capture them instead of copying them) with their slot and column dimensions dynamic.
A `CachePool` keeps caches across engines so captured graphs are replayed.

Column `c` of a row holds the token at position `c` for its committed (causal) part; block tokens of a drafting pass
go to scratch columns after it, which are never committed.
"""

import torch

from .streams_d3d import move


class StaticKVCache:
    """Keys and values `(layers, slots, kv_heads, capacity, head_dim)` (`key_buffer`, `value_buffer`; `keys[layer]`
    and `values[layer]` are views of one layer's), for the HF decoder's `past_key_values`.

    Before each forward call `plan(rows, write_index, kv_length)`: the pass covers rows `0..rows-1`, writes its
    input column `j` of row `r` at cache column `write_index[r, j]`, and returns the columns `0..kv_length-1` for
    attention. Not thread-safe: one pass at a time (the engine's drafter source owns its drafter cache).
    """

    def __init__(self, config, slots: int, capacity: int, device: torch.device, dtype: torch.dtype):
        text = config.get_text_config()
        heads = text.num_key_value_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        shape = (text.num_hidden_layers, slots, heads, capacity, head_dim)
        self.key_buffer = torch.zeros(shape, device=device, dtype=dtype)
        self.value_buffer = torch.zeros(shape, device=device, dtype=dtype)
        for buffer in (self.key_buffer, self.value_buffer):
            torch._dynamo.mark_static_address(buffer)
            torch._dynamo.maybe_mark_dynamic(buffer, [1, 3])
        self.keys, self.values = list(self.key_buffer.unbind(0)), list(self.value_buffer.unbind(0))
        self.slots, self.capacity, self.device = slots, capacity, torch.device(device)
        self.key = cache_key(config, slots, capacity, device, dtype)
        self._committed = [0] * slots  # per slot: its columns 0..committed-1 hold its tokens at their positions
        self.write_index: torch.Tensor | None = None
        self._scatter_index: torch.Tensor | None = None  # write_index expanded to a layer's states (eager passes)
        self._first_row, self._kv_length = 0, None
        self.attended: torch.Tensor | None = None  # `(kv_length,)`, whose length compiled passes attend over

    @property
    def nbytes(self) -> int:
        """Bytes of its key and value buffers."""
        return self.key_buffer.nbytes + self.value_buffer.nbytes

    @property
    def committed(self) -> tuple[int, ...]:
        """Per slot, how many of its first columns hold its tokens (read-only: `commit` changes one)."""
        return tuple(self._committed)

    def commit(self, slot: int, length: int) -> None:
        """Slot `slot`'s first `length` columns hold its tokens (what a pass wrote and the caller keeps); the rest
        is rolled back by not being counted."""
        if not 0 <= length <= self.capacity:
            raise RuntimeError(f"A committed length {length} outside a cache of {self.capacity} columns")
        self._committed[slot] = length

    def reset(self) -> None:
        """Every slot empty (a cache handed to a new engine)."""
        self._committed = [0] * self.slots

    def plan(self, rows: int, write_index: torch.Tensor, kv_length: int, first_row: int = 0,
             dynamic: bool = False) -> None:
        """Set up the next pass over slots `first_row..first_row + rows - 1`: `write_index` `(rows, width)` long cache
        columns, `kv_length` columns attended; dynamic: a compiled pass with dynamic shapes, which reads `kv_length`
        as the length of `attended` (other passes leave it None: an eager pass reads `kv_length` itself, one with
        fixed shapes attends over every column, and a CUDA graph then takes no input for it)."""
        if first_row + rows > self.slots or kv_length > self.capacity:
            raise RuntimeError(f"A pass over {rows} rows and {kv_length} columns does not fit a cache of {self.slots} "
                             f"slots x {self.capacity} columns")
        if write_index.shape[0] != rows:
            raise RuntimeError(f"A write index of {write_index.shape[0]} rows for a pass over {rows}")
        self._first_row = first_row
        self._kv_length = None if kv_length == self.capacity else kv_length  # None: every column
        # not a view of a longer tensor: a compiled pass would guard on its base's size (one more graph per cache size)
        self.attended = torch.empty(kv_length, dtype=torch.int8, device=self.device) if dynamic else None
        self.write_index = move(write_index, self.device)
        _, heads, _, head_dim = self.keys[0].shape
        self._scatter_index = self.write_index[:, None, :, None].expand(rows, heads, write_index.shape[1], head_dim)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write `(rows, kv_heads, width, head_dim)` states at the planned columns; return the attended columns.
        The index every layer scatters with is expanded once a pass, in `plan` (per layer, its few small operations
        were a measurable part of an eager decoding step on small models). A compiled pass writes with `index_put_`
        on the buffer of every layer's keys (values), its indices built in its graph from the layer and the write
        index's symbolic sizes (a `scatter_` into a view of a graph input compiles to a copy of the whole view and
        back, every layer: a cost that grows with the cache, docs/results.md 2026-12-07), and attends over as many
        columns as `attended` is long (None: every column)."""
        rows = slice(self._first_row, self._first_row + key_states.shape[0])
        if torch.compiler.is_compiling():
            layer = torch.full((1, 1, 1), layer_idx, dtype=torch.long, device=key_states.device)
            slots = torch.arange(key_states.shape[0], device=key_states.device)[:, None, None] + self._first_row
            heads = torch.arange(key_states.shape[1], device=key_states.device)[None, :, None]
            for buffer, states in ((self.key_buffer, key_states), (self.value_buffer, value_states)):
                buffer.index_put_((layer, slots, heads, self.write_index[:, None, :]), states.to(buffer.dtype))
            keys, values = self.key_buffer[layer_idx, rows], self.value_buffer[layer_idx, rows]
            length = None if self.attended is None else self.attended.shape[0]
        else:  # one slice of each buffer a layer: this runs in every layer of every eager step
            keys, values = self.keys[layer_idx][rows], self.values[layer_idx][rows]
            keys.scatter_(2, self._scatter_index, key_states.to(keys.dtype))
            values.scatter_(2, self._scatter_index, value_states.to(values.dtype))
            length = self._kv_length
        if length is None:
            return keys, values
        return keys[:, :, :length], values[:, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.capacity if self._kv_length is None else self._kv_length

    def move_row(self, from_slot: int, to_slot: int) -> None:
        """Copy the committed columns of slot `from_slot` (and its committed length) into slot `to_slot` (a row
        changing slot when an earlier one leaves the batch)."""
        length = self._committed[from_slot]
        if from_slot == to_slot:
            return
        self._committed[to_slot] = length
        for buffer in (self.key_buffer, self.value_buffer):
            buffer[:, to_slot, :, :length] = buffer[:, from_slot, :, :length]

    def move_columns(self, slot: int, source: int, target: int, count: int) -> None:
        """Copy columns `source..source+count-1` of slot `slot` to `target..` (`target + count <= source`: a tree's
        second branch, kept, moved to the columns of its positions before they are committed)."""
        if count <= 0:
            return
        if target + count > source:
            raise RuntimeError(f"Moving columns {source}.. to {target}.. would overlap")
        for buffer in (self.key_buffer, self.value_buffer):
            buffer[:, slot, :, target : target + count] = buffer[:, slot, :, source : source + count]


def cache_key(config, slots: int, capacity: int, device, dtype: torch.dtype) -> tuple:
    """What makes two caches interchangeable: geometry, device, dtype, and whether they are made (now) under
    `torch.inference_mode()` (its tensors can be updated in place only under it)."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return (text.num_hidden_layers, text.num_key_value_heads, head_dim, slots, capacity, str(torch.device(device)),
            dtype, torch.is_inference_mode_enabled())


class CachePool:
    """Caches kept for reuse across engines (compiled passes: a CUDA graph captured a cache's buffers, so the next
    engine of the same slots and size gets the same buffers and replays it). `take` hands a cache out exclusively
    (the most recently returned free one of that key, else a new one); `put` returns it. The free caches are
    bounded: least recently returned first, they are dropped while their bytes exceed `max_bytes` (None: twice the
    largest cache handed out, so a server alternating between a few shapes keeps them, and one that sees ever new
    shapes holds at most that much besides the caches in use). Not thread-safe: one engine is built at a time."""

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = max_bytes
        self.free: dict[tuple, list[StaticKVCache]] = {}  # key -> free caches; keys in the order last returned
        self.largest = 0  # bytes of the largest cache handed out

    def take(self, config, slots: int, capacity: int, device, dtype: torch.dtype) -> StaticKVCache:
        key = cache_key(config, slots, capacity, device, dtype)
        free = self.free.get(key)
        if free:
            cache = free.pop()
            if not free:
                del self.free[key]
            cache.reset()
        else:
            cache = StaticKVCache(config, slots, capacity, device, dtype)
        self.largest = max(self.largest, cache.nbytes)
        return cache

    def put(self, cache: StaticKVCache) -> None:
        self.free[cache.key] = self.free.pop(cache.key, []) + [cache]
        ceiling = 2 * self.largest if self.max_bytes is None else self.max_bytes
        while self.free_bytes() > ceiling:
            oldest = next(iter(self.free))
            self.free[oldest].pop(0)
            if not self.free[oldest]:
                del self.free[oldest]

    def free_bytes(self) -> int:
        """Bytes the free caches hold."""
        return sum(cache.nbytes for caches in self.free.values() for cache in caches)


__all__ = ["CachePool", "StaticKVCache", "cache_key"]
