"""The D3D network: one Qwen3 decoder run three ways (causal, packed training, block drafting). Weights and forward
passes only; the decoding modules build on it, and `modeling_d3d.D3DForBlockDiffusion` adds the front doors."""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedModel, Qwen3Config
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin, LogitsProcessorList
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3Model
from transformers.utils import ModelOutput, logging

from .configuration_d3d import D3DConfig
from .masking_d3d import block_layout, create_block_diffusion_mask

logger = logging.get_logger(__name__)


@dataclass
class D3DPackedOutput(ModelOutput):
    """Outputs of one packed-training pass.

    ar_logits: `(batch, shared_length, vocab)` next-token logits of the shared causal part (for `L_AR`).
    diffusion_logits: `(batch, K, block_size - 1, vocab)`; `[:, k, j - 1]` predicts the token at `anchor_k + j`
        from block `k`'s masked position `j` (for `L_diff`).
    ar_hidden_states, diffusion_hidden_states: the same positions' final hidden states, `(..., hidden)` instead of
        `(..., vocab)`, given instead of the logits with `hidden_states_only=True` (the losses apply `lm_head` only
        where they read it, see `d3d.trainer.losses`).
    """

    ar_logits: torch.FloatTensor | None = None
    diffusion_logits: torch.FloatTensor | None = None
    ar_hidden_states: torch.FloatTensor | None = None
    diffusion_hidden_states: torch.FloatTensor | None = None


@dataclass
class D3DBlockDraft(ModelOutput):
    """One drafted block.

    tokens: `(batch, block_size - 1)` proposed tokens.
    logits: `(batch, block_size - 1, vocab)` float32 logits after the logits processors; `softmax(logits)` is the
        proposal distribution q the tokens were drawn from.
    past_key_values: the drafter's cache, holding every prefix token before the anchor and nothing else.
    """

    tokens: torch.LongTensor | None = None
    logits: torch.FloatTensor | None = None
    past_key_values: DynamicCache | None = None


class D3DPreTrainedModel(PreTrainedModel):
    config: D3DConfig
    config_class = D3DConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": Qwen3DecoderLayer}


class D3DBlockDiffusionModel(D3DPreTrainedModel, GenerationMixin):
    """The block-diffusion drafter network. It reads token ids only, never a target's hidden states.

    - `forward(input_ids)`: ordinary causal next-token logits (the AR mode, identical to the Qwen3 backbone);
    - `forward_packed(input_ids, anchors)`: training pass over a shared causal sequence followed by K blocks;
    - `draft_block(input_ids, past_key_values)`: one pass proposing `block_size - 1` tokens after the last token.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: D3DConfig):
        super().__init__(config)
        self.model = Qwen3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: DynamicCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        block_ids: torch.LongTensor | None = None,
        visible_prefix: torch.LongTensor | None = None,
        anchors: torch.LongTensor | None = None,
        hidden_states_only: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast | D3DPackedOutput:
        """Causal LM forward; with `block_ids`/`visible_prefix` (`(batch, seq)`, see `masking_d3d`) the block rule;
        with `anchors` the packed training pass (`forward_packed`, reachable through distributed wrappers, with its
        `hidden_states_only`).

        attention_mask: 2D padding mask `(batch, past + seq)`; logits: `(batch, seq or logits_to_keep, vocab)`.
        """
        if anchors is not None:
            return self.forward_packed(input_ids, anchors, attention_mask, hidden_states_only)
        return self._run(
            input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, logits_to_keep,
            block_ids, visible_prefix, **kwargs,
        )

    def _run(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        past_key_values: DynamicCache | None,
        inputs_embeds: torch.FloatTensor | None,
        use_cache: bool | None,
        logits_to_keep: int | torch.Tensor,
        block_ids: torch.LongTensor | None,
        visible_prefix: torch.LongTensor | None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """The decoder and head (not re-entering `forward`, so wrappers around it, such as autocast, apply once)."""
        outputs = self._decode(
            input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, block_ids,
            visible_prefix, **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor):  # the input columns to keep `(n,)` (compiled passes)
            hidden_states = hidden_states[:, logits_to_keep]
        elif logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        return CausalLMOutputWithPast(
            logits=self.lm_head(hidden_states),
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _decode(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        past_key_values: DynamicCache | None,
        inputs_embeds: torch.FloatTensor | None,
        use_cache: bool | None,
        block_ids: torch.LongTensor | None,
        visible_prefix: torch.LongTensor | None,
        **kwargs,
    ):
        """The decoder alone (`Qwen3Model` under the block rule when `block_ids` is given), no head."""
        if block_ids is not None:
            if position_ids is None or visible_prefix is None:
                raise ValueError("block_ids needs position_ids and visible_prefix (see masking_d3d.block_layout)")
            if inputs_embeds is None:
                inputs_embeds = self.model.embed_tokens(input_ids)
                input_ids = None
            past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
            mask = create_block_diffusion_mask(
                self.config, inputs_embeds, block_ids, visible_prefix, past_length, attention_mask
            )
            attention_mask = {"full_attention": mask}
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

    def mask_blocks(self, anchor_tokens: torch.LongTensor) -> torch.LongTensor:
        """`(batch, K)` anchors -> `(batch, K * block_size)` ids `[anchor, M, ..., M]` per block."""
        batch, num_blocks = anchor_tokens.shape
        blocks = anchor_tokens.new_full((batch, num_blocks, self.config.block_size), self.config.require_mask_token())
        blocks[:, :, 0] = anchor_tokens
        return blocks.reshape(batch, -1)

    def forward_packed(
        self,
        input_ids: torch.LongTensor,
        anchors: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        hidden_states_only: bool = False,
    ) -> D3DPackedOutput:
        """One training pass: the shared causal part `input_ids` (prompt + response) and K packed blocks.

        input_ids: `(batch, S)`; anchors: `(batch, K)` indices `s_k` into `input_ids` (block k is
        `[input_ids[s_k], M, ...]`, sees `input_ids[:s_k]` and itself); attention_mask: `(batch, S)` padding.
        hidden_states_only: return the final hidden states of those positions instead of their logits (no
        `(positions, vocab)` matrix is formed here).
        """
        batch, shared_length = input_ids.shape
        block_size = self.config.block_size
        blocks = self.mask_blocks(input_ids.gather(1, anchors))
        block_ids, visible_prefix, position_ids = block_layout(shared_length, anchors, block_size)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(blocks.shape)], dim=1)
        hidden = self._decode(
            torch.cat([input_ids, blocks], dim=1), attention_mask, position_ids, None, None, False, block_ids,
            visible_prefix,
        ).last_hidden_state
        outputs = hidden if hidden_states_only else self.lm_head(hidden)
        shared, block = outputs[:, :shared_length], outputs[:, shared_length:].reshape(batch, anchors.shape[1], block_size, -1)
        if hidden_states_only:
            return D3DPackedOutput(ar_hidden_states=shared, diffusion_hidden_states=block[:, :, 1:])
        return D3DPackedOutput(ar_logits=shared, diffusion_logits=block[:, :, 1:])

    @torch.no_grad()
    def draft_block(
        self,
        input_ids: torch.LongTensor,
        past_key_values: DynamicCache | None = None,
        logits_processor: LogitsProcessorList | None = None,
        do_sample: bool = False,
        generator: torch.Generator | None = None,
    ) -> D3DBlockDraft:
        """Propose the `block_size - 1` tokens after `input_ids` in one forward pass.

        input_ids: `(batch, L)` the whole prefix; its last token is the anchor. `past_key_values` must hold a prefix
        of `input_ids[:, :-1]` (or be `None`); only the uncached tokens before the anchor are encoded, and on return
        the cache holds exactly `input_ids[:, :-1]` (the block is never cached).
        """
        batch, length = input_ids.shape
        cache = past_key_values if past_key_values is not None else DynamicCache(config=self.config)
        cached = _cached_prefix_length(cache, length)
        block_size = self.config.block_size
        device = self.model.embed_tokens.weight.device
        input_ids = input_ids.to(device)
        anchor_index = torch.full((batch, 1), length - 1, device=device, dtype=torch.long)
        block_ids, visible_prefix, position_ids = block_layout(length - 1 - cached, anchor_index, block_size, cached)
        step_ids = torch.cat([input_ids[:, cached:-1], self.mask_blocks(input_ids[:, -1:])], dim=1)
        logits = self(
            input_ids=step_ids,
            position_ids=position_ids,
            block_ids=block_ids,
            visible_prefix=visible_prefix,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=block_size - 1,
        ).logits.float()
        cache.crop(-block_size)
        tokens, logits = _drafts_from_logits(logits, input_ids, logits_processor, do_sample, generator)
        return D3DBlockDraft(tokens=tokens, logits=logits, past_key_values=cache)

    @classmethod
    def from_backbone(
        cls,
        model_or_path: "PreTrainedModel | str",
        block_size: int = 16,
        mask_token_id: int | None = None,
        tokenizer=None,
        **from_pretrained_kwargs,
    ) -> "D3DBlockDiffusionModel":
        """Initialise a drafter from a Qwen3 causal LM (a loaded model or a checkpoint path / Hub id), weights copied
        exactly. `from_pretrained_kwargs` (`dtype`, `device_map`, ...) apply when loading from a path.

        Without `mask_token_id` a reserved, unused id is chosen (see `choose_mask_token_id`) and recorded in the
        config; with a `tokenizer` the mask id is checked not to be one of its special or added tokens.
        """
        if isinstance(model_or_path, PreTrainedModel):
            backbone_config = model_or_path.config
        else:
            backbone_config = AutoConfig.from_pretrained(model_or_path, **_config_kwargs(from_pretrained_kwargs))
        _check_qwen3_causal_lm(backbone_config)
        if mask_token_id is None:
            mask_token_id = choose_mask_token_id(backbone_config.vocab_size, tokenizer)
            logger.info(f"D3D: using token id {mask_token_id} as the mask token [M]")
        config = D3DConfig(
            **{**backbone_config.to_diff_dict(), "model_type": "d3d"},
            block_size=block_size,
            mask_token_id=mask_token_id,
        )
        config.architectures = [cls.__name__]
        if tokenizer is not None:
            config.check_mask_token(tokenizer)
        if not isinstance(model_or_path, PreTrainedModel):
            return cls.from_pretrained(model_or_path, config=config, **from_pretrained_kwargs)
        config._attn_implementation = backbone_config._attn_implementation
        parameter = next(model_or_path.parameters())
        drafter = cls(config).to(device=parameter.device, dtype=parameter.dtype)
        drafter.load_state_dict(model_or_path.state_dict(), strict=True)
        return drafter


def _cached_prefix_length(cache: DynamicCache, length: int) -> int:
    """Tokens `cache` holds, checked to fit before the anchor of a `length`-token prefix."""
    cached = cache.get_seq_length()
    if cached > length - 1:
        raise ValueError(f"The drafter cache holds {cached} tokens but the prefix before the anchor has only {length - 1}")
    return cached


def _drafts_from_logits(
    logits: torch.Tensor,
    prefix_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None,
    do_sample: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.FloatTensor]:
    """`draft_block`'s drafts from its raw block logits: apply the target's processors (with the prefix as context),
    then take the argmax or sample. logits: `(batch, n, vocab)` float32; prefix_ids: `(batch, L)`.
    Returns tokens `(batch, n)` and processed logits `(batch, n, vocab)`, whose softmax is q."""
    batch, positions, vocab = logits.shape
    if logits_processor:
        flat_prefix = prefix_ids.repeat_interleave(positions, dim=0)
        logits = logits_processor(flat_prefix, logits.reshape(batch * positions, vocab)).reshape(batch, positions, vocab)
    if do_sample:
        probs = logits.softmax(dim=-1).reshape(-1, vocab)
        tokens = torch.multinomial(probs, 1, generator=generator).reshape(batch, positions)
    else:
        tokens = logits.argmax(dim=-1)
    return tokens, logits


def _config_kwargs(from_pretrained_kwargs: dict) -> dict:
    return {k: v for k, v in from_pretrained_kwargs.items() if k in ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code")}


def _check_qwen3_causal_lm(config) -> None:
    if not isinstance(config, Qwen3Config) or isinstance(config, D3DConfig):
        raise ValueError(
            f"from_backbone needs a Qwen3-style causal LM (model_type 'qwen3'), got model_type "
            f"{getattr(config, 'model_type', type(config).__name__)!r}"
        )


def choose_mask_token_id(vocab_size: int, tokenizer=None) -> int:
    """A reserved id for `[M]`: the last embedding row the tokenizer never produces (Qwen3 pads its embedding past
    the tokenizer), else an ordinary `reserved` token of the tokenizer, else (no tokenizer) the last vocabulary id."""
    if tokenizer is None:
        return vocab_size - 1
    if len(tokenizer) < vocab_size:
        return vocab_size - 1
    special_ids = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if "reserved" in token.lower() and token_id not in special_ids:
            return token_id
    raise ValueError(
        "Could not find an unused, non-special token to serve as the mask token; pass mask_token_id explicitly"
    )


def check_vocabulary(drafter, target) -> None:
    """Raise `ValueError` unless `drafter` and `target` have the same vocabulary size (the one vocabulary check)."""
    drafter_vocab = drafter.config.vocab_size
    target_vocab = target.config.get_text_config().vocab_size
    if drafter_vocab != target_vocab:
        raise ValueError(
            f"Drafter vocabulary size {drafter_vocab} differs from the target's {target_vocab}: a D3D drafter must use "
            "the target's tokenizer and embedding size (initialise it with D3DForBlockDiffusion.from_backbone)"
        )


def check_compatibility(drafter, target, target_tokenizer=None, drafter_tokenizer=None) -> None:
    """Raise `ValueError` unless `drafter` can draft for `target`: same vocabulary size, a mask token, and (when
    tokenizers are given) the same tokenizer vocabulary with the mask token not among the target's special tokens."""
    check_vocabulary(drafter, target)
    drafter.config.require_mask_token()
    if target_tokenizer is not None and drafter_tokenizer is not None:
        if target_tokenizer.get_vocab() != drafter_tokenizer.get_vocab():
            raise ValueError("The drafter's tokenizer differs from the target's; a D3D drafter must share it")
    if target_tokenizer is not None:
        drafter.config.check_mask_token(target_tokenizer)


__all__ = ["D3DBlockDiffusionModel", "D3DBlockDraft", "D3DPackedOutput", "D3DPreTrainedModel", "check_compatibility",
           "check_vocabulary",
           "choose_mask_token_id"]
