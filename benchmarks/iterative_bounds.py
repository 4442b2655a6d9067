"""Likelihoods for the iterative-generation comparison (``benchmarks/iterative.py``).

Owns three measurements, each computed straight from a model backend's ``forward`` (never
through a sampler, so the sampling code under comparison does not score itself):

* :func:`ar_nll` — the exact negative log-likelihood of a continuation under an
  autoregressive backend, in one forward over context + continuation. It scores generated
  answers (the quality proxy: the output's perplexity under the tiny AR model) and held-out
  text (the AR model's exact held-out NLL).
* :func:`masked_elbo` — a Monte-Carlo estimate of the masked-diffusion bound on a
  document's NLL, block by block as the model was trained (BD3-LM block-causal: a block is
  denoised over the clean prefix; the clean block is then written to the cache), with its
  variance.
* :func:`held_out_conversations` — the held-out split both training scripts use (every 50th
  conversation of the tiny AR model's corpus), encoded with the shipped tokenizer.

The masked bound. For a block x of L tokens after a clean prefix c, MDLM's / LLaDA's
continuous-time bound with the linear schedule is

    -log p(x | c) <= E_{t ~ U(0,1)} [ (1/t) sum_{i masked} -log p(x_i | x_t, c) ],

each position masked independently with probability t. Integrating t out for a mask set S of
size k gives the weight B(k, L-k+1) = (k-1)!(L-k)!/L!, and the C(L, k) sets of that size
carry 1/k in all, so the same bound is

    E_{k ~ U{1..L}} E_{S: |S| = k} [ (L/k) sum_{i in S} -log p(x_i | x_S masked, c) ]

(LLaDA's likelihood estimator). We sample this form: equal in expectation, with finite
variance (the 1/t form's second moment diverges logarithmically as t -> 0). A document's
bound is the sum over its blocks; each block gets ``draws`` independent (k, S) draws, so the
estimate's variance is the sum of the blocks' sample variances over ``draws``.

Continuous diffusion and flow over embeddings get no bound here: their models were trained on
x0-reconstruction losses that bound nothing, and a variational bound with a rounding term
(Diffusion-LM) or an ODE likelihood with a trace estimator (flow) is a research project of
its own, not a few lines of arithmetic.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.contracts.model import Attention, ModelCall

ROOT = Path(__file__).resolve().parent.parent
HOLD_OUT_EVERY = 50  # scripts/train_default_model.py: conversation i is held out when i % 50 == 49
CORPUS_SEED = 1234   # the seed both training scripts build the conversations with


class ForwardBackend(Protocol):
    """What these measurements need of a backend (a subset of ``pipeline.contracts.model.Backend``)."""

    vocab_size: int

    def allocate(self) -> int: ...
    def release(self, slot: int) -> None: ...
    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor: ...


def ar_nll(backend: ForwardBackend, context: Sequence[int], target: Sequence[int]) -> float:
    """Summed NLL (nats) of ``target`` following ``context``, from one causal forward.

    The logits at context[-1] .. target[-2] predict target[0] .. target[-1]; computed in
    float64 after the backend's float32 logits.
    """
    if not context:
        raise ValueError("ar_nll needs at least one context token (nothing predicts the first)")
    if not target:
        return 0.0
    ids = tuple(context) + tuple(target)
    outside = sorted({i for i in ids if not 0 <= i < backend.vocab_size})
    if outside:
        raise ValueError(f"token ids {outside} are outside the scoring model's vocabulary "
                         f"(0..{backend.vocab_size - 1})")
    slot = backend.allocate()
    try:
        wanted = tuple(range(len(context) - 1, len(ids) - 1))
        logits = backend.forward([ModelCall(slot, ids, 0, wanted)])               # [n, V]
    finally:
        backend.release(slot)
    logp = torch.log_softmax(logits.double(), -1)
    return float(-logp.gather(1, torch.tensor(target)[:, None]).sum())


def _block_draw(backend: ForwardBackend, slot: int, start: int, block: Sequence[int],
                mask_id: int, gen: torch.Generator) -> float:
    """One (k, S) draw of the block's bound: (L/k) * sum over the k masked positions of
    their NLL, from one denoising pass that writes nothing."""
    length = len(block)
    k = int(torch.randint(1, length + 1, (1,), generator=gen))
    chosen = sorted(torch.randperm(length, generator=gen)[:k].tolist())
    noisy = list(block)
    for i in chosen:
        noisy[i] = mask_id
    call = ModelCall(slot, tuple(noisy), start, tuple(chosen), Attention.BLOCK, write=False)
    logp = torch.log_softmax(backend.forward([call]).double(), -1)               # [k, V]
    truth = torch.tensor([block[i] for i in chosen])
    return length / k * float(-logp.gather(1, truth[:, None]).sum())


def masked_elbo(backend: ForwardBackend, doc: Sequence[int], mask_id: int, block_length: int,
                draws: int, gen: torch.Generator) -> tuple[float, float]:
    """(bound, variance of the estimate): the Monte-Carlo masked-diffusion bound (nats) on
    -log p(doc[1:] | doc[0]), blocks of ``block_length`` from position 1, ``draws`` draws
    per block (at least 2, so each block's variance can be estimated)."""
    if draws < 2:
        raise ValueError(f"draws must be >= 2 to estimate the variance, got {draws}")
    if block_length < 1:
        raise ValueError(f"block_length must be >= 1, got {block_length}")
    if mask_id in doc:
        raise ValueError(f"the document contains the mask token {mask_id}")
    slot = backend.allocate()
    try:
        backend.forward([ModelCall(slot, (doc[0],), 0, ())])
        bound = variance = 0.0
        for start in range(1, len(doc), block_length):
            block = doc[start:start + block_length]
            values = torch.tensor([_block_draw(backend, slot, start, block, mask_id, gen)
                                   for _ in range(draws)], dtype=torch.float64)
            bound += float(values.mean())
            variance += float(values.var()) / draws
            backend.forward([ModelCall(slot, tuple(block), start, ())])           # clean write
    finally:
        backend.release(slot)
    return bound, variance


def ar_held_out(backend: ForwardBackend, docs: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The AR model's exact held-out NLL per token (each document's tokens after its first)."""
    nll = sum(ar_nll(backend, doc[:1], doc[1:]) for doc in docs)
    tokens = sum(len(doc) - 1 for doc in docs)
    return {"bound": "exact NLL", "tokens": tokens, "nats_per_token": nll / tokens,
            "standard_error": 0.0}


def masked_held_out(backend: ForwardBackend, docs: Sequence[Sequence[int]], mask_id: int,
                    block_length: int, draws: int, seed: int = 0) -> dict[str, Any]:
    """The masked model's bound per token on ``docs`` with its Monte-Carlo standard error."""
    gen = torch.Generator().manual_seed(seed)
    bound = variance = 0.0
    for doc in docs:
        b, v = masked_elbo(backend, doc, mask_id, block_length, draws, gen)
        bound, variance = bound + b, variance + v
    tokens = sum(len(doc) - 1 for doc in docs)
    return {"bound": f"ELBO, blocks of {block_length}, {draws} draws per block",
            "tokens": tokens, "nats_per_token": bound / tokens,
            "standard_error": math.sqrt(variance) / tokens}


def held_out_conversations(limit: int | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """The held-out conversations of the training scripts (every 50th, seed 1234), encoded with
    the tiny AR model's tokenizer (the masked model's is the same plus ``<|mask|>``, which no
    text encodes to); the first ``limit`` of them when given. The stats say whether this
    Python collected the very corpus the models were trained on (its sha256 against the AR
    model's training log): the standard library's docstrings vary between Python versions."""
    from tokenizers import Tokenizer

    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import train_default_model as corpus

    sections = corpus.topic_sections() + corpus.docstring_sections(corpus.stdlib_module_names())
    convs = corpus.conversations(sections, CORPUS_SEED)
    tok = corpus.hf_tokenizer(Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json")))
    docs = corpus.encode_conversations(convs, tok)
    held = [d for i, d in enumerate(docs) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    if limit is not None:
        held = held[:limit]
    digest = corpus.corpus_digest(sections)
    trained = json.loads((TINY_MODEL_DIR / "training_log.json").read_text())["data"]
    return held, {"conversations": len(held), "tokens": sum(map(len, held)),
                  "corpus_sha256": digest,
                  "corpus_matches_training": digest == trained["corpus_sha256"]}
