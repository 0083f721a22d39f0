"""Run in the vLLM environment, with the engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): what the
D3D proposer (`d3d_vllm.proposer.D3DProposer`) drafts, per request and prefix, for comparison with this project's
`draft_block` on the same prefixes (`tests_vllm/test_drafts.py`, `d3d gpu-check --vllm`)."""

from d3d_vllm.proposer import D3DProposer


class DraftRecorder:
    """Wraps `D3DProposer.__init__` (keeping the model runner: its input batch names each row's request) and
    `D3DProposer.propose` (while `recording`, each row's drafts with its request id and prefix length: the verified
    tokens + 1, the anchor). `install()` before the engine is built; the wrappers stay for the process's life."""

    def __init__(self) -> None:
        self.runners: list = []
        self.proposals: list[dict] = []
        self.recording = False

    def install(self) -> None:
        init, propose = D3DProposer.__init__, D3DProposer.propose
        recorder = self

        def __init__(proposer, vllm_config, device, runner=None):
            recorder.runners.append(runner)
            init(proposer, vllm_config, device, runner)

        def recorded_propose(proposer, num_speculative_tokens, target_token_ids, target_positions,
                             target_hidden_states, next_token_ids, token_indices_to_sample, common_attn_metadata,
                             sampling_metadata, *args, **kwargs):
            drafts = propose(proposer, num_speculative_tokens, target_token_ids, target_positions,
                             target_hidden_states, next_token_ids, token_indices_to_sample, common_attn_metadata,
                             sampling_metadata, *args, **kwargs)
            if recorder.recording:
                rejected = kwargs.get("num_rejected_tokens_gpu")
                verified = common_attn_metadata.seq_lens.clone()
                if rejected is not None:
                    verified -= rejected
                request_ids = recorder.runners[-1].input_batch.req_ids
                for request_id, length, row in zip(request_ids, verified.tolist(), drafts.tolist()):
                    recorder.proposals.append({"request_id": request_id, "prefix_length": length + 1, "drafts": row})
            return drafts

        D3DProposer.__init__ = __init__
        D3DProposer.propose = recorded_propose

    def results(self, prompts: list[list[int]], outputs: list) -> list[dict]:
        """Per prompt (vLLM's `RequestOutput`s in the same order): `{"prompt", "output", "proposals"}`, the
        proposals whose prefix lies within prompt + output (the last ones can be for a prefix `max_tokens` cut
        short)."""
        results = []
        for prompt, output in zip(prompts, outputs):
            tokens = list(output.outputs[0].token_ids)
            known = [{"prefix_length": p["prefix_length"], "drafts": p["drafts"]} for p in self.proposals
                     if same_request(p["request_id"], output.request_id)
                     and p["prefix_length"] <= len(prompt) + len(tokens)]
            results.append({"prompt": prompt, "output": tokens, "proposals": known})
        return results


def same_request(engine_id: str, request_id: str) -> bool:
    """The engine core's request id is the caller's plus a random suffix."""
    return engine_id == request_id or engine_id.startswith(f"{request_id}-")


__all__ = ["DraftRecorder", "same_request"]
