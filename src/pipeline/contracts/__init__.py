"""The contracts between the pipeline's parts, one module per role.

- :mod:`~pipeline.contracts.request`: what a caller asks for (``Request``, ``GenerationConfig``,
  ``Message``, ``ToolSpec``, ``ToolChoice``, ``RuntimeLimits``) and the value checks.
- :mod:`~pipeline.contracts.text`: rendering, tokenizing, detokenizing, reading tool calls and
  stopping (``Rendered``, ``TokenizedPrompt``, and those stages' Protocols).
- :mod:`~pipeline.contracts.decode`: one step's rows, scores, processors and selectors.
- :mod:`~pipeline.contracts.model`: model calls and the backend Protocols.
- :mod:`~pipeline.contracts.strategy`: decoding strategies' plans and updates.
- :mod:`~pipeline.contracts.forcing`: the forced-token source a strategy consults.
- :mod:`~pipeline.contracts.output`: deltas, completions and their parts.
- :mod:`~pipeline.contracts.transport`: delivering deltas to a consumer.

Import each name from its module; :mod:`pipeline` itself exports the public ones.
"""
