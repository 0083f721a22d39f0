"""Publishing a drafter folder to the Hugging Face Hub with its remote code and model card."""
