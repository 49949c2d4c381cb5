"""`pagedlm trace FILE -o DIR`: a step trace (metrics/tracer.py) as pictures.

Writes DIR/trace.html (self-contained: inline SVG and CSS, PNGs as data URIs, nothing fetched),
DIR/timeline.png (requests as rows, steps as columns, prefill and decode coloured, preemptions
marked) and DIR/kv_blocks.png (the KV block map over time: blocks x steps, free / used / shared /
cached). Needs matplotlib (pip install 'pagedlm[trace]').
"""
from __future__ import annotations

import base64
import html
import io
import os

import numpy as np

from pagedlm.metrics.tracer import BLOCK_STATES, load_records, records_path

PREFILL, DECODE = 1, 2
TIMELINE_COLORS = ["#ffffff", "#4c78a8", "#59a14f"]  # idle, prefill, decode
BLOCK_COLORS = {".": "#eeeeee", "u": "#4c78a8", "s": "#e15759", "c": "#f2b447"}
PREEMPT_COLOR = "#d62728"
# Past this many request x step cells the HTML timeline is an image: an SVG that large makes
# browsers crawl.
MAX_SVG_CELLS = 60_000


def find_records(path: str) -> str:
    """The .steps.jsonl for FILE: itself, or the records beside a Chrome trace JSON."""
    if path.endswith(".jsonl"):
        candidate = path
    else:
        candidate = records_path(path)
    if not os.path.isfile(candidate):
        raise ValueError(f"no step records at {candidate!r} (give the .steps.jsonl file, or "
                         f"the trace JSON it was written beside).")
    return candidate


def timeline_matrix(steps: list[dict]) -> tuple[list[str], np.ndarray, list[tuple[int, int]]]:
    """Request ids in order of first appearance, a (requests x steps) matrix of 0 / PREFILL /
    DECODE, and the (row, column) of each preemption."""
    rows: dict[str, int] = {}
    for s in steps:
        for x in s["scheduled"]:
            rows.setdefault(x["request_id"], len(rows))
        for p in s["preempted"]:
            rows.setdefault(p["request_id"], len(rows))
    grid = np.zeros((len(rows), len(steps)), dtype=np.int8)
    marks = []
    for j, s in enumerate(steps):
        for x in s["scheduled"]:
            i = rows[x["request_id"]]
            # A prefill chunk colours the cell even if a sibling sequence decodes.
            if grid[i, j] != PREFILL:
                grid[i, j] = PREFILL if x["kind"] == "prefill" else DECODE
        marks += [(rows[p["request_id"]], j) for p in s["preempted"]]
    return list(rows), grid, marks


def block_matrix(steps: list[dict]) -> np.ndarray:
    """(blocks x steps) codes 0..3 in BLOCK_STATES order."""
    codes = {c: i for i, c in enumerate(BLOCK_STATES)}
    n = max((len(s["block_map"]) for s in steps), default=0)
    m = np.zeros((n, len(steps)), dtype=np.int8)
    for j, s in enumerate(steps):
        m[:len(s["block_map"]), j] = [codes[c] for c in s["block_map"]]
    return m


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def plot_timeline(steps: list[dict]) -> bytes:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    ids, grid, marks = timeline_matrix(steps)
    fig, ax = plt.subplots(figsize=(min(18, 4 + len(steps) * 0.06),
                                    min(14, 1.5 + len(ids) * 0.25)))
    ax.imshow(grid, aspect="auto", interpolation="nearest", vmin=0, vmax=2,
              cmap=ListedColormap(TIMELINE_COLORS))
    if marks:
        r, c = zip(*marks)
        ax.scatter(c, r, marker="x", color=PREEMPT_COLOR, s=40, zorder=3)
    if len(ids) <= 60:
        ax.set_yticks(range(len(ids)), ids, fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("request")
    ax.set_title("Scheduled requests per step")
    ax.legend(handles=[Patch(color=TIMELINE_COLORS[1], label="prefill"),
                       Patch(color=TIMELINE_COLORS[2], label="decode"),
                       plt.Line2D([], [], marker="x", color=PREEMPT_COLOR, ls="",
                                  label="preempted")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    data = _png(fig)
    plt.close(fig)
    return data


def plot_blocks(steps: list[dict]) -> bytes:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    m = block_matrix(steps)
    fig, ax = plt.subplots(figsize=(min(18, 4 + len(steps) * 0.06),
                                    min(14, 2 + m.shape[0] * 0.12)))
    colors = [BLOCK_COLORS[c] for c in BLOCK_STATES]
    ax.imshow(m, aspect="auto", interpolation="nearest", vmin=0, vmax=len(colors) - 1,
              cmap=ListedColormap(colors))
    ax.set_xlabel("step")
    ax.set_ylabel("KV block")
    ax.set_title("KV block map over time")
    ax.legend(handles=[Patch(color=BLOCK_COLORS[c], label=name)
                       for c, name in BLOCK_STATES.items()], loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=8)
    data = _png(fig)
    plt.close(fig)
    return data


def _svg_timeline(steps: list[dict], ids: list[str], grid: np.ndarray,
                  marks: list[tuple[int, int]]) -> str:
    cw, ch, left, top = max(3, min(14, 1100 // max(1, len(steps)))), 14, 130, 18
    w, h = left + cw * len(steps) + 10, top + ch * len(ids) + 10
    tokens = {}
    for j, s in enumerate(steps):
        for x in s["scheduled"]:
            tokens.setdefault((x["request_id"], j), []).append(f"{x['kind']} {x['num_tokens']}")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="10">']
    for j in range(0, len(steps), max(1, len(steps) // 10)):
        out.append(f'<text x="{left + j * cw}" y="12">{steps[j]["step"]}</text>')
    for i, rid in enumerate(ids):
        y = top + i * ch
        out.append(f'<text x="{left - 4}" y="{y + 10}" text-anchor="end">{html.escape(rid)}'
                   f'</text>')
        for j in np.nonzero(grid[i])[0]:
            tip = f"{rid}, step {steps[j]['step']}: " + ", ".join(tokens.get((rid, j), []))
            out.append(f'<rect x="{left + j * cw}" y="{y}" width="{cw}" height="{ch - 2}" '
                       f'fill="{TIMELINE_COLORS[grid[i, j]]}"><title>{html.escape(tip)}'
                       f'</title></rect>')
    for i, j in marks:
        x, y = left + j * cw + cw / 2, top + i * ch + ch / 2 - 1
        out.append(f'<path d="M{x - 4},{y - 4}L{x + 4},{y + 4}M{x - 4},{y + 4}L{x + 4},{y - 4}" '
                   f'stroke="{PREEMPT_COLOR}" stroke-width="2"><title>{html.escape(ids[i])} '
                   f'preempted at step {steps[j]["step"]}</title></path>')
    out.append("</svg>")
    return "\n".join(out)


def render_html(meta: dict, steps: list[dict], timeline_png: bytes, blocks_png: bytes) -> str:
    ids, grid, marks = timeline_matrix(steps)
    if grid.size <= MAX_SVG_CELLS:
        timeline = _svg_timeline(steps, ids, grid, marks)
    else:
        timeline = (f'<img alt="timeline" src="data:image/png;base64,'
                    f'{base64.b64encode(timeline_png).decode()}">')
    blocks = f'<img alt="KV block map" src="data:image/png;base64,' \
             f'{base64.b64encode(blocks_png).decode()}">'
    executed = [s for s in steps if s["scheduled"]]
    phases = ("schedule", "prepare", "forward", "sample", "output")
    total = {p: sum(s["times"][p] for s in steps) for p in phases}
    wall = sum(total.values()) or 1e-9
    prefill = sum(x["num_tokens"] for s in steps for x in s["scheduled"]
                  if x["kind"] == "prefill")
    decode = sum(x["num_tokens"] for s in steps for x in s["scheduled"] if x["kind"] == "decode")
    rows = [("steps", len(executed)), ("requests", len(ids)),
            ("prefill tokens", prefill), ("decode tokens", decode),
            ("preemptions (recompute)", sum(p["mode"] == "recompute"
                                            for s in steps for p in s["preempted"])),
            ("preemptions (swap)", sum(p["mode"] == "swap" for s in steps for p in s["preempted"])),
            ("swaps in", sum(len(s["swapped_in"]) for s in steps)),
            ("prefix-cache hit tokens", sum(s["prefix_hit_tokens"] for s in steps)),
            ("blocks allocated", sum(s["device"]["allocated"] for s in steps)),
            ("blocks evicted", sum(s["device"]["evicted"] for s in steps)),
            ("copy-on-write copies", sum(s["cow_copies"] for s in steps))]
    drafted = sum(s.get("spec_draft_tokens", 0) for s in steps)
    if drafted:  # speculative decoding
        accepted = sum(s["spec_accepted_tokens"] for s in steps)
        verifies = sum(s["spec_drafts"] for s in steps)
        rows += [("draft tokens verified", drafted),
                 ("draft tokens accepted", f"{accepted} ({100 * accepted / drafted:.1f}%)"),
                 ("mean acceptance length", f"{1 + accepted / verifies:.2f}")]
    rows += [(f"time in {p}", f"{total[p]:.3f}s ({100 * total[p] / wall:.1f}%)")
             for p in phases]
    table = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in rows)
    config = ", ".join(f"{k}={html.escape(str(v))}" for k, v in meta.items() if k != "type")
    legend = " ".join(f'<span class="sw" style="background:{c}"></span>{n}'
                      for c, n in ((TIMELINE_COLORS[1], "prefill"), (TIMELINE_COLORS[2], "decode"),
                                   (PREEMPT_COLOR, "preempted")))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pagedlm step trace</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; }} th, td {{ padding: 2px 10px; text-align: left; }}
th {{ font-weight: normal; color: #555; }}
.sw {{ display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px;
       vertical-align: middle; }}
.scroll {{ overflow: auto; max-height: 70vh; border: 1px solid #ddd; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>pagedlm step trace</h1>
<p>{config}</p>
<table>{table}</table>
<h2>Timeline: requests x steps</h2>
<p>{legend} (hover a cell for its token counts)</p>
<div class="scroll">{timeline}</div>
<h2>KV block map over time</h2>
{blocks}
</body></html>
"""


def render(path: str, out_dir: str) -> list[str]:
    """Write trace.html, timeline.png and kv_blocks.png for the trace at `path`; their paths."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("pagedlm trace needs matplotlib: pip install 'pagedlm[trace]'.") from None
    meta, steps = load_records(find_records(path))
    if not steps:
        raise ValueError(f"{path!r} has no step records (did the engine run any step?).")
    try:
        timeline_png, blocks_png = plot_timeline(steps), plot_blocks(steps)
        html = render_html(meta, steps, timeline_png, blocks_png).encode()
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
        raise ValueError(f"{path!r}: malformed step records ({type(e).__name__}: {e}); not "
                         f"written by this version's tracer?") from None
    files = {"timeline.png": timeline_png, "kv_blocks.png": blocks_png, "trace.html": html}
    written = []
    try:
        os.makedirs(out_dir, exist_ok=True)
        for name, data in files.items():
            target = os.path.join(out_dir, name)
            tmp = f"{target}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
            written.append(target)
    except OSError as e:
        raise ValueError(f"cannot write to the output directory {out_dir!r}: {e}") from None
    return written
