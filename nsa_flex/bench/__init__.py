"""nsa-flex benchmarks: suites of timed rows, written as JSON, Markdown and PNG.

Suites: attention (op level), decode (one layer's decode step), model (training steps of the
language model, NSA vs dense). Each registers itself with `register_suite` and shares the writers.
"""

from nsa_flex.bench.attention import IMPLS, AttentionBenchConfig, attention_config, attention_notes, attention_summary
from nsa_flex.bench.core import SCHEMA, SUITES, Row, Suite, register_suite, run_suite
from nsa_flex.bench.report import default_stem, write_report

__all__ = [
    "IMPLS", "SCHEMA", "SUITES", "AttentionBenchConfig", "Row", "Suite", "attention_config", "attention_notes",
    "attention_summary", "default_stem", "register_suite", "run_suite", "write_report",
]
