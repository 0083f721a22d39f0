import subprocess
import sys
from pathlib import Path

from cli.main import main


def test_demo_runs_and_reports_lossless_output(capsys):
    assert main(["demo", "--prompts", "2", "--max-new-tokens", "20", "--block-size", "4", "--vocab-size", "6"]) == 0
    table = capsys.readouterr().out
    assert "| D3D drafter, B=4 |" in table and table.rstrip().endswith("| True |")


def test_bench_needs_no_training_extras():
    """`d3d bench --help` imports neither `datasets` nor the trainer (inference installs lack them)."""
    code = "import sys; from cli.main import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\nprint(sorted(m for m in ('datasets', 'trainer') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
