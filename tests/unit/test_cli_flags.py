"""`mlaserve --version`, and every subcommand's --help showing its defaults."""

import pytest

from mlaserve import __version__
from mlaserve.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mlaserve {__version__}"


@pytest.mark.parametrize("argv", [["serve"], ["generate"], ["bench", "serve"], ["bench", "compare"]])
def test_help_shows_defaults(argv, capsys):
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert "(default:" in out
    if argv == ["serve"]:
        assert "--max-logprobs" in out and "(default: 20)" in " ".join(out.split())
