"""The embedded default: a target, an AR assistant and a D3D drafter trained on text that ships with Python."""
