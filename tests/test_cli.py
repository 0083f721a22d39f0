from cli.main import main


def test_demo_runs_and_reports_lossless_output(capsys):
    assert main(["demo", "--prompts", "2", "--max-new-tokens", "20", "--block-size", "4", "--vocab-size", "6"]) == 0
    table = capsys.readouterr().out
    assert "| D3D drafter, B=4 |" in table and table.rstrip().endswith("| True |")
