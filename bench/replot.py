"""Redraw the plot and the Markdown table from a recorded JSON file.

    python bench/replot.py bench/results/full.json [out.png] [out.md]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transfer._bench import report  # noqa: E402


def main() -> None:
    src = Path(sys.argv[1])
    png = sys.argv[2] if len(sys.argv) > 2 else str(src.with_suffix(".png"))
    md = sys.argv[3] if len(sys.argv) > 3 else str(src.with_suffix(".md"))
    doc, results, limits = report.load_json(str(src))
    m, c = doc["machine"], doc.get("config", {})
    title = (f"transfer-bench {c.get('preset', '')}: {m['cpu']}, {m['cores']} cores, "
             f"verify every {c.get('verify_every')} group(s), medians of {c.get('reps')} reps")
    report.write_plot(png, results, limits, title)
    Path(md).write_text(report.markdown_table(results, limits) + "\n")
    print(f"wrote {png} and {md}")


if __name__ == "__main__":
    main()
