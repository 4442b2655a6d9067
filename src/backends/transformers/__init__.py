"""Any causal language model transformers loads, behind the pipeline's backend interface.

An optional extra (``pip install explicit-pipeline[transformers]``): nothing here is imported
unless ``build(model, backend="transformers")`` asks for it. Owns:

- :mod:`backends.transformers.backend`: :class:`~backends.transformers.backend.TransformersBackend`,
  the model's own transformers implementation (``AutoModelForCausalLM`` from a local folder)
  with a transformers cache per slot, behind :class:`~pipeline.contracts.model.Backend`; what
  it does not honour (paged prefix sharing, draft verification, batch invariance, block
  attention, embedding inputs) it states in its
  :class:`~pipeline.contracts.model.BackendHonours`, and a build that asks for one is refused;
- :mod:`backends.transformers.taps`: the layer taps
  (:class:`~pipeline.contracts.model.LayerTaps`) as forward hooks on the model's decoder
  layers, named as the torch backend names its own (``layers.3.attention``).

The torch backend (:mod:`backends.torch`) is the fast path for the architectures it
implements; this one is the reach (Gemma, Phi, GPT-NeoX, OLMo, ... as transformers has them)
and the second implementation ``pipeline compare`` holds the torch backend against.
"""
