from pathlib import Path

import pytest

from tokenmill.engine.loader.gguf import GGUFFile
from tokenmill.engine.loader.model_store import resolve_model
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.output_processor import OutputProcessor, RequestOutputAccumulator
from tokenmill.engine.outputs import EngineCoreOutput, Logprob
from tokenmill.engine.request import FinishReason, SamplingParams


def default_gguf() -> Path:
    """The default model's GGUF in the store (`make test` pulls it first)."""
    return resolve_model("smollm2-135m-instruct")
EOS = 2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(default_gguf()).metadata)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def out(req_id: str, ids: list[int], **kw) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, ids, **kw)


def run_tokens(processor, req_id, ids, finish_at_end=FinishReason.LENGTH):
    """Feed ids one step at a time; return every delta and every stopped list."""
    deltas, stopped = [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        d, s = processor.process(
            [out(req_id, [token], finish_reason=finish_at_end if last else None)]
        )
        deltas += d
        stopped += s
    return deltas, stopped


def test_single_request_streams_text_deltas_and_finishes(tokenizer):
    clock = Clock()
    processor = OutputProcessor(tokenizer, clock=clock)
    params = SamplingParams(max_tokens=9)
    prompt = tokenizer.encode("Q:")
    assert processor.add_request("r", "Q:", prompt, params) == [("r", params)]
    ids = tokenizer.encode("The capital is 日本語 😀.")
    clock.now = 101.0
    deltas, stopped = run_tokens(processor, "r", ids)
    assert stopped == []
    assert [d.request_id for d in deltas] == ["r"] * len(ids)
    assert "".join(d.outputs[0].text for d in deltas) == "The capital is 日本語 😀."
    assert [t for d in deltas for t in d.outputs[0].token_ids] == ids
    assert [d.finished for d in deltas] == [False] * (len(ids) - 1) + [True]
    last = deltas[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason, last.cumulative_logprob) == ("length", None, None)
    assert deltas[0].prompt_token_ids == prompt and deltas[0].prompt == "Q:"
    assert not processor.has_unfinished_requests()


def test_stop_string_spanning_tokens_stops_and_asks_engine_to_finish(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(stop=["is Par"]))
    ids = tokenizer.encode("The capital of France is Paris. It is")
    deltas, stopped = run_tokens(processor, "r", ids)
    assert stopped == ["r"]
    text = "".join(d.outputs[0].text for d in deltas)
    assert text == "The capital of France "
    # Tokens up to the one that completed the stop string ("Paris" is token 5).
    assert [t for d in deltas for t in d.outputs[0].token_ids] == ids[:6]
    final = deltas[-1].outputs[0]
    assert deltas[-1].finished and (final.finish_reason, final.stop_reason) == ("stop", "is Par")
    # Outputs the engine had in flight for a stopped request are dropped.
    assert processor.process([out("r", [ids[7]])]) == ([], [])


def test_stop_string_text_is_held_back_while_streaming(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(stop=[" Paris."]))
    ids = tokenizer.encode("It is Paris")  # " Paris" could still become " Paris."
    deltas, _ = run_tokens(processor, "r", ids, finish_at_end=None)
    assert "".join(d.outputs[0].text for d in deltas) == "It is"
    (delta,), _ = processor.process([out("r", [EOS], finish_reason=FinishReason.STOP)])
    assert delta.outputs[0].text == " Paris" and delta.outputs[0].finish_reason == "stop"


def test_stop_string_in_a_multi_token_step_drops_later_tokens(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["France"], include_stop_str_in_output=True)
    processor.add_request("r", None, [1], params)
    ids = tokenizer.encode("The capital of France is Paris")
    (delta,), stopped = processor.process([out("r", ids)])
    assert stopped == ["r"]
    assert delta.outputs[0].text == "The capital of France"
    assert delta.outputs[0].token_ids == ids[:4]


def test_stop_strings_wait_for_min_tokens(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(stop=["The"], min_tokens=2))
    ids = tokenizer.encode("The capital The end")
    deltas, stopped = run_tokens(processor, "r", ids)
    assert stopped == ["r"] and "".join(d.outputs[0].text for d in deltas) == "The capital "


def test_stop_token_adds_no_text_unless_asked(tokenizer):
    period = tokenizer.encode(".")[0]
    ids = [*tokenizer.encode("Hi"), period]
    for include, text in [(False, "Hi"), (True, "Hi.")]:
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(stop_token_ids=[period], include_stop_str_in_output=include)
        processor.add_request("r", None, [1], params)
        (delta,), stopped = processor.process(
            [out("r", ids, finish_reason=FinishReason.STOP, stop_reason=period)]
        )
        assert stopped == [] and delta.outputs[0].text == text
        assert delta.outputs[0].token_ids == ids and delta.outputs[0].stop_reason == period


def test_n_fans_out_and_aggregates_per_parent(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=3, seed=10, max_tokens=2)
    children = processor.add_request("p", "x", [1], params)
    assert [c for c, _ in children] == ["p#0", "p#1", "p#2"]
    assert [(p.n, p.seed) for _, p in children] == [(1, 10), (1, 11), (1, 12)]
    hi, there, yo = tokenizer.encode("Hello world,")
    deltas, _ = processor.process([out("p#0", [hi]), out("p#2", [yo])])
    assert len(deltas) == 1 and not deltas[0].finished
    assert [(c.index, c.text) for c in deltas[0].outputs] == [(0, "Hello"), (2, ",")]
    deltas, _ = processor.process(
        [
            out("p#1", [there], finish_reason=FinishReason.LENGTH),
            out("p#0", [there], finish_reason=FinishReason.LENGTH),
        ]
    )
    assert [(c.index, c.text) for c in deltas[0].outputs] == [(0, " world"), (1, " world")]
    assert not deltas[0].finished
    deltas, _ = processor.process([out("p#2", [EOS], finish_reason=FinishReason.STOP)])
    assert deltas[0].finished and deltas[0].outputs[0].finish_reason == "stop"
    assert not processor.has_unfinished_requests()


def test_accumulator_merges_deltas_into_final_outputs(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("p", "x", [1], SamplingParams(n=2, logprobs=0))
    a, b = tokenizer.encode("Hello world")
    lp = {a: Logprob(-0.5, 1), b: Logprob(-1.5, 2)}
    accumulator = RequestOutputAccumulator()
    steps = [
        [out("p#0", [a], new_logprobs=[lp]), out("p#1", [b], new_logprobs=[lp])],
        [out("p#0", [b], new_logprobs=[lp], finish_reason=FinishReason.LENGTH)],
        [out("p#1", [a], new_logprobs=[lp], finish_reason=FinishReason.LENGTH)],
    ]
    for step in steps:
        for delta in processor.process(step)[0]:
            accumulator.add(delta)
    result = accumulator.result("p")
    assert result.finished and [c.index for c in result.outputs] == [0, 1]
    assert [(c.text, c.token_ids) for c in result.outputs] == [
        ("Hello world", [a, b]),
        (" worldHello", [b, a]),
    ]
    assert [c.cumulative_logprob for c in result.outputs] == [-2.0, -2.0]
    assert [len(c.logprobs or []) for c in result.outputs] == [2, 2]
    assert [c.finish_reason for c in result.outputs] == ["length", "length"]


def test_logprobs_are_trimmed_decoded_and_summed(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(logprobs=1))
    processor.add_request("none", None, [1], SamplingParams())
    hello, world, comma = tokenizer.encode("Hello world,")
    # The batch asked for k = 2: chosen token first, then the top 2.
    row = {world: Logprob(-1.0, 2), hello: Logprob(-0.5, 1), comma: Logprob(-1.0, 2)}
    deltas, _ = processor.process(
        [out("r", [world], new_logprobs=[row]), out("none", [world], new_logprobs=[row])]
    )
    got = deltas[0].outputs[0]
    assert got.logprobs == [{world: Logprob(-1.0, 2, " world"), hello: Logprob(-0.5, 1, "Hello")}]
    assert got.cumulative_logprob == -1.0
    assert deltas[1].outputs[0].logprobs is None and deltas[1].outputs[0].cumulative_logprob is None
    chosen_top = {hello: Logprob(-0.25, 1), comma: Logprob(-2.0, 2)}
    deltas, _ = processor.process([out("r", [hello], new_logprobs=[chosen_top])])
    assert deltas[0].outputs[0].logprobs == [{hello: Logprob(-0.25, 1, "Hello")}]
    assert deltas[0].outputs[0].cumulative_logprob == -1.25


def test_prompt_logprobs_come_once_complete_in_the_first_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Hello world,")
    processor.add_request("r", None, prompt, SamplingParams(prompt_logprobs=0))
    first = [None, {prompt[1]: Logprob(-3.0, 7), prompt[0]: Logprob(-1.0, 1)}]
    # A chunked prefill: prompt logprobs arrive in two steps, the first with no token.
    assert processor.process([out("r", [], new_prompt_logprobs=first)]) == ([], [])
    second = [{prompt[2]: Logprob(-2.0, 3)}]
    deltas, _ = processor.process([out("r", [EOS], new_prompt_logprobs=second)])
    assert deltas[0].prompt_logprobs == [
        None,
        {prompt[1]: Logprob(-3.0, 7, " world")},
        {prompt[2]: Logprob(-2.0, 3, ",")},
    ]
    deltas, _ = processor.process([out("r", [EOS], finish_reason=FinishReason.STOP)])
    assert deltas[0].prompt_logprobs is None


def test_abort_returns_unfinished_children_and_forgets_the_request(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("p", None, [1], SamplingParams(n=3))
    processor.process([out("p#1", [EOS], finish_reason=FinishReason.STOP)])
    assert processor.abort("p") == ["p#0", "p#2"]
    assert processor.process([out("p#0", [EOS])]) == ([], [])
    assert processor.abort("p") == [] and processor.abort("unknown") == []
    with pytest.raises(ValueError, match="already in use"):
        processor.add_request("q", None, [1], SamplingParams())
        processor.add_request("q", None, [1], SamplingParams())


def test_metrics_timestamps(tokenizer):
    clock = Clock()
    processor = OutputProcessor(tokenizer, clock=clock)
    processor.add_request("r", None, [1], SamplingParams())
    clock.now = 101.0
    processor.process([out("r", [], num_cached_tokens=0)])
    clock.now = 102.0
    processor.process([out("r", [5], num_cached_tokens=16)])
    clock.now = 103.5
    (delta,), _ = processor.process([out("r", [6], finish_reason=FinishReason.LENGTH)])
    assert delta.num_cached_tokens == 16  # reported once, kept
    m = delta.metrics
    assert m is not None
    assert (m.arrival_time, m.first_token_time, m.last_token_time, m.finished_time) == (
        100.0,
        102.0,
        103.5,
        103.5,
    )


def test_a_stop_string_ends_only_its_own_child(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("p", None, [1], SamplingParams(n=2, stop=[" world"]))
    hello, world = tokenizer.encode("Hello world")
    (delta,), stopped = processor.process([out("p#0", [hello, world]), out("p#1", [hello])])
    assert stopped == ["p#0"] and not delta.finished
    assert [(c.index, c.text, c.finish_reason) for c in delta.outputs] == [
        (0, "Hello", "stop"),
        (1, "Hello", None),
    ]
    (delta,), stopped = processor.process([out("p#1", [hello], finish_reason=FinishReason.LENGTH)])
    assert stopped == [] and delta.finished
    assert [(c.index, c.text, c.finish_reason) for c in delta.outputs] == [(1, "Hello", "length")]
