"""compare.py's report: each figure's median and range over the runs, ratios of the medians
against baselines, each peer's best variant, and the markdown tables."""
from __future__ import annotations

from lib import stats
from lib.servers import SystemSpec

# (key, column title, getter, higher_is_better)
METRICS = [
    ("batch_output_tps", "batch out tok/s", lambda r: r["batch"]["output_tokens_per_s"], True),
    ("batch_total_tps", "batch total tok/s", lambda r: r["batch"]["total_tokens_per_s"], True),
    ("single_tps", "single tok/s", lambda r: r["single"]["tokens_per_s"], True),
    ("copy_tps", "copy tok/s", lambda r: r["copy"]["tokens_per_s"], True),
    ("capacity_rps", "capacity req/s", lambda r: r["capacity"]["rate"], True),
    ("serving_ttft_p99", "TTFT p99 ms", lambda r: r["serving"]["ttft_ms"]["p99"], False),
    ("serving_tpot_p99", "TPOT p99 ms", lambda r: r["serving"]["tpot_ms"]["p99"], False),
]
HIGHER_IS_BETTER = {key: hib for key, _, _, hib in METRICS}


def figures_of(results: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
    """system -> metric -> the median and range over the system's runs that measured it."""
    table = {}
    for system, runs in results.items():
        row = {}
        for key, _, get, _ in METRICS:
            values = []
            for run in runs:
                try:
                    values.append(get(run))
                except (KeyError, TypeError):
                    continue
            if values:
                row[key] = stats.median_range(values)
        table[system] = row
    return table


def ratios_of(figures: dict[str, dict[str, dict]], baselines: list[str]) -> dict:
    """Of the medians: system / baseline for throughputs and capacity, baseline / system for
    latencies: above 1 means the system is better, in every column."""
    out = {}
    for base in baselines:
        if base not in figures:
            continue
        out[base] = {}
        for system, row in figures.items():
            if system == base:
                continue
            ratios = {}
            for key, fig in row.items():
                ours, theirs = fig["median"], figures[base].get(key, {}).get("median")
                if theirs is None or not ours > 0 or not theirs > 0:
                    continue
                ratios[key] = ours / theirs if HIGHER_IS_BETTER[key] else theirs / ours
            out[base][system] = ratios
    return out


def best_of_each_peer(figures: dict[str, dict[str, dict]],
                      specs: list[SystemSpec]) -> dict[str, dict[str, str]]:
    """base system -> metric -> the variant with the best median (a peer is compared on its best
    settings)."""
    best: dict[str, dict[str, str]] = {}
    for spec in specs:
        for key, fig in figures.get(spec.name, {}).items():
            current = best.setdefault(spec.base, {}).get(key)
            if current is None:
                best[spec.base][key] = spec.name
                continue
            theirs = figures[current][key]["median"]
            better = (fig["median"] > theirs) == HIGHER_IS_BETTER[key]
            if better and fig["median"] != theirs:
                best[spec.base][key] = spec.name
    return best


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def cell(fig: dict) -> str:
    if fig["runs"] == 1:
        return f"{fig['median']:.1f}"
    return f"{fig['median']:.1f} ({fig['min']:.1f}-{fig['max']:.1f})"


def render(figures: dict, ratios: dict, errors: dict[str, str],
           best: dict[str, dict[str, str]] | None = None) -> str:
    keys = [k for k, _, _, _ in METRICS if any(k in row for row in figures.values())]
    titles = {k: t for k, t, _, _ in METRICS}
    parts = ["median (lowest-highest) of the runs:",
             markdown_table(["system"] + [titles[k] for k in keys],
                            [[s] + [cell(row[k]) if k in row else "-" for k in keys]
                             for s, row in figures.items()])]
    for base, per_system in ratios.items():
        if not per_system:
            continue
        parts.append(f"ratios of the medians against {base} (above 1: better than {base}; "
                     f"latencies are {base}'s / the system's):")
        parts.append(markdown_table(
            ["system"] + [titles[k] for k in keys],
            [[s] + [f"{r[k]:.2f}x" if k in r else "-" for k in keys]
             for s, r in per_system.items()]))
    for base, per_metric in (best or {}).items():
        parts.append(f"best {base} variant: " + ", ".join(
            f"{titles[k]}: {name}" for k, name in per_metric.items()))
    for name, error in errors.items():
        parts.append(f"FAILED {name}: {error}")
    return "\n\n".join(parts)
