"""Training the embedded default's tokenizer and causal LMs from scratch (the target and the AR assistant), and the
training arguments of every quickstart stage."""

import math
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments

from d3d.common.dtype import DtypeChoice
from d3d.trainer.d3d_trainer import D3DTrainingArguments

from .sizes import ModelSize, QuickstartSizes

END_OF_TEXT = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with `vocab_size - 1` tokens: the model's last embedding row stays free for the D3D mask."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT)


def causal_lm_config(tokenizer, vocab_size: int, size: ModelSize) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.mlp,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.hidden // size.heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def chunked_dataset(tokenizer, texts: list[str], length: int) -> Dataset:
    """All documents tokenized, joined by end-of-text, cut into `length`-token rows."""
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(tokenizer.eos_token_id)
    rows = [ids[start : start + length] for start in range(0, len(ids) - length + 1, length)]
    return Dataset.from_dict({"input_ids": rows})


def with_labels(rows: list[dict]) -> dict[str, torch.Tensor]:
    input_ids = torch.tensor([row["input_ids"] for row in rows])
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def pretraining_arguments(output_dir: Path, steps: int, batch_size: int, learning_rate: float, bf16: bool,
                          seed: int = 0) -> TrainingArguments:
    """Cosine lr, 5% warmup, weight decay 0.1, clip 1; bf16 autocast exactly when `bf16` (see `d3d.common.dtype`)."""
    return TrainingArguments(
        output_dir=str(output_dir / "checkpoints"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        weight_decay=0.1,
        max_grad_norm=1.0,
        bf16=bf16,
        logging_steps=max(steps // 10, 1),
        save_strategy="no",
        report_to=[],
        seed=seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
    )


def drafter_arguments(output_dir: Path, sizes: QuickstartSizes, steps: int, choice: DtypeChoice) -> D3DTrainingArguments:
    """The drafter's (and pruning recovery's) training arguments; bf16 autocast exactly when `choice` is bfloat16."""
    return D3DTrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=sizes.drafter_batch_size,
        learning_rate=sizes.drafter_learning_rate, lr_scheduler_type="cosine", warmup_steps=0.03, weight_decay=0.0,
        max_grad_norm=1.0, num_anchors=sizes.num_anchors, logging_steps=max(steps // 10, 1), save_strategy="no",
        report_to=[], seed=0, use_cpu=not torch.cuda.is_available(),
        bf16=choice.bf16,
    )


def pretrain(config: Qwen3Config, dataset: Dataset, args: TrainingArguments) -> Qwen3ForCausalLM:
    """Train a Qwen3 causal LM from scratch with `transformers.Trainer` under `args` (`pretraining_arguments`)."""
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=with_labels)
    trainer.train()
    trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)  # no autocast forward after training
    return model.eval()


@torch.no_grad()
def perplexity(model, dataset: Dataset, batch_size: int = 8) -> float:
    """exp(mean next-token loss) over `dataset` rows."""
    losses = []
    for start in range(0, len(dataset), batch_size):
        batch = with_labels(dataset.select(range(start, min(start + batch_size, len(dataset)))).to_list())
        losses.append(model(**{k: v.to(model.device) for k, v in batch.items()}).loss.item())
    return float(torch.tensor(losses).mean().exp())


@torch.no_grad()
def bits_per_byte(model, tokenizer, texts: list[str], window: int = 256) -> float:
    """The model's negative log-likelihood of `texts` in bits per UTF-8 byte, each text scored in `window`-token pieces
    (a piece's first token is context only): unlike perplexity, comparable between models with different tokenizers."""
    nats, size = 0.0, 0
    for text in texts:
        ids = tokenizer(text).input_ids
        size += len(text.encode())
        for start in range(0, len(ids) - 1, window):
            piece = torch.tensor([ids[start : start + window]], device=model.device)
            logits = model(piece).logits[0, :-1].float()
            nats += torch.nn.functional.cross_entropy(logits, piece[0, 1:], reduction="sum").item()
    return nats / math.log(2) / size


__all__ = ["END_OF_TEXT", "bits_per_byte", "causal_lm_config", "chunked_dataset", "drafter_arguments", "perplexity",
           "pretrain", "pretraining_arguments", "train_tokenizer", "with_labels"]
