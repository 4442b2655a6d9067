"""Plugin registry: built-ins through the same hooks, third-party plugins by name, errors."""

from __future__ import annotations

import pytest

from pipeline import build
from transports import cli
from pipeline.errors import PluginLoadError, UnknownNameError
from pipeline.hookspecs import hookimpl
from pipeline.registry import Registry
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, peaked
from plugins import third_party

V = ByteTokenizer.VOCAB


def test_builtins_arrive_through_entry_points() -> None:
    registry = Registry()
    assert {"top_p", "temperature", "min_tokens"} <= set(registry.names("processor"))
    assert {"greedy", "sample"} <= set(registry.names("selector"))
    assert {"inprocess", "asyncio"} <= set(registry.names("transport"))
    plugins = {c.plugin for c in registry.components()}
    assert {"stages", "transports"} <= plugins


def test_unknown_name_lists_what_exists() -> None:
    with pytest.raises(UnknownNameError) as info:
        Registry().get("processor", "top_q")
    assert "top_p" in info.value.available and "top_q" in str(info.value)
    with pytest.raises(UnknownNameError, match="registered selectors"):
        build_scripted(ScriptedBackend(V, peaked(V, lambda t: 65)), selector="nucleus")


def test_a_third_party_processor_is_used_by_name() -> None:
    # the scripted model prefers token 65 ('A', odd); the plugin bans odd ids, so 'B' wins
    logits = peaked(V, lambda t: 65, height=60.0)

    def two_peaks(tokens):
        out = logits(tokens)
        out[66] = 50.0
        return out

    with build_scripted(ScriptedBackend(V, two_peaks), plugins=[third_party],
                        processors=["no_odd_tokens"]) as pipe:
        # top_p=1 switches off the pipeline default's truncation: the chain is ours alone
        done = pipe.generate("x", max_tokens=3, temperature=0.5, top_p=1.0, seed=1)
        assert done.text == "BBB"
        configured = [e for e in done.trace if e.event_type == "selection.configured"]
        assert configured[0].payload["processors"] == ["no_odd_tokens", "temperature"]
    with build_scripted(ScriptedBackend(V, two_peaks), plugins=[third_party],
                        processors=["temperature", "no_odd_tokens"],
                        replace_processors=True) as pipe:
        done = pipe.generate("x", max_tokens=3, temperature=0.5, seed=1)
        assert done.text == "BBB"
        configured = [e for e in done.trace if e.event_type == "selection.configured"]
        assert configured[0].payload["processors"] == ["temperature", "no_odd_tokens"]


def test_a_broken_plugin_is_named_in_the_error() -> None:
    class Broken:
        @hookimpl
        def pipeline_components(self):
            raise ImportError("missing dependency")

    with pytest.raises(PluginLoadError, match="broken-plugin"):
        registry = Registry()
        registry.register(Broken(), name="broken-plugin")
        registry.components()


def test_cli_lists_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "processor:" in out and "top_p" in out and "[stages]" in out


def test_the_builder_defaults_name_what_the_stages_define() -> None:
    # the core may not import stages, so the defaults are written twice; keep them in step
    from pipeline import builder
    from stages.process import DEFAULT_ORDER
    from stages.stop import DEFAULT_STOPPERS

    assert builder.DEFAULT_PROCESSORS == ("grammar", *DEFAULT_ORDER)
    assert builder.DEFAULT_STOPPERS == tuple(DEFAULT_STOPPERS)
    registry = Registry()
    assert set(builder.DEFAULT_PROCESSORS) <= set(registry.names("processor"))
