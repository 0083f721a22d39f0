"""The D3D Space: for a prompt, the target alone and D3D async stream side by side, every token coloured by how it
came, with τ, cache-hit rate, tokens/s, speedup and the accepted length of every round.

Run `python space_app/app.py [--target PATH] [--drafter PATH]` (or `d3d space`); a Hugging Face Space runs this
file from the folder's root.
"""

import argparse

import gradio as gr
import torch

if __package__:
    from .decoding import (MAX_FANOUT, MAX_NEW_TOKENS, MAX_TEMPERATURE, Settings, compare_live, default_settings,
                           prepare_request, warm_up, whole_number)
    from .loading import DEFAULT_QUEUE_SIZE, add_arguments, devices, load_models, model_sources
    from .prefill_view import prefill_preview
    from .render import TOKENS_CSS, legend_html, rounds_svg, stats_html, tokens_html
else:  # beside its modules as the root of a Space
    from decoding import (MAX_FANOUT, MAX_NEW_TOKENS, MAX_TEMPERATURE, Settings, compare_live, default_settings,
                          prepare_request, warm_up, whole_number)
    from loading import DEFAULT_QUEUE_SIZE, add_arguments, devices, load_models, model_sources
    from prefill_view import prefill_preview
    from render import TOKENS_CSS, legend_html, rounds_svg, stats_html, tokens_html

INTRO = """# D3D: Decoupled Diffusion Drafting
The drafter proposes a block of `b - 1` tokens in one forward pass; the target verifies it (lossless: greedy output is
the target's own). The target alone runs first, then D3D async on the same prompt, so neither slows the other down."""

# Standard-library-style code, on which the quickstart's target writes its most Python-shaped text (it learned little
# prose: on pydoc passages it writes lines of `#`; see docs/space.md).
EXAMPLES = {
    "code: a loop body": (
        'def find(names, prefix):\n    """Return the names that start with prefix."""\n    result = []\n'
        "    for name in names:\n        if "
    ),
    "code: re.escape": 'def escape(pattern):\n    """Escape special characters in a string.\n    """\n',
    "code: a class": (
        'class Stack:\n    """A last-in, first-out list."""\n\n    def __init__(self):\n        self.items = []\n\n'
        "    def push(self, item):\n        "
    ),
}


def build_demo(
    target, drafter, tokenizer, concurrency_limit: int = 2, queue_size: int = DEFAULT_QUEUE_SIZE
) -> gr.Blocks:
    """The Space's page for loaded models, queued. `concurrency_limit`: requests decoding at once per event (each has
    its own asynchronous generator; they share the weights and the hardware); `queue_size`: requests waiting at most
    (beyond it Gradio answers that the queue is full)."""
    trained_block_size = drafter.config.block_size
    defaults = default_settings(drafter)

    def generate(prompt, block_size, coverage, fanout, temperature, max_new_tokens, lookup=defaults.lookup,
                 policy=defaults.policy):
        try:
            settings = Settings(
                whole_number("block size", block_size), whole_number("coverage C", coverage),
                whole_number("fanout F", fanout), float(temperature), whole_number("max new tokens", max_new_tokens),
                bool(lookup), bool(policy),
            )
            prompt_ids = prepare_request(target, drafter, tokenizer, prompt, settings)
        except (TypeError, ValueError) as error:
            raise gr.Error(str(error)) from error
        for alone, d3d in compare_live(target, drafter, tokenizer, prompt_ids, settings):
            yield (
                tokens_html(alone, "target"), tokens_html(d3d, "d3d"), stats_html(alone, d3d),
                rounds_svg(d3d, trained_block_size),
            )

    with gr.Blocks(title="D3D: Decoupled Diffusion Drafting") as demo:
        gr.Markdown(INTRO)
        with gr.Row():
            prompt = gr.Textbox(value=next(iter(EXAMPLES.values())), label="Prompt", lines=3, scale=4, elem_id="prompt")
            run = gr.Button("Generate", variant="primary", scale=1, elem_id="generate")
        gr.Examples([[text] for text in EXAMPLES.values()], [prompt], example_labels=list(EXAMPLES), elem_id="examples")
        with gr.Accordion("Settings", open=True):
            with gr.Row():
                block_size = gr.Slider(
                    2, trained_block_size, value=defaults.block_size, step=1, precision=0, label="block size b",
                    info=f"drafts b - 1 tokens a round; the drafter was trained with B = {trained_block_size}. "
                    "Below B the target verifies only the first b - 1 drafts of each block.",
                )
                coverage = gr.Slider(
                    1, trained_block_size, value=defaults.coverage, step=1, precision=0, label="coverage C",
                    info="successor branches for the first C - 1 rejection positions",
                )
                fanout = gr.Slider(0, MAX_FANOUT, value=defaults.fanout, step=1, precision=0, label="fanout F", info="alternative anchors per position")
            with gr.Row():
                temperature = gr.Slider(0, MAX_TEMPERATURE, value=defaults.temperature, step=0.05, label="temperature", info="0 is greedy")
                max_new_tokens = gr.Slider(1, MAX_NEW_TOKENS, value=defaults.max_new_tokens, step=1, precision=0, label="max new tokens")
                lookup = gr.Checkbox(value=defaults.lookup, label="prompt lookup", elem_id="lookup",
                                     info="also draft by looking the text's latest n-gram up in the prompt and output; "
                                          "each round verifies what is expected to keep more (lookup tokens in purple)")
                policy = gr.Checkbox(value=defaults.policy, label="verify policy", elem_id="policy",
                                     info="each round verifies only what is expected to pay (nothing, when drafting "
                                          "would cost more than it keeps); off: the whole block every round")
        gr.HTML(legend_html())
        with gr.Row():
            with gr.Column():
                gr.Markdown("### Target alone")
                target_text = gr.HTML(tokens_html(None, "target"), elem_id="target-text", css_template=TOKENS_CSS)
            with gr.Column():
                gr.Markdown("### D3D async")
                d3d_text = gr.HTML(tokens_html(None, "d3d"), elem_id="d3d-text", css_template=TOKENS_CSS)
        stats = gr.HTML(stats_html(None, None), elem_id="stats")
        plot = gr.HTML(rounds_svg(None, trained_block_size), elem_id="rounds-plot")
        # a lookup needs the policy: turning the policy off turns the lookup off too (in the browser, no request)
        policy.change(None, [policy, lookup], lookup, js="(on, looked) => looked && on", queue=False,
                      api_visibility="private")
        inputs = [prompt, block_size, coverage, fanout, temperature, max_new_tokens, lookup, policy]
        outputs = [target_text, d3d_text, stats, plot]
        gr.on(
            [run.click, prompt.submit], generate, inputs, outputs, api_name="generate", concurrency_limit=concurrency_limit
        )
        with gr.Accordion("Selective prefill: which prompt chunks the target would read", open=False):
            gr.Markdown(
                "For long prompts the drafter scores chunks of the prompt with a one-MASK probe and the target "
                "prefills only the best ones (about ρL tokens, in order; the last chunk always). Kept chunks are "
                "shaded by score, dropped ones struck through. With ρ < 1 the output is the target's output on the "
                "kept chunks, no longer on the full prompt."
            )
            with gr.Row():
                retention = gr.Slider(0.05, 1.0, value=0.2, step=0.05, label="retention ρ")
                chunk_size = gr.Slider(1, 256, value=32, step=1, precision=0, label="chunk size (tokens)")
                show_chunks = gr.Button("Show kept chunks", elem_id="show-chunks")
            chunks = gr.HTML(elem_id="prefill-chunks")

        def preview(prompt_text, retention_value, chunk_value, new_tokens):
            try:
                return prefill_preview(
                    target, drafter, tokenizer, prompt_text, retention_value, whole_number("chunk size", chunk_value),
                    whole_number("max new tokens", new_tokens),
                )
            except (TypeError, ValueError) as error:
                raise gr.Error(str(error)) from error

        show_chunks.click(preview, [prompt, retention, chunk_size, max_new_tokens], chunks, api_name="prefill_chunks",
                          concurrency_limit=concurrency_limit)
    return demo.queue(max_size=queue_size)


def serve(args: argparse.Namespace, dtype: torch.dtype | None = None) -> None:
    """Load the models named by `args` (or the environment, or the quickstart folder) in `dtype` (see `load_models`),
    warm them up on the opening example (`decoding.warm_up`) and serve the page."""
    target_source, drafter_source = model_sources(args)
    target_device, drafter_device = devices(args)
    target, drafter, tokenizer = load_models(target_source, drafter_source, target_device, drafter_device, dtype)
    warm_up(target, drafter, tokenizer, next(iter(EXAMPLES.values())))
    demo = build_demo(target, drafter, tokenizer, concurrency_limit=args.concurrency, queue_size=args.queue_size)
    demo.launch(server_name=args.host, server_port=args.port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
