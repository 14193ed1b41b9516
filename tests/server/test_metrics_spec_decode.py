"""/metrics: the speculative-decoding counters and acceptance-length histogram, read from
the engine's SchedulerStats at scrape time."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.stats import SchedulerStats
from tokenmill.server.metrics import ServerMetrics


def samples(stats: SchedulerStats) -> dict[tuple[str, str], float]:
    metrics = ServerMetrics("m", lambda: stats)
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if "spec_decode" in s.name:
                out[(s.name, s.labels.get("le", ""))] = s.value
    return out


def test_counters_and_histogram_follow_the_engine() -> None:
    got = samples(SchedulerStats(
        spec_decode_num_draft_tokens=40, spec_decode_num_accepted_tokens=23,
        spec_decode_acceptance_lengths=(3, 1, 0, 2, 4),
    ))
    assert got == {
        ("tokenmill:spec_decode_num_drafts_total", ""): 10.0,
        ("tokenmill:spec_decode_num_draft_tokens_total", ""): 40.0,
        ("tokenmill:spec_decode_num_accepted_tokens_total", ""): 23.0,
        ("tokenmill:spec_decode_acceptance_length_bucket", "0.0"): 3.0,
        ("tokenmill:spec_decode_acceptance_length_bucket", "1.0"): 4.0,
        ("tokenmill:spec_decode_acceptance_length_bucket", "2.0"): 4.0,
        ("tokenmill:spec_decode_acceptance_length_bucket", "3.0"): 6.0,
        ("tokenmill:spec_decode_acceptance_length_bucket", "4.0"): 10.0,
        ("tokenmill:spec_decode_acceptance_length_bucket", "+Inf"): 10.0,
        ("tokenmill:spec_decode_acceptance_length_count", ""): 10.0,
        ("tokenmill:spec_decode_acceptance_length_sum", ""): 23.0,
    }


def test_series_exist_without_speculation() -> None:
    got = samples(SchedulerStats())
    assert got[("tokenmill:spec_decode_num_draft_tokens_total", "")] == 0.0
    assert got[("tokenmill:spec_decode_acceptance_length_count", "")] == 0.0
