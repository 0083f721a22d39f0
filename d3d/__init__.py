"""D3D, the tools around the drafter: the `d3d` command (`d3d.cli`), the embedded default (`d3d.quickstart`),
benchmarks (`d3d.benchmark`), training (`d3d.trainer`), publishing (`d3d.hub_upload`), the Space (`d3d.space_app`),
and what several of them share (`d3d.common`). The drafter itself is the self-contained `modeling_d3d` package.

`d3d.trainer`, `d3d.hub_upload` and `d3d.space_app` live in the repository's top-level `trainer/`, `hub_upload/` and
`space_app/` folders (setup.cfg's `package_dir`); the rest in this folder. Layers import only downwards:
cli > quickstart > benchmark > space_app > hub_upload > trainer > common > modeling_d3d (docs/architecture.md).
Importing this package imports nothing else.
"""
