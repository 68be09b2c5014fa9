"""Diagnostic (not a timing): does MAP's inherited private model (HPM) act under the authors' protocol
(`suites/paper-map.yaml`, default cell `map`: 100 clients, 20 a round, 150 rounds, 5 local epochs)?
Reads each seed's finished `fedavg`, MAP (`--method`, default `map`; `map-code` for the authors' code's
stage 2) and (if present) `fedrs` runs (`metrics.jsonl`) and prints, over windows of rounds, mean
differences in accuracy points with how many rounds were above 0:

1. mu, the inherited model's weight (Eq. 10, `hpm-mu-mean`: the round's clients' mean), at set rounds;
2. HPM - its stage-2 model (`personalized-accuracy` - `stage2-accuracy`, the same clients and local
   test splits): what folding into the HPM adds over the model it folds in (grows with mu if it acts);
3. stage-2 model - FedAvg-FT and HPM - FedAvg-FT (FedAvg's locally trained model), paired: a seed
   samples the same clients each round in every method (checked; a mismatch stops the script);
4. global accuracy, MAP - FedAvg and MAP - FedRS (the restricted softmax's share of MAP's gain).

    .venv/bin/python benchmarks/map_hpm.py [--runs outputs/suites/paper-map] [--part map]
        [--method map] [--seeds 0 1 2] [--windows 1-10 11-50 51-100 101-150]

Windows past a run's last round are dropped. The figures are in `docs/notes/map.md` (MAP at 150 rounds; `map-code`
at 150, `--method map-code`, and at 50, `--part map-r50 --method map-code --windows 1-10 11-30 31-50`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _common import ROOT, read_jsonl

from fedskew.run.experiments import run_name

MU_ROUNDS = (2, 10, 30, 50, 100, 150)
PERSONAL = "personalized-accuracy"
GLOBAL = "global-accuracy"


def load_run(runs: Path, part: str, method: str, seed: int, required: bool = True) -> list[dict] | None:
    """A finished run's per-round metrics; a missing or unfinished run is `None`, or `SystemExit` with
    its path when `required`."""
    run = runs / run_name(part, method, seed)
    if (run / "summary.json").is_file():
        return read_jsonl(run / "metrics.jsonl")
    if required:
        raise SystemExit(f"{run}: no finished run (summary.json missing); run the suite cell first")
    return None


def values(run: list[dict], key: str, what: str) -> list[float]:
    """`key` of every round (an accuracy in [0, 1]); `SystemExit` naming the run and round that lacks it."""
    for r in run:
        if not isinstance(r.get(key), (int, float)):
            raise SystemExit(f"{what}: round {r.get('round', '?')} has no numeric {key!r}; is it a MAP / FedAvg run?")
    return [r[key] for r in run]


def minus(a: list[float], b: list[float]) -> list[float]:
    """Per-round `a - b` in accuracy points, over the rounds both have."""
    return [100 * (x - y) for x, y in zip(a, b, strict=False)]


def same_clients(a: list[dict], b: list[dict], what: str) -> None:
    """Paired client metrics need the same sampled clients each round; stop with the round otherwise."""
    for x, y in zip(a, b, strict=False):
        if sorted(x["partitions"]) != sorted(y["partitions"]):
            raise SystemExit(f"{what}: round {x['round']} sampled different clients; pairing is meaningless")


def window_stats(diff: list[float], lo: int, hi: int) -> tuple[float, int, int]:
    """(mean, rounds above 0, rounds) of `diff` over rounds lo..hi (1-based, inclusive)."""
    part = diff[lo - 1 : hi]
    return statistics.fmean(part), sum(v > 0 for v in part), len(part)


def cell(window: tuple[int, int], mean: float, above: int, total: int) -> str:
    """'101-150: +0.28 (41/50 > 0)'."""
    return f"{window[0]}-{window[1]}: {mean:+.2f} ({above}/{total} > 0)"


def parse_window(text: str) -> tuple[int, int]:
    """'11-50' -> (11, 50)."""
    try:
        lo, hi = (int(v) for v in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"window {text!r}: expected FIRST-LAST rounds, e.g. 11-50") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"window {text!r}: need 1 <= FIRST <= LAST")
    return lo, hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=ROOT / "outputs" / "suites" / "paper-map")
    ap.add_argument("--part", default="map")
    ap.add_argument("--method", default="map", help="the MAP run's method label in the suite (map, map-code)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--windows", type=parse_window, nargs="+", default=[(1, 10), (11, 50), (51, 100), (101, 150)])
    args = ap.parse_args()

    rows: dict[str, list[dict[tuple[int, int], tuple[float, int, int]]]] = {}
    for seed in args.seeds:
        hpm, ft = (load_run(args.runs, args.part, m, seed) for m in (args.method, "fedavg"))
        fedrs = load_run(args.runs, args.part, "fedrs", seed, required=False)
        same_clients(hpm, ft, f"seed {seed} {args.method} / fedavg")
        n = min(len(r) for r in (hpm, ft, fedrs or hpm))
        windows = [(lo, hi) for lo, hi in args.windows if hi <= n]
        mus = {r: hpm[r - 1].get("hpm-mu-mean") for r in MU_ROUNDS if r <= n}
        print(f"seed {seed}: {n} rounds, the same sampled clients in every round")
        print("  mu at round " + ", ".join(f"{r}: {mu:.2f}" for r, mu in mus.items() if mu is not None))
        m, f = f"seed {seed} {args.method}", f"seed {seed} fedavg"
        personal, stage2, map_global = (values(hpm, k, m) for k in (PERSONAL, "stage2-accuracy", GLOBAL))
        ft_personal = values(ft, PERSONAL, f)
        diffs = {
            "HPM - its stage-2 model": minus(personal, stage2),
            "stage-2 model - FedAvg-FT": minus(stage2, ft_personal),
            "HPM - FedAvg-FT": minus(personal, ft_personal),
            "global, MAP - FedAvg": minus(map_global, values(ft, GLOBAL, f)),
        }
        if fedrs is not None:
            diffs["global, MAP - FedRS"] = minus(map_global, values(fedrs, GLOBAL, f"seed {seed} fedrs"))
        for name, diff in diffs.items():
            stats = {w: window_stats(diff, *w) for w in windows}
            rows.setdefault(name, []).append(stats)
            print(f"  {name:26s} " + " | ".join(cell(w, *s) for w, s in stats.items()))
    print(f"mean over {len(args.seeds)} seeds (rounds above 0 summed):")
    for name, per_seed in rows.items():
        shared = [w for w in args.windows if all(w in s for s in per_seed)]
        cells = []
        for w in shared:
            mean = statistics.fmean(s[w][0] for s in per_seed)
            cells.append(cell(w, mean, sum(s[w][1] for s in per_seed), sum(s[w][2] for s in per_seed)))
        print(f"  {name:26s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
