"""The Gradio Space that shows D3D decoding live beside the target alone."""
