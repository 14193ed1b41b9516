"""LogitsProcessorPipeline: the BatchUpdates processors see, exactly."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.logits.pipeline import LogitsProcessorPipeline
from tokenmill.engine.logits.processor import BatchUpdate, ProcessorContext
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.structured_output.spec import StructuredOutputsParams

CONTEXT = ProcessorContext(vocab_size=8, device=torch.device("cpu"), eos_token_ids=(7,))
USES = SamplingParams(logits_processors=["rec"])
PLAIN = SamplingParams()


class Recorder:
    def __init__(self, context: ProcessorContext) -> None:
        self.updates: list[BatchUpdate | None] = []
        self.applied: list[list[float]] = []

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.applied.append(logits[:, 0].tolist())
        return logits + 1


def summary(update: BatchUpdate | None):
    if update is None:
        return None
    return (update.batch_size, update.removed, update.moved,
            [(a.index, a.req_id, list(a.prompt_token_ids), list(a.output_token_ids)) for a in update.added])


def make(history=None):
    recorder = Recorder(CONTEXT)
    histories = history or {}
    pipeline = LogitsProcessorPipeline(
        {"rec": recorder}, CONTEXT, lambda r: histories.get(r, ([1, 2], []))
    )
    return pipeline, recorder


def test_no_user_no_calls() -> None:
    pipeline, recorder = make()
    pipeline.add("a", PLAIN)
    assert not pipeline.active
    logits = torch.zeros(1, 8)
    assert pipeline.apply(logits, ["a"]) is logits
    assert recorder.updates == [] and pipeline.record([3]) == ([], [])


def test_diffs_added_moved_removed_and_live_history() -> None:
    pipeline, recorder = make({"a": ([1], [4]), "b": ([2, 2], []), "c": ([3], [])})
    for r, p in (("a", USES), ("b", PLAIN), ("c", USES)):
        pipeline.add(r, p)
    out = pipeline.apply(torch.zeros(3, 8), ["a", "b", "c"])
    assert torch.equal(out, torch.ones(3, 8))
    assert summary(recorder.updates[-1]) == (3, [], [], [(0, "a", [1], [4]), (1, "b", [2, 2], []), (2, "c", [3], [])])
    pipeline.record([5, 6, 7])
    added_a = recorder.updates[-1].added[0]
    assert added_a.output_token_ids == [4, 5]  # live: the step's token was appended
    pipeline.apply(torch.zeros(3, 8), ["a", "b", "c"])
    assert recorder.updates[-1] is None  # same rows
    # b leaves; c moves from 2 to 1; d joins at 2.
    pipeline.remove("b")
    pipeline.add("d", PLAIN)
    pipeline.apply(torch.zeros(3, 8), ["a", "c", "d"])
    assert summary(recorder.updates[-1]) == (3, [1], [(2, 1)], [(2, "d", [1, 2], [])])


def test_a_request_removed_and_added_again_is_a_new_row() -> None:
    pipeline, recorder = make({"a": ([1], [4, 4])})
    pipeline.add("a", USES)
    pipeline.add("z", USES)
    pipeline.apply(torch.zeros(2, 8), ["a", "z"])
    pipeline.remove("a")  # preempted
    pipeline.add("a", USES)  # resumed, same id
    pipeline.apply(torch.zeros(2, 8), ["a", "z"])
    assert summary(recorder.updates[-1]) == (2, [0], [], [(0, "a", [1], [4, 4])])


def test_last_user_leaving_removes_every_row() -> None:
    pipeline, recorder = make()
    pipeline.add("a", USES)
    pipeline.add("b", PLAIN)
    pipeline.apply(torch.zeros(2, 8), ["a", "b"])
    pipeline.remove("a")
    assert summary(recorder.updates[-1]) == (0, [0, 1], [], [])
    assert not pipeline.active
    pipeline.add("c", USES)
    pipeline.apply(torch.zeros(2, 8), ["b", "c"])
    assert summary(recorder.updates[-1]) == (2, [], [], [(0, "b", [1, 2], []), (1, "c", [1, 2], [])])


def test_remap_is_a_simultaneous_reassignment() -> None:
    update = BatchUpdate(3, removed=[0], moved=[(1, 0), (2, 1)])
    assert update.remap({0: "x", 1: "y", 2: "z"}) == {0: "y", 1: "z"}
    swap = BatchUpdate(2, moved=[(0, 1), (1, 0)])
    assert swap.remap({0: "x", 1: "y"}) == {1: "x", 0: "y"}


def test_validate_names_and_arguments() -> None:
    pipeline, _ = make()
    import pytest

    with pytest.raises(ValueError, match=r"unknown logits processor 'nope' \(registered: rec\)"):
        pipeline.validate(SamplingParams(logits_processors=["nope"]))
    with pytest.raises(ValueError, match="need a tokenizer"):
        from tokenmill.engine.structured_output.spec import StructuredOutputsParams

        pipeline.validate(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))


class FakeStructured:
    """Stands in for the grammar constraint: records updates, hands out a fixed mask."""

    def __init__(self) -> None:
        self.updates: list[BatchUpdate | None] = []
        self.mask_calls = 0

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)

    def mask(self):
        self.mask_calls += 1
        return torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([1])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise AssertionError("grammar_mask stands in for apply")


def test_grammar_mask_stands_in_for_apply_only_while_no_custom_processor_is_used() -> None:
    recorder, structured = Recorder(CONTEXT), FakeStructured()
    pipeline = LogitsProcessorPipeline({"rec": recorder}, CONTEXT, lambda r: ([5], []), structured)
    grammar = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    pipeline.add("a", PLAIN)
    pipeline.add("b", grammar)
    assert pipeline.grammar_only
    bitmask, rows = pipeline.grammar_mask(["a", "b"])
    assert bitmask.tolist() == [[-1]]
    assert rows.tolist() == [1] and structured.mask_calls == 1
    # Both processors saw the batch's rows arrive, exactly as apply() would have sent them.
    assert [summary(u) for u in structured.updates] == [(2, [], [], [(0, "a", [5], []), (1, "b", [5], [])])]
    assert [summary(u) for u in recorder.updates] == [summary(u) for u in structured.updates]
    assert pipeline.grammar_mask(["a", "b"]) is not None and structured.updates[-1] is None
    pipeline.add("c", USES)
    assert not pipeline.grammar_only
    with pytest.raises(RuntimeError, match="custom logits processors"):
        pipeline.grammar_mask(["a", "b", "c"])
    pipeline.remove("c")
    assert pipeline.grammar_only
