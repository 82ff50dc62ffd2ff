"""nsa-flex benchmarks: suites of timed rows, written as JSON, Markdown and PNG.

Suites registered: attention (op level). Decode and whole-model suites plug into the same
registry (`register_suite`) and writers once the code they time exists.
"""

from nsa_flex.bench.attention import IMPLS, AttentionBenchConfig, attention_config, attention_notes, attention_summary
from nsa_flex.bench.core import SCHEMA, SUITES, Row, Suite, register_suite, run_suite
from nsa_flex.bench.report import default_stem, write_report

__all__ = [
    "IMPLS", "SCHEMA", "SUITES", "AttentionBenchConfig", "Row", "Suite", "attention_config", "attention_notes",
    "attention_summary", "default_stem", "register_suite", "run_suite", "write_report",
]
