"""Per (codec, level, mode): means with 95 % bootstrap intervals over questions, and the paired
difference against int8 (the noise floor), from the rows of `kvrag bench codec --json`."""
import json, re, sys
from kvrag.bench.metrics import bootstrap_interval

path, *groups = sys.argv[1:]  # optional groups: name=idprefix
data = json.load(open(path))
eff = data["answer_effect"]
rows = eff["rows"]
ratio = {(r["codec"], r["level"]): r["ratio_vs_bf16"] for r in data["rows"]}
bits = {(r["codec"], r["level"]): r["bits_per_element"] for r in data["rows"]}
subsets = [("all", lambda q: True)] + [(g.split("=")[0], (lambda p: lambda q: re.match(p, q) is not None)(g.split("=")[1])) for g in groups]
M = ("first_token_agreement", "agreement", "identical", "delta_nll")
def fmt(m, lo, hi): return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"
for name, keep in subsets:
    sel = [r for r in rows if keep(str(r["id"]))]
    qs = sorted({r["id"] for r in sel}, key=str)
    print(f"\n### {name}: {len(qs)} questions, {eff['model']}\n")
    for mode in eff["modes"]:
        by = {}
        for r in sel:
            if r["mode"] == mode and r["codec"] != "uncompressed":
                by.setdefault((r["codec"], r["level"]), {})[r["id"]] = r
        ref = by[("int8", 0)]
        print(f"mode `{mode}`\n")
        print("| codec | level | bits/elem | × vs bf16 | first-token | agreement | identical | ΔNLL | agreement − int8 (paired) | first-token − int8 |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for key, d in by.items():
            cells = []
            for m in M:
                v = [d[q][m] for q in qs]
                lo, hi = bootstrap_interval(v)
                cells.append(fmt(sum(v) / len(v), lo, hi))
            diffs = []
            for m in ("agreement", "first_token_agreement"):
                dv = [d[q][m] - ref[q][m] for q in qs]
                lo, hi = bootstrap_interval(dv)
                diffs.append(f"{sum(dv)/len(dv):+.3f} [{lo:+.3f}, {hi:+.3f}]")
            print(f"| {key[0]} | {key[1]} | {bits[key]:.2f} | {ratio[key]:.2f} | " + " | ".join(cells + diffs) + " |")
        print()
