"""The transformers backend: a model's own transformers implementation behind
:class:`~pipeline.contracts.model.Backend`.

:class:`TransformersBackend` loads any causal LM ``AutoModelForCausalLM`` loads from a local
folder (never the network) and keeps, per slot, a transformers cache and the token ids it
holds. A forward runs the decode tokens of slots whose caches keep every position as one batch:
their keys and values left-padded to the longest, the padding masked, each slot's cache
given its new position after (a row may then differ from the same token alone in the last
bits: this backend does not claim batch invariance). Prompt chunks, and slots with
sliding-window layers (whose caches keep a window), run one after another, each as one
model call over the slot's cache. Truncation rebuilds the slot's cache from its
kept tokens, which is exact for every cache kind (sliding-window layers keep only a window
and cannot be cut back). Everything is checked before any call runs, so a refused call
leaves every cache as it was; a call that fails while running has the calls before it
rolled back too, and the slots at fault are named (:class:`~pipeline.errors.SlotError`).

What it does not honour is stated in :attr:`TransformersBackend.honours`: paged prefix
sharing (it is not a :class:`~pipeline.contracts.model.PagedBackend`, so the engine's prefix
cache is off), draft verification, batch invariance, block attention, embedding inputs; the
builder refuses a build that asks for one.

Example::

    backend = TransformersBackend.from_dir("gemma-folder", dtype="float32", num_slots=2)
    slot = backend.allocate()
    z = backend.forward([ModelCall(slot, ids, 0, (len(ids) - 1,))])     # [1, V] float32
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from backends.transformers.taps import Hooks
from pipeline.contracts.model import (
    Attention, BackendHonours, ModelCall, ModelInfo, Tap,
)
from pipeline.errors import ArtifactError, CapacityError, InvalidValueError, SlotError
from pipeline.model_paths import folder_snapshot

HONOURS = BackendHonours(batch_invariance=False, draft_verification=False,
                         prefix_sharing=False, block_attention=False, embedding_inputs=False)
"""What this backend can do beyond plain calls: none of the optional capabilities."""


def import_transformers() -> Any:
    """The ``transformers`` module, or an :class:`~pipeline.errors.ArtifactError` saying how
    to install the optional extra."""
    try:
        import transformers
    except ImportError as exc:
        raise ArtifactError("the transformers backend needs the transformers package: "
                            "pip install 'explicit-pipeline[transformers]'") from exc
    return transformers


class TransformersBackend:
    """A transformers ``PreTrainedModel`` (a causal LM) with a cache per slot.

    ``model`` is the loaded model (in eval mode), ``snapshot`` its checkpoint's digest,
    ``num_slots`` the sequences at once, ``max_context`` the window (default and upper bound:
    the config's ``max_position_embeddings`` when it has one), ``threads`` the CPU threads of
    every forward (None: torch's count).
    """

    honours = HONOURS
    batch_invariant = HONOURS.batch_invariance
    """Declared in every trace's instance: a row's logits may depend on its batch."""

    def __init__(self, model: Any, snapshot: str, *, num_slots: int = 8,
                 max_context: int | None = None, threads: int | None = None) -> None:
        if num_slots < 1:
            raise InvalidValueError("num_slots", num_slots, "must be at least 1")
        config = model.config
        own = getattr(config, "max_position_embeddings", None)
        if max_context is None:
            if own is None:
                raise InvalidValueError("max_context", None, "this model's config has no "
                                        "max_position_embeddings: give max_context")
            max_context = int(own)
        if max_context < 1 or (own is not None and max_context > int(own)):
            raise InvalidValueError("max_context", max_context,
                                    f"must be 1..{own} (the model's max_position_embeddings)")
        self.model = model
        self.snapshot = snapshot
        self.threads = threads
        """The CPU threads every forward runs on (None: torch's count as it is), set at each
        forward: two backends in one process (``pipeline compare``) keep their own."""
        self.num_slots = num_slots
        self.max_context = max_context
        head = model.get_output_embeddings()
        self.vocab_size = int(head.weight.shape[0] if head is not None else config.vocab_size)
        self.device = next(model.parameters()).device
        self._caches: dict[int, Any] = {}
        self._tokens: dict[int, list[int]] = {}
        self._hooks = Hooks(model)
        params = inspect.signature(model.forward).parameters
        self._keep = "logits_to_keep" in params
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        """The forward's cache keyword: ``cache`` since transformers 5.x renamed it."""

    @classmethod
    def from_dir(cls, path: str | Path, *, dtype: torch.dtype | str | None = None,
                 device: str = "cpu", num_slots: int = 8, max_context: int | None = None,
                 threads: int | None = None) -> TransformersBackend:
        """Load the folder ``path`` with ``AutoModelForCausalLM`` (local files only).

        ``dtype``: the compute dtype (None: the checkpoint's own). Raises
        :class:`~pipeline.errors.ArtifactError` for a folder transformers cannot load as a
        causal LM, naming why."""
        transformers = import_transformers()
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise ArtifactError(f"{folder}: no config.json (the transformers backend loads a "
                                "Hugging Face model folder)")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype if dtype is not None else "auto",
                local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ArtifactError(f"{folder}: transformers cannot load it as a causal language "
                                f"model: {exc}") from exc
        model = model.to(device).eval()
        return cls(model, folder_snapshot(folder), num_slots=num_slots,
                   max_context=max_context, threads=threads)

    # --- slots ------------------------------------------------------------------------------

    def allocate(self) -> int:
        """The lowest free slot with an empty cache; :class:`CapacityError` when all are busy."""
        slot = next((s for s in range(self.num_slots) if s not in self._tokens), None)
        if slot is None:
            raise CapacityError(f"all {self.num_slots} slots are busy")
        self._tokens[slot] = []
        self._caches[slot] = self._new_cache()
        return slot

    def release(self, slot: int) -> None:
        """Free ``slot`` and its cache."""
        self._tokens.pop(slot, None)
        self._caches.pop(slot, None)

    def cache_length(self, slot: int) -> int:
        """Positions ``slot``'s cache covers."""
        self._check([slot])
        return len(self._tokens[slot])

    def truncate(self, slot: int, length: int) -> None:
        """Keep ``slot``'s first ``length`` positions (the cache is rebuilt from them)."""
        self._check([slot])
        kept = self._tokens[slot]
        if not 0 <= length <= len(kept):
            raise SlotError([slot], f"cannot truncate a cache of {len(kept)} positions to "
                            f"{length}")
        if length < len(kept):
            self._rebuild(slot, kept[:length])

    def _check(self, slots: Sequence[int]) -> None:
        bad = [s for s in slots if s not in self._tokens]
        if bad:
            raise SlotError(bad, f"slot(s) {bad} not allocated")

    def _new_cache(self) -> Any:
        transformers = import_transformers()
        return transformers.DynamicCache(config=self.model.config)

    def _rebuild(self, slot: int, tokens: list[int]) -> None:
        """A fresh cache for ``slot`` holding ``tokens``."""
        cache = self._new_cache()
        if tokens:
            rows, self._hooks.rows = self._hooks.rows, []  # no receiver asked for these states
            try:
                with torch.inference_mode():
                    self._run(cache, tokens, 0, ())
            finally:
                self._hooks.rows = rows
        self._caches[slot], self._tokens[slot] = cache, list(tokens)

    # --- forward ----------------------------------------------------------------------------

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        """Logits ``[N, V]`` float32 at the wanted outputs, in call order. Every call is
        checked before any runs. Decode tokens of slots whose caches keep every position
        (no sliding-window layer) run as one batch (:meth:`_batched`); the other calls run
        one after another, each over its slot's cache."""
        self._refuse(calls)
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        together = [i for i, c in enumerate(calls) if self._batchable(c)]
        if len(together) < 2:
            together = []
        rows: dict[int, torch.Tensor] = {}
        done: list[tuple[int, int]] = []  # (slot, length before) of the calls that ran
        with torch.inference_mode():
            if together:
                try:
                    batched = self._batched([calls[i] for i in together], together)
                except Exception as exc:  # no cache was touched
                    raise SlotError([calls[i].slot for i in together], exc) from exc
                for i, row in zip(together, batched):
                    rows[i] = row
                    done.append((calls[i].slot, len(self._tokens[calls[i].slot]) - 1))
            for index, call in enumerate(calls):
                if index in rows:
                    continue
                slot = call.slot
                before = len(self._tokens[slot])
                self._hooks.rows = [index]
                try:
                    logits = self._run(self._caches[slot], list(call.token_ids), call.start,
                                       call.outputs)
                except Exception as exc:
                    for s, n in [*done, (slot, before)]:  # the calls before it undone too
                        self._rebuild(s, self._tokens[s][:n])
                    raise SlotError([slot], exc) from exc
                rows[index] = logits
                if call.write:
                    self._tokens[slot].extend(call.token_ids)
                    done.append((slot, before))
                else:
                    self._rebuild(slot, self._tokens[slot][:before])
        if not rows:
            return torch.empty(0, self.vocab_size)
        return torch.cat([rows[i] for i in sorted(rows)]).float()

    def _batchable(self, call: ModelCall) -> bool:
        """A decode token that writes, over a cache of plain layers holding every position."""
        if len(call.token_ids) != 1 or call.outputs != (0,) or not call.write:
            return False
        layers = getattr(self._caches[call.slot], "layers", None)
        if not layers:
            return False
        return all(type(layer).__name__ == "DynamicLayer"
                   and getattr(layer, "is_initialized", True) for layer in layers)

    def _batched(self, calls: Sequence[ModelCall], indices: Sequence[int]) -> list[torch.Tensor]:
        """One forward of several slots' decode tokens: each slot's keys and values
        left-padded to the longest and stacked, the padding masked; each slot's cache then
        gets its new position. Rows ``[1, V]`` in ``calls`` order. No slot's cache changes
        unless every row was computed."""
        transformers = import_transformers()
        caches = [self._caches[c.slot] for c in calls]
        lengths = [len(self._tokens[c.slot]) for c in calls]
        longest = max(lengths)
        batch = transformers.DynamicCache()
        for layer in range(len(caches[0].layers)):
            keys, values = [], []
            for cache, n in zip(caches, lengths):
                k, v = cache.layers[layer].keys, cache.layers[layer].values   # [1, Hkv, n, D]
                pad = longest - n
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            batch.update(torch.cat(keys), torch.cat(values), layer)
        mask = torch.zeros(len(calls), longest + 1, dtype=torch.long, device=self.device)
        for b, n in enumerate(lengths):
            mask[b, longest - n:] = 1
        ids = torch.tensor([[c.token_ids[0]] for c in calls], device=self.device)
        positions = torch.tensor([[n] for n in lengths], device=self.device)
        self._hooks.rows = list(indices)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **{self._cache_arg: batch})
        logits: torch.Tensor = out.logits[:, -1]                               # [B, V]
        for layer in range(len(caches[0].layers)):
            new_k = batch.layers[layer].keys[:, :, -1:]
            new_v = batch.layers[layer].values[:, :, -1:]
            for b, cache in enumerate(caches):
                cache.update(new_k[b:b + 1], new_v[b:b + 1], layer)
        for c in calls:
            self._tokens[c.slot].append(c.token_ids[0])
        return [logits[b:b + 1] for b in range(len(calls))]

    def _refuse(self, calls: Sequence[ModelCall]) -> None:
        """A :class:`SlotError` naming every call this backend cannot run, before any runs."""
        self._check([c.slot for c in calls])
        slots = [c.slot for c in calls]
        reasons: dict[int, str] = {}
        for call in calls:
            n = len(call.token_ids)
            why = None
            if slots.count(call.slot) > 1:
                why = "two calls for one slot in one forward"
            elif call.attention is not Attention.CAUSAL:
                why = "block attention is not honoured by the transformers backend"
            elif (call.embeddings is not None or call.time is not None
                  or call.self_condition is not None):
                why = "embedding inputs are not honoured by the transformers backend"
            elif call.blocks is not None:
                why = "block tables are not honoured (the transformers backend keeps its memory)"
            elif n == 0:
                why = "a call with no tokens"
            elif call.start != len(self._tokens[call.slot]):
                why = (f"starts at {call.start} but the slot's cache holds "
                       f"{len(self._tokens[call.slot])} positions")
            elif call.start + n > self.max_context:
                why = f"positions up to {call.start + n} exceed the window of {self.max_context}"
            elif any(not 0 <= t < self.vocab_size for t in call.token_ids):
                why = f"a token id outside the vocabulary 0..{self.vocab_size - 1}"
            elif any(not 0 <= o < n for o in call.outputs) or list(call.outputs) != sorted(
                    set(call.outputs)):
                why = f"outputs {list(call.outputs)} are not ascending offsets into {n} tokens"
            if why is not None:
                reasons[call.slot] = why
        if reasons:
            raise SlotError(sorted(reasons), "; ".join(f"slot {s}: {w}"
                                                       for s, w in sorted(reasons.items())))

    def _run(self, cache: Any, tokens: list[int], start: int,
             outputs: Sequence[int]) -> torch.Tensor:
        """One model call of ``tokens`` at ``start..`` over ``cache``: ``[len(outputs), V]``."""
        ids = torch.tensor([tokens], device=self.device)
        n = len(tokens)
        kwargs: dict[str, Any] = {self._cache_arg: cache}
        if self._keep:  # only the wanted rows of the head (a long prompt's [n, V] is large)
            first = outputs[0] if outputs else n - 1
            kwargs["logits_to_keep"] = n - first
        out = self.model(input_ids=ids, use_cache=True, **kwargs)
        logits: torch.Tensor = out.logits[0]                                              # [kept, V]
        kept = logits.shape[0]
        return logits[[o - (n - kept) for o in outputs]]                        # [len(outputs), V]

    # --- taps, description ------------------------------------------------------------------

    def tap_names(self) -> tuple[str, ...]:
        """The layer taps' names (:class:`~pipeline.contracts.model.LayerTaps`); none for a
        model whose layers are not laid out as the hooks expect (a taps request is then
        refused at submit)."""
        return self._hooks.names()

    def set_tap(self, tap: Tap | None) -> None:
        """Send later forwards' hidden states to ``tap`` (None: remove the hooks)."""
        self._hooks.set(tap)

    def model_info(self) -> ModelInfo:
        """Architecture, parameter count, dtype, device and weight memory."""
        params = list(self.model.parameters())
        architectures = getattr(self.model.config, "architectures", None) or [
            type(self.model).__name__]
        return ModelInfo(
            architecture=str(architectures[0]), parameters=sum(p.numel() for p in params),
            dtype=str(params[0].dtype).removeprefix("torch."), device=str(self.device),
            weight_bytes=sum(p.numel() * p.element_size() for p in params),
            threads=self.thread_policy)

    @property
    def thread_policy(self) -> str | None:
        """``"2"`` when the ``threads`` option fixes the count (None: torch's, as it is)."""
        return None if self.threads is None else str(self.threads)
