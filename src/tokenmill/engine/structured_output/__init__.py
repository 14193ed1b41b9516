"""Structured outputs: a grammar per request, enforced inside the decoding loop.

    spec.py        StructuredOutputsParams: what a request asks for (json schema, regex, ...)
    backend.py     GrammarBackend / Grammar: the seam a grammar engine plugs into
    llguidance_backend.py  the default backend
    compiler.py    GrammarCompiler: compiles off the engine thread, cached by spec
    processor.py   StructuredOutputProcessor: the built-in batch logits processor
    bitmask.py     applying a batch's packed token bitmask to its logits in one op
"""
