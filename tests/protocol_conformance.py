"""Checked by mypy --strict (see test_protocols.py): every implementation satisfies its
Protocol structurally, which a runtime isinstance check (names only) cannot prove."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from pipeline import (
    Backend, Delta, Detokenizer, LogitProcessor, Renderer, Selector, Stopper, Strategy, Tokenizer,
    Transport,
)
from pipeline import testing
from pipeline.contracts.model import (
    CacheInspector, Embedder, EmbeddingInputs, ModelDescriber, PagedBackend,
)
from pipeline.contracts.text import DocumentEncoder, ToolCallParser, ToolCallReader
from pipeline.tools import (
    AllowAll, FunctionTool, JsonlLedger, Ledger, MemoryLedger, Rules, ToolExecutor, ToolPolicy,
)
from pipeline.tools.formats import HermesParser, Llama3Parser, MistralParser
from stages import detokenize, process, render, select, stop, strategies, tokenize
from stages.structured import GrammarProcessor
from backends.torch.backend import TorchBackend
from stages.strategies.draft import DraftModelProposer
from stages.strategies.proposers import NgramProposer, Proposer
from stages.strategies.continuous.integrators import (
    DiffusionIntegrator, FlowIntegrator, Integrator,
)
from stages.strategies.continuous.schedules import NoiseSchedule
from stages.strategies.continuous.strategy import ContinuousStrategy
from stages.strategies.continuous.updates import uniform_grid
from stages.strategies.diffusion import (
    DiffusionSettings, DiscreteFlowStrategy, FastDllmStrategy, LladaStrategy,
)
from stages.strategies.speculative import SpeculativeStrategy
from transports import AsyncioTransport, InProcessTransport


def _double(x: int) -> int:
    """Twice ``x``."""
    return 2 * x


def conformance(tok: tokenize.HFTokenizer, torch_backend: TorchBackend) -> None:
    renderers: list[Renderer] = [
        render.HFChatTemplateRenderer.from_template("{{ messages[0].content }}"),
        render.PlainRenderer(), testing.ChatMLRenderer()]
    tokenizers: list[Tokenizer] = [tok, testing.ByteTokenizer()]
    documents: DocumentEncoder = tok
    detokenizers: list[Detokenizer[Any]] = [
        detokenize.IncrementalDetokenizer(tok), testing.ByteDetokenizer()]
    processors: list[LogitProcessor] = [
        process.AllowedTokens(), process.BannedTokens(), process.LogitBias(), process.MinTokens(),
        process.RepetitionPenalty(), process.PresencePenalty(), process.FrequencyPenalty(),
        process.Temperature(), process.TopK(), process.TopP(), process.MinP(), process.TypicalP(),
        testing.BanTokenProcessor(3), GrammarProcessor(tok)]
    selectors: list[Selector] = [select.GreedySelector(), select.SamplingSelector(),
                                 testing.ScriptedSelector(lambda row: 0)]
    strategy: Strategy = strategies.AutoregressiveStrategy(process.ProcessorChain(processors),
                                                           selectors[0])
    stoppers: list[Stopper[Any]] = [stop.make_stopper(n) for n in stop.DEFAULT_STOPPERS]
    stoppers.append(testing.TokenCountStopper(3))
    backend: Backend = testing.ScriptedBackend(10, testing.peaked(10, lambda t: 1))
    real: Backend = torch_backend
    described: ModelDescriber = torch_backend
    paged: PagedBackend = torch_backend
    inspector: CacheInspector = torch_backend
    chain = process.ProcessorChain(processors)
    ngram: Proposer = NgramProposer()
    draft: Proposer = DraftModelProposer(backend, chain, 10)
    speculative: Strategy = SpeculativeStrategy(chain, selectors[1], ngram, 4)
    embedding: EmbeddingInputs = torch_backend
    embedder: Embedder = torch_backend
    integrators: list[Integrator] = [
        DiffusionIntegrator(NoiseSchedule.make(), 10), FlowIntegrator(uniform_grid(4), "heun")]
    continuous: Strategy = ContinuousStrategy("ddim", embedding, integrators[0], 16)
    masked = DiffusionSettings(mask_token_id=9)
    diffusion: list[Strategy] = [LladaStrategy(chain, masked), FastDllmStrategy(chain, masked),
                                 DiscreteFlowStrategy(chain, masked)]
    sync: Transport[Iterator[Delta]] = InProcessTransport()
    asyncs: Transport[AsyncIterator[Delta]] = AsyncioTransport()
    del renderers, tokenizers, documents, detokenizers, selectors, strategy, stoppers, backend
    parsers: list[ToolCallParser] = [HermesParser(), Llama3Parser(), MistralParser()]
    readers: list[ToolCallReader] = [p.start("r") for p in parsers]
    executor: ToolExecutor = FunctionTool(_double)
    policies: list[ToolPolicy] = [AllowAll(), Rules({})]
    ledgers: list[Ledger] = [MemoryLedger(), JsonlLedger("ledger.jsonl")]
    del real, sync, asyncs, described, draft, speculative, paged, inspector, continuous
    del diffusion, masked
    del parsers, readers, executor, policies, ledgers
