"""The wire dialects: each endpoint's body parsed to a pipeline request and its answer encoded.

Modules: ``openai`` (chat completions; the sampling fields and logprob text both OpenAI
endpoints share), ``completions`` (legacy text completions), ``embeddings``, ``responses`` /
``responses_output`` (the Responses API: its body, its answer and kept conversations),
``anthropic`` (Messages), ``common`` (what the dialects share: the parsed request, defaults,
the prompt field of completions and embeddings), ``documents`` (document parts read to text),
``fields`` (typed reading of a JSON body), ``spec`` (the field specification: each field
group's table, read by the parsers and documented from the same entries), ``documented``
(documented fields ignored or refused), ``openapi`` / ``openapi_requests`` (the OpenAPI
document).
"""
