"""The contracts between the pipeline's parts: the types and Protocols each side may rely on."""
