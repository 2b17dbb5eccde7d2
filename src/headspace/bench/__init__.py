"""Benchmarks' machinery: :mod:`.measure` (timing and memory on a shared machine), :mod:`.attention`
(the attention benchmark behind ``benchmarks/attention.py`` and ``headspace bench``) and :mod:`.scripts`
(where every ``benchmarks/*.py`` script writes its JSON: ``--out``, ``--save``). The scripts under
``benchmarks/`` import their shared helpers from here; this package is the one home of the measuring code.

``headspace.bench.run_attention_benchmark``, ``format_table``, ``check_targets``, ``write_json`` and the
rest keep working from here.
"""

from .attention import (
    CASES,
    FAST_VS_FLOOR,
    GEMM_FLOOR,
    IDLE_HOOKS_TOLERANCE,
    LABELS,
    MODES,
    WEIGHTS_VS_TORCH,
    Case,
    NanoGPTAttention,
    TextbookAttention,
    build_case,
    check_targets,
    copy_weights,
    float64_reference,
    format_table,
    run_attention_benchmark,
    write_json,
)
from .measure import (
    machine_info,
    measure_peak_extra_mib,
    read_status_kib,
    round_robin,
    rss_counter_slack_mib,
    spread,
    timed,
)

__all__ = [
    "CASES",
    "FAST_VS_FLOOR",
    "GEMM_FLOOR",
    "IDLE_HOOKS_TOLERANCE",
    "LABELS",
    "MODES",
    "WEIGHTS_VS_TORCH",
    "Case",
    "NanoGPTAttention",
    "TextbookAttention",
    "build_case",
    "check_targets",
    "copy_weights",
    "float64_reference",
    "format_table",
    "machine_info",
    "measure_peak_extra_mib",
    "read_status_kib",
    "round_robin",
    "rss_counter_slack_mib",
    "run_attention_benchmark",
    "spread",
    "timed",
    "write_json",
]
