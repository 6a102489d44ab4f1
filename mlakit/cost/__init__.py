"""The cost model: multiply-adds and bytes per term, the crossover, cache economics, the roofline.

Everything here is plain arithmetic on `MLAConfig` widths (no torch). Rule: a matmul
(rows × inner)·(inner × cols) costs rows·cols·inner multiply-adds. The derivation and the
assumptions are in docs/cost-model.md.
"""

from mlakit.cost.cache_size import (
    CACHE_DTYPES,
    DEFAULT_GQA_GROUPS,
    CacheLayout,
    cache_economics,
    cache_layouts,
    format_bytes,
    gqa_groups_defined,
    mla_equivalent_gqa_groups,
)
from mlakit.cost.crossover import (
    Crossover,
    asymptotic_crossover,
    crossover,
    first_crossing,
    gap_coefficients,
    roofline_crossover,
)
from mlakit.cost.measured import load_results, measured_crossover, validate_results
from mlakit.cost.report import cost_report, format_seconds, markdown_tables
from mlakit.cost.roofline import (
    MACHINES,
    MachineProfile,
    path_term_times,
    path_time,
    resolve_machine,
    shared_term_times,
    term_times,
)
from mlakit.cost.terms import (
    DEFAULT_COUNTING,
    MODELS,
    MODES,
    absorb_macs,
    expanded_tokens,
    keys_seen,
    materialize_macs,
    path_macs,
    path_terms,
    shared_macs,
)
from mlakit.cost.traffic import absorb_bytes, compute_dtype, materialize_bytes, path_bytes, shared_bytes

__all__ = [
    "CACHE_DTYPES",
    "DEFAULT_COUNTING",
    "DEFAULT_GQA_GROUPS",
    "MACHINES",
    "MODELS",
    "MODES",
    "CacheLayout",
    "Crossover",
    "MachineProfile",
    "absorb_bytes",
    "absorb_macs",
    "asymptotic_crossover",
    "cache_economics",
    "cache_layouts",
    "compute_dtype",
    "cost_report",
    "crossover",
    "expanded_tokens",
    "first_crossing",
    "format_bytes",
    "format_seconds",
    "gap_coefficients",
    "gqa_groups_defined",
    "keys_seen",
    "load_results",
    "markdown_tables",
    "materialize_bytes",
    "materialize_macs",
    "measured_crossover",
    "mla_equivalent_gqa_groups",
    "path_bytes",
    "path_macs",
    "path_term_times",
    "path_terms",
    "path_time",
    "resolve_machine",
    "roofline_crossover",
    "shared_bytes",
    "shared_macs",
    "shared_term_times",
    "term_times",
    "validate_results",
]
