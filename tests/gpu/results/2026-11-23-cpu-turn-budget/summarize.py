"""Summarize an A/B folder: python summarize.py STEP_MS FOLDER (files s{STEP}_k{K}_r{R}.json)."""
import glob
import json
import statistics as st
import sys

step, folder = sys.argv[1], sys.argv[2]
for k in (0, 4, 8, 16, 32):
    rows = [r for f in sorted(glob.glob(f"{folder}/s{step}_k{k}_r*.json"))
            for r in json.load(open(f))["runs"]]
    if not rows:
        continue
    tok = sorted(r["output_tok_per_s"] for r in rows)

    def med(key):
        return st.median(key(r) for r in rows)
    print(f"k={k:2d} n={len(rows)} tok/s min {tok[0]:,.0f} med {st.median(tok):,.0f} "
          f"max {tok[-1]:,.0f} | ttft p50 {med(lambda r: r['ttft_ms']['p50']):.0f} "
          f"p99 {med(lambda r: r['ttft_ms']['p99']):.0f} ms | itl p50 "
          f"{med(lambda r: r['itl_ms']['p50']):.1f} p99 {med(lambda r: r['itl_ms']['p99']):.1f} | "
          f"tok/msg {med(lambda r: r['tokens_per_message']):.1f} | batch "
          f"{med(lambda r: r['decode']['mean_batch']):.0f} | step wall "
          f"{med(lambda r: r['decode']['per_step_ms']['wall']):.2f} ms")
