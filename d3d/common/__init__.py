"""What the commands, the quickstart, the benchmarks and training share: the dtype choice, host memory, Python's own
text and prompt sets, prompt encoding, decoding a prompt set with one method, model-file checks and report writing."""
