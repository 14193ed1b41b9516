"""Batch-level logits processors: the engine's escape hatch for custom decoding rules.

    processor.py  LogitsProcessor protocol, BatchUpdate, LogitsProcessorSpec
    registry.py   processors by name: built-ins and the `tokenmill.logits_processors`
                  entry-point group
    pipeline.py   LogitsProcessorPipeline: the runner's host (batch diffs, token history)
    builtin.py    processors that ship with tokenmill
"""
