"""Prints the RESULTS table of this folder's 0 ms runs (python summarize.py)."""
import glob
import json
import os
import statistics as st

HERE = os.path.dirname(os.path.abspath(__file__))
SETS = (("before (K = 8, no hold)", ["experiment/hold_0_*.json", "ab/old_*.json"]),
        ("a turn held after each arrival, at most 8 in a row", ["experiment/hold_8_*.json", "ab/new_*.json"]),
        ("the same, at most 32 in a row", ["experiment/hold_32_*.json"]))
for name, pats in SETS:
    runs = [r for p in pats for f in sorted(glob.glob(os.path.join(HERE, p)))
            for r in json.load(open(f))["runs"]]
    def g(f):
        return sorted(f(r) for r in runs)
    tps = g(lambda r: r["output_tok_per_s"])
    cpu = g(lambda r: r["cpu"]["control_plane_us_per_token"])
    everything = g(lambda r: sum(r["cpu"]["seconds"].values()) / r["output_tokens"] * 1e6)
    print(f"| {name} | {len(runs)} | {tps[0]:,.0f} / {st.median(tps):,.0f} / {tps[-1]:,.0f} | "
          f"{sum(t >= 60000 for t in tps)} | {st.median(g(lambda r: r['ttft_ms']['p50'])):,.0f} / "
          f"{st.median(g(lambda r: r['ttft_ms']['p99'])):,.0f} | "
          f"{st.median(g(lambda r: r['itl_ms']['p99'])):.1f} | "
          f"{st.median(g(lambda r: r['decode']['mean_batch'])):.0f} | "
          f"{st.median(cpu):.1f} | {st.median(everything):.1f} |")
