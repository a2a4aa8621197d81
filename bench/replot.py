"""Redraw the plot and the Markdown table of a recorded `transfer-bench --json` file.

    python bench/replot.py bench/results/cpu-2vcpu/quick.json [--png out.png] [--md out.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transfer._bench import report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, help="a transfer-bench --json file")
    ap.add_argument("--png", type=Path, help="the plot (default: beside the JSON)")
    ap.add_argument("--md", type=Path, help="the Markdown table (default: beside the JSON)")
    a = ap.parse_args()
    src = a.json
    png = str(a.png or src.with_suffix(".png"))
    md = str(a.md or src.with_suffix(".md"))
    doc, results, limits = report.load_json(str(src))
    m, c = doc["machine"], doc.get("config", {})
    title = (f"transfer-bench {c.get('preset', '')}: {m['cpu']}, {m['cores']} cores, "
             f"verify every {c.get('verify_every')} group(s), medians of {c.get('reps')} reps")
    report.write_plot(png, results, limits, title)
    Path(md).write_text(report.markdown_table(results, limits) + "\n")
    print(f"wrote {png} and {md}")


if __name__ == "__main__":
    main()
