"""The wire dialects: each endpoint's body parsed to a pipeline request and its answer encoded.

Modules: ``openai`` (chat completions; the sampling fields and logprob text both OpenAI
endpoints share), ``completions`` (legacy text completions), ``embeddings``, ``responses`` /
``responses_output`` (the Responses API: its body, its answer and kept conversations),
``anthropic`` (Messages), ``common`` (what the dialects share: the parsed request, defaults),
``documents`` (document parts read to text), ``fields`` / ``documented`` (the field
specification every parser checks), ``openapi`` / ``openapi_requests`` (the OpenAPI document
generated from it).
"""
