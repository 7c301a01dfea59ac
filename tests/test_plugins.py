"""nanojax finds the model loader and the extra subcommands through entry points
(nanojax/plugins.py): installed or from the source tree's pyproject.toml, and a clear
error when there is none."""
import os
import tomllib

import pytest

from nanojax import plugins


@pytest.fixture
def fresh_lookup():
    plugins.model_loader.cache_clear()
    yield
    plugins.model_loader.cache_clear()


def _declared(group: str) -> dict[str, str]:
    with open(plugins.SOURCE_PYPROJECT, "rb") as f:
        return tomllib.load(f)["project"]["entry-points"][group]


def test_the_loader_is_checkpoints_and_has_what_nanojax_asks(fresh_lookup):
    import checkpoints.loader
    loader = plugins.model_loader()
    assert loader is checkpoints.loader
    members = {n for n in dir(plugins.ModelLoader) if not n.startswith("_")} | \
        set(plugins.ModelLoader.__annotations__)
    assert members == {"REGISTERED", "load_model", "convert", "load_tokenizer", "gguf_file"}
    assert all(hasattr(loader, m) for m in members)


def test_search_commands_register():
    from search.cli import register
    assert register in plugins.commands()


def test_the_installed_entry_points_are_the_declared_ones():
    """A stale install (from before an entry point was declared) shows here."""
    for group in (plugins.LOADERS, plugins.COMMANDS):
        installed = {e.name: e.value for e in plugins.entry_points(group=group)}
        if not installed:
            pytest.skip("nanojax is not installed (run from the source tree)")
        assert installed == _declared(group), "reinstall: pip install -e ."


def test_a_source_tree_that_was_not_installed_reads_pyproject(monkeypatch, fresh_lookup):
    """`PYTHONPATH=. python3 -m nanojax` (no metadata): the same entry points."""
    import checkpoints.loader
    monkeypatch.setattr(plugins, "entry_points", lambda group: [])
    assert plugins.model_loader() is checkpoints.loader
    assert [e.value for e in plugins._entry_points(plugins.COMMANDS)] == \
        list(_declared(plugins.COMMANDS).values())


def test_no_loader_is_an_error_that_says_how_to_fix_it(monkeypatch, tmp_path, fresh_lookup,
                                                       capsys):
    monkeypatch.setattr(plugins, "entry_points", lambda group: [])
    monkeypatch.setattr(plugins, "SOURCE_PYPROJECT", tmp_path / "pyproject.toml")
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() adds to it
    with pytest.raises(plugins.PluginError, match=r"pip install -e \."):
        plugins.model_loader()
    assert plugins.commands() == []
    from nanojax.cli import main
    assert main(["info", "random:tiny"]) == 2  # the CLI prints it as any user error
    assert "reinstall with `pip install -e .`" in capsys.readouterr().err
