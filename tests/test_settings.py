"""Every server setting is declared once (`hybridlm.settings.declared`): `hybridlm serve --help`, the
environment variables and the table in docs/command-line.md all come from that declaration (issue 27)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from hybridlm.cli import build_parser
from hybridlm.settings import Settings
from hybridlm.settings.declared import OTHER_ENVIRONMENT, declared, markdown_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "command-line.md"


def serve_help() -> str:
    return build_parser()._subparsers._group_actions[0].choices["serve"].format_help()


def test_serve_help_lists_every_setting_with_its_variable():
    text = " ".join(serve_help().split())
    for name, flag in declared():
        assert flag.option(name) in text, name
        if flag.env:
            assert f"[env {flag.env}" in text, name
    epilog = serve_help().split("environment variables")[1]
    named = {line.split()[0] for line in epilog.splitlines()[1:] if line.strip()}
    assert named == {f.env for _, f in declared() if f.env} | set(OTHER_ENVIRONMENT)


def test_serve_parses_into_every_field_and_nothing_else():
    args = build_parser().parse_args(["serve"])
    options = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert options - {"help"} == {f.name for f in fields(Settings)}
    assert Settings.of(args) == Settings.parse([])


# ids by name: a Flag's repr holds function addresses, which differ between pytest-xdist's workers
@pytest.mark.parametrize(
    ("name", "flag"), [pytest.param(n, f, id=n) for n, f in declared() if f.env]
)
def test_each_variable_sets_its_setting(name, flag, monkeypatch):
    examples = {"cache_store": "redis://h:1/2", "quantize": "int8", "draft_quantize": "int4"}
    examples |= {"speculative": "ngram", "context_length": "64", "port": "8123"}
    if flag.switch:
        text, expected = "0", True
    else:
        text = examples.get(name, "3" if flag.type is not None else "a-value")
        expected = flag.value(text)
    monkeypatch.setenv(flag.env, text)
    assert getattr(Settings.parse([]), name) == expected
    assert getattr(Settings.parse([]), name) != getattr(Settings(), name)
    monkeypatch.delenv(flag.env)
    assert getattr(Settings.parse([]), name) == getattr(Settings(), name)


def test_the_docs_table_is_the_declaration():
    text = DOCS.read_text()
    assert markdown_table() in text, (
        f"{DOCS} is out of date: replace its settings table with the output of\n"
        "python -c 'from hybridlm.settings.declared import markdown_table; print(markdown_table())'"
    )
