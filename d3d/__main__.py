"""`python -m d3d ARGS` is the `d3d ARGS` command (e.g. under `accelerate launch -m d3d train ...`)."""

import sys

from d3d.cli.main import main

sys.exit(main())
