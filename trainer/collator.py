"""Packing examples for D3D training: the shared causal sequence plus K diffusion blocks per example."""

import random
from dataclasses import dataclass, field

import torch

from .losses import IGNORE_INDEX


@dataclass
class D3DCollator:
    """Turn `{"prompt": ids, "completion": ids}` examples into one padded batch for `forward_packed`.

    Per example with response `r_1..r_T` (`T >= 2`), it samples `min(K, T - 1)` distinct anchors
    `1 <= s_1 < ... < s_K < T`, drawn from the example itself, `seed` and `epoch` (set by `D3DTrainer` as each epoch
    begins), not from a stream: a run resumed from a checkpoint packs every later batch as the uninterrupted run did; block k is `[r_sk, M x (B - 1)]` and supervises the next `min(B - 1, T - s_k)` tokens
    (positions past the response end stay in the block, unsupervised). Rows with fewer anchors are padded with
    unsupervised blocks. Returns `input_ids`, `attention_mask` `(batch, S)`, `anchors` `(batch, K)` (indices into
    `input_ids`), `block_labels` `(batch, K, B - 1)` and `ar_labels` `(batch, S)` (shifted; response tokens only).
    """

    block_size: int
    num_anchors: int
    pad_token_id: int = 0
    seed: int | None = None
    epoch: int = field(default=0, init=False)
    _seed: int = field(init=False, repr=False)

    def __post_init__(self):
        if self.block_size < 2 or self.num_anchors < 1:
            raise ValueError(f"block_size must be >= 2 and num_anchors >= 1, got {self.block_size}, {self.num_anchors}")
        self._seed = self.seed if self.seed is not None else random.getrandbits(64)

    def sample_anchors(self, prompt: list[int], response: list[int]) -> list[int]:
        """Distinct sorted 1-based response positions in `1..T-1`, a function of the example, the seed and the epoch."""
        rng = random.Random(f"{self._seed}/{self.epoch}/{prompt}/{response}")
        return sorted(rng.sample(range(1, len(response)), min(self.num_anchors, len(response) - 1)))

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        sequences, anchor_lists, block_label_lists, ar_label_lists = [], [], [], []
        for example in examples:
            prompt, response = list(example["prompt"]), list(example["completion"])
            if len(response) < 2 or not prompt:
                raise ValueError("Each example needs a non-empty prompt and a completion of at least 2 tokens")
            ids = prompt + response
            offset = len(prompt) - 1  # r_s sits at index offset + s
            anchors = [offset + s for s in self.sample_anchors(prompt, response)]
            block_labels = [
                [ids[a + j] if a + j < len(ids) else IGNORE_INDEX for j in range(1, self.block_size)] for a in anchors
            ]
            ar_labels = [IGNORE_INDEX] * (len(prompt) - 1) + response + [IGNORE_INDEX]
            sequences.append(ids)
            anchor_lists.append(anchors)
            block_label_lists.append(block_labels)
            ar_label_lists.append(ar_labels)

        length = max(len(ids) for ids in sequences)
        blocks = max(len(anchors) for anchors in anchor_lists)
        unsupervised = [IGNORE_INDEX] * (self.block_size - 1)
        batch = {
            "input_ids": [ids + [self.pad_token_id] * (length - len(ids)) for ids in sequences],
            "attention_mask": [[1] * len(ids) + [0] * (length - len(ids)) for ids in sequences],
            "anchors": [anchors + [0] * (blocks - len(anchors)) for anchors in anchor_lists],
            "block_labels": [labels + [unsupervised] * (blocks - len(labels)) for labels in block_label_lists],
            "ar_labels": [labels + [IGNORE_INDEX] * (length - len(labels)) for labels in ar_label_lists],
        }
        return {name: torch.tensor(value, dtype=torch.long) for name, value in batch.items()}


__all__ = ["D3DCollator"]
