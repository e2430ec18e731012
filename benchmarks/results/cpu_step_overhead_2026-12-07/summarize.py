"""Medians per section and side of an ab.sh JSONL (outside_products.py lines)."""
import json
import statistics as st
import sys

sec, rows = None, {}
for line in open(sys.argv[1]):
    if line.startswith("#"):
        sec = line.strip()[8:]
        continue
    d = json.loads(line)
    rows.setdefault((sec, d["side"]), []).append(d["result"])
for (sec, side), rs in rows.items():
    print(f"{sec[:60]:60s} {side:4s} n={len(rs)} step {st.median(r['step_ms'] for r in rs):6.2f} "
          f"products {st.median(r['products_ms'] for r in rs):6.2f} outside {st.median(r['outside_ms'] for r in rs):5.2f} "
          f"(run minima {min(r['outside_ms_min'] for r in rs):.2f}-{max(r['outside_ms_min'] for r in rs):.2f}) "
          f"ids {sorted({tuple(r['tokens']) for r in rs})} load {st.median(r['load_avg'] for r in rs):.1f}")
