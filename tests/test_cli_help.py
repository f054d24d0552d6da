"""`splitserve <command> --help` describes every flag and states every default; `splitserve --version`.

Each command runs in-process through :func:`splitserve.cli.main`, as the console script does; the parser that
prints the help is caught on its way out (``ArgumentParser.print_help``) so that the printed text can be checked
flag by flag against the parser's own actions.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from splitserve import cli

COMMANDS = [
    ["up"], ["prefill"], ["decode"], ["worker"], ["role"], ["router"], ["colocated"], ["kvstore-master"], ["kvstore-node"], ["generate"],
    ["bench"], ["bench", "compare"], ["bench", "efficiency"],
]


def run_help(command: list[str], monkeypatch, capsys) -> tuple[argparse.ArgumentParser, str]:
    """(the parser that printed the help, the text printed) for ``splitserve <command> --help``."""
    printed: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.print_help

    def recording_print_help(self, file=None):
        printed.append(self)
        original(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", recording_print_help)
    monkeypatch.setenv("COLUMNS", "120")  # argparse wraps to the terminal width
    monkeypatch.delenv("PD_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "--help"])
    assert exit_info.value.code in (0, None)
    assert len(printed) == 1
    return printed[0], capsys.readouterr().out


def option_entries(text: str) -> dict[str, str]:
    """Each option or positional of a help text -> its entry (invocation + description, whitespace collapsed)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if re.match(r"^  \S", line):  # an entry starts at indent 2 ...
            current = line.strip()
            entries[current.split()[0].rstrip(",")] = current
        elif current is not None and re.match(r"^ {3,}\S", line):  # ... and continues at a deeper indent
            key = current.split()[0].rstrip(",")
            entries[key] += " " + line.strip()
            current = entries[key]
        else:
            current = None
    return entries


def description(entry: str, action: argparse.Action) -> str:
    """An entry's text after its invocation (``--flag METAVAR`` or ``-h, --help``)."""
    invocation = argparse.HelpFormatter("x")._format_action_invocation(action)
    assert entry.startswith(invocation), (entry, invocation)
    return entry[len(invocation):].strip()


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_describes_every_flag_and_shows_its_default(command, monkeypatch, capsys):
    parser, text = run_help(command, monkeypatch, capsys)
    assert parser.prog == "splitserve " + " ".join(command)
    entries = option_entries(text)
    for action in parser._actions:
        name = action.option_strings[0] if action.option_strings else action.dest
        assert name in entries, f"{name} missing from:\n{text}"
        said = description(entries[name], action)
        assert said, f"splitserve {' '.join(command)} {name} has no description"
        if not action.option_strings or action.default in (None, argparse.SUPPRESS, [], False):
            continue
        assert "(default: " in said, f"splitserve {' '.join(command)} {name}: default {action.default!r} not shown: {said}"
        if "(default: $" not in said:  # the value itself (a help that names an environment variable gives its rule)
            assert f"(default: {action.default})" in said, said


def test_help_never_shows_the_api_key(monkeypatch, capsys):
    for command in (["up"], ["router"], ["colocated"], ["generate"]):
        monkeypatch.setenv("PD_API_KEY", "sekrit-key-42")
        with pytest.raises(SystemExit):
            cli.main([*command, "--help"])
        out = capsys.readouterr().out
        assert "--api-key" in out and "sekrit-key-42" not in out


def test_help_shows_effective_environment_defaults(monkeypatch, capsys):
    monkeypatch.setenv("PD_KV_CACHE_MB", "77")
    _, text = run_help(["up"], monkeypatch, capsys)
    assert "(default: 77)" in option_entries(text)["--kv-cache-mb"]


def test_version(capsys):
    version = re.search(r'^version = "(.+)"', (Path(cli.__file__).parents[1] / "pyproject.toml").read_text(), re.MULTILINE)
    for flag in ("--version", "-V"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([flag])
        assert exit_info.value.code == 0
        assert capsys.readouterr().out == f"splitserve {version.group(1)}\n"


def test_version_without_installed_metadata(monkeypatch):
    """A source tree that is not pip-installed still knows its version (from pyproject.toml)."""
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.version() == importlib.metadata.distribution("splitserve").version


def test_top_level_usage_mentions_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0 and "--version" in capsys.readouterr().out
