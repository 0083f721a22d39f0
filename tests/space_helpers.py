"""Tiny saved models for the Space's tests, loaded as the Space loads them, and a Space served on a free port."""

import contextlib
import socket
from html.parser import HTMLParser
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_target, word_tokenizer
from d3d.space_app.loading import load_models
from modeling_d3d import D3DForBlockDiffusion

BLOCK_SIZE = 5
PROMPT = "w1 w2 w3 w4"


# Tokens as a byte-level BPE writes code: long runs with no break opportunity, runs of spaces, newlines, tabs.
CODE_PIECES = ("w0", "w1", "w2", "w3", "w4", "_C_C_C_C", "self.assertEqual", "__init__", " " * 8, "    ", "\n", "\n\n", "\t", "reserved_0")


def code_piece_tokenizer(pieces: tuple[str, ...] = CODE_PIECES) -> PreTrainedTokenizerFast:
    """A word-level tokenizer (prompts split on whitespace; unknown words are `pieces[0]`) whose tokens decode
    verbatim and run together, so that generated text has the unbreakable runs and whitespace runs of code."""
    backend = Tokenizer(models.WordLevel(vocab={piece: i for i, piece in enumerate(pieces)}, unk_token=pieces[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")


def save_tiny_models(folder: Path, seed: int = 0, tokenizer=None) -> tuple[Path, Path]:
    """A tiny target with `tokenizer` (default: a word tokenizer), and a D3D drafter started from the same weights
    (so that it often agrees), saved as `folder/target` and `folder/drafter` (with its remote code); its token
    `reserved_0` is the drafter's mask."""
    tokenizer = tokenizer or word_tokenizer(num_words=8, words=("reserved_0",))
    target = tiny_target(seed, vocab_size=len(tokenizer))
    drafter = D3DForBlockDiffusion.from_backbone(target, block_size=BLOCK_SIZE, tokenizer=tokenizer)
    target.save_pretrained(folder / "target")
    tokenizer.save_pretrained(folder / "target")
    drafter.save_pretrained(folder / "drafter")
    return folder / "target", folder / "drafter"


def load_tiny_models(folder: Path, seed: int = 0, tokenizer=None):
    """(target, drafter, tokenizer) saved by `save_tiny_models` and loaded by the Space's own loader."""
    return load_models(*map(str, save_tiny_models(folder, seed, tokenizer)))


def greedy_text(target, tokenizer, prompt: str, max_new_tokens: int) -> tuple[list[int], str]:
    """The target's own greedy continuation of `prompt`: its new ids and their text."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    new = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
    return new, tokenizer.decode(new)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def served(demo):
    """Serve `demo` (queued by `build_demo`) on 127.0.0.1 at a free port for the `with` block; yields its URL."""
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


class PageReader(HTMLParser):
    """What the Space's HTML shows: token spans `(kind, text)`, statistics cells `{data-stat: text}`, and round bars
    `(tokens added, served)`."""

    def __init__(self, markup: str):
        super().__init__(convert_charrefs=True)
        self.spans: list[tuple[str, str]] = []
        self.stats: dict[str, str] = {}
        self.bars: list[tuple[int, str]] = []
        self._open: tuple[str, str] | None = None
        self._depth = 0  # elements open inside the open token or cell
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if self._open is not None:  # an element inside a token (the newline mark) or a cell
            self._depth += 1
        elif "data-round" in attrs:
            self.bars.append((int(attrs["data-added"]), attrs["data-served"]))
        elif "data-kind" in attrs:
            self._open = ("kind", attrs["data-kind"])
            self.spans.append((attrs["data-kind"], ""))
        elif "data-stat" in attrs:
            self._open = ("stat", attrs["data-stat"])
            self.stats[attrs["data-stat"]] = ""

    def handle_endtag(self, tag):
        if self._depth:
            self._depth -= 1
        else:
            self._open = None

    def handle_data(self, data):
        if self._open is None:
            return
        what, key = self._open
        if what == "kind":
            self.spans[-1] = (key, self.spans[-1][1] + data)
        else:
            self.stats[key] += data

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.spans)


__all__ = ["BLOCK_SIZE", "CODE_PIECES", "PROMPT", "code_piece_tokenizer", "PageReader", "free_port", "greedy_text", "load_tiny_models", "save_tiny_models", "served"]
