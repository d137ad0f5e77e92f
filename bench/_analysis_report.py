"""``bench/analysis.py``'s checks and report: profd's figures against HTA's and the
generator's, the targets, and the RESULT line."""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any

FIGURES = ("idle", "compute", "non_compute", "overlap")
MAX_PP = 1.0
TARGET_SPEEDUP = 20.0
TARGET_PEAK_RATIO = 2.0


# -- checks -------------------------------------------------------------------------------------
def compare(
    profd: dict[str, Any], hta: dict[str, Any], layout: dict[str, Any] | None
) -> tuple[float, float, float, list[str]]:
    """(max profd-HTA difference in pp, max difference from the expected figures in pp,
    kernel-time difference in % of the total, problems)."""
    problems: list[str] = []
    expected = {}
    if layout is not None:
        import gpu_trace_set

        for r in range(layout["ranks"]):
            expected[r] = gpu_trace_set.expected(r, layout["steps"], layout["layers"])
    if sorted(profd["ranks"]) != sorted(hta["ranks"]):
        problems.append(
            f"ranks with GPU figures: profd {sorted(profd['ranks'])}, HTA {sorted(hta['ranks'])}"
        )
    diff = off = 0.0
    for rank in sorted(set(profd["ranks"]) & set(hta["ranks"])):
        p, h = profd["ranks"][rank], hta["ranks"][rank]
        want = expected[rank].pct() if rank in expected else None
        for k in FIGURES:
            if (p[k] is None) != (h[k] is None):
                problems.append(f"rank {rank} {k}: profd {p[k]}, HTA {h[k]}")
                continue
            if p[k] is None:
                continue
            d = abs(p[k] - h[k])
            diff = max(diff, d)
            if d > MAX_PP:
                problems.append(f"rank {rank} {k}: profd {p[k]:.3f} %, HTA {h[k]:.3f} %")
            if want is not None:
                e = max(abs(p[k] - want[k]), abs(h[k] - want[k]))
                off = max(off, e)
                if e > MAX_PP:
                    problems.append(
                        f"rank {rank} {k}: expected {want[k]:.3f} %, profd {p[k]:.3f} %, "
                        f"HTA {h[k]:.3f} %"
                    )
    total = sum(hta["kernels"].values()) or 1.0
    names = set(profd["kernels"]) | set(hta["kernels"])
    gaps = [abs(profd["kernels"].get(n, 0.0) - hta["kernels"].get(n, 0.0)) for n in names]
    kdiff = 100 * max(gaps, default=0.0) / total
    # profd lists the top operators of each stage: complete on the generated sets only
    if layout is not None and kdiff > MAX_PP:
        problems.append(f"kernel time per name differs by {kdiff:.3f} % of the total")
    if expected:
        want_total = sum(e.sum_comp + e.sum_comm + e.sum_mem for e in expected.values())
        for tool, kernels in (("profd", profd["kernels"]), ("HTA", hta["kernels"])):
            got = sum(kernels.values())
            if abs(got - want_total) > 1e-6 * want_total:
                problems.append(f"{tool}: kernel time {got:.0f} us, expected {want_total} us")
    return diff, off, kdiff, problems


# -- running ------------------------------------------------------------------------------------
def report(
    raw: int,
    profd_runs: list[dict[str, Any]],
    hta_runs: list[dict[str, Any]],
    pss_p: float | None,
    pss_h: float | None,
    expected_ranks: list[int],
    layout: dict[str, Any] | None,
    load_start: float,
    hta_ns: str = "rounded",
) -> None:
    first_p, first_h = profd_runs[0], hta_runs[0]
    problems = _run_problems(profd_runs, hta_runs, expected_ranks)
    diff, off, kdiff, found = compare(first_p, first_h, layout)
    problems += found
    _print_figures(profd_runs, hta_runs, layout)
    j = _Judged.of(raw, profd_runs, hta_runs, pss_p, diff)
    _print_targets(j, diff, off, kdiff)
    if problems:
        for line in problems:
            print("MISMATCH:", line)
        sys.exit(f"{len(problems)} check(s) failed: no RESULT")
    r0p, r0h = first_p["ranks"][min(first_p["ranks"])], first_h["ranks"][min(first_p["ranks"])]
    fields: dict[str, Any] = {
        "hta_work": "breakdown",
        "layout": layout.get("text", "2.13") if layout else "-",
        "parse": ",".join(first_p["parse"]),
        "hta_ns": hta_ns,
        "ranks": len(expected_ranks),
        "bytes": raw,
        "profd_s": f"{j.p_s:.3f}",
        "hta_s": f"{j.h_s:.2f}",
        "speedup": f"{j.speedup:.1f}",
        "profd_best_s": f"{j.p_best:.3f}",
        "hta_best_s": f"{j.h_best:.2f}",
        "speedup_best": f"{j.speedup_best:.1f}",
        "profd_cpu_s": f"{j.p_cpu:.2f}",
        "hta_cpu_s": f"{j.h_cpu:.1f}",
        "cpu_ratio": f"{j.cpu_ratio:.1f}",
        "hta_read_s": f"{statistics.median(r['read_s'] for r in hta_runs):.2f}",
    }
    for k in FIGURES:
        fields[f"rank0_profd_{k}_pct"] = "-" if r0p[k] is None else f"{r0p[k]:.2f}"
        fields[f"rank0_hta_{k}_pct"] = "-" if r0h[k] is None else f"{r0h[k]:.2f}"
    fields |= {
        "max_diff_pp": f"{diff:.4f}",
        "expected_diff_pp": f"{off:.4f}" if layout is not None else "-",
        "kernel_diff_pct": f"{kdiff:.4f}",
        "peak_abs_mb": f"{j.peak:.1f}",
        "profd_pss_mb": f"{pss_p:.1f}" if pss_p is not None else "-",
        "raw_mb": f"{raw / 1e6:.1f}",
        "peak_ratio": f"{j.ratio:.2f}",
        "hta_self_mb": f"{max(r['self_mb'] for r in hta_runs):.0f}",
        "hta_child_mb": f"{max(r['child_mb'] for r in hta_runs):.0f}",
        "hta_pss_mb": f"{pss_h:.0f}" if pss_h is not None else "-",
        "rounds": len(profd_runs),
        "targets": "met" if not j.missed else "missed:" + ",".join(j.missed),
        "load_start": f"{load_start:.2f}",
        "load": f"{os.getloadavg()[0]:.2f}",
    }
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def _run_problems(
    profd_runs: list[dict[str, Any]], hta_runs: list[dict[str, Any]], expected_ranks: list[int]
) -> list[str]:
    """HTA's ranks against the files', and profd's figures from round to round."""
    problems = []
    for r in hta_runs:
        if r["hta_ranks"] != expected_ranks:
            problems.append(f"HTA ranks {r['hta_ranks']}, distributedInfo {expected_ranks}")
    for p in profd_runs[1:]:
        if p["ranks"] != profd_runs[0]["ranks"]:
            problems.append("profd's figures changed between rounds")
    return problems


def _print_targets(j: _Judged, diff: float, off: float, kdiff: float) -> None:
    print(
        f"targets: speedup {j.judged:.1f} (wall: median {j.speedup:.1f}, best "
        f"{j.speedup_best:.1f}; CPU {j.cpu_ratio:.1f}) >= {TARGET_SPEEDUP:.0f} "
        f"{'ok' if j.judged >= TARGET_SPEEDUP else 'MISSED'}; figures within {diff:.4f} pp "
        f"(expected: {off:.4f} pp, kernel time {kdiff:.4f} %) <= {MAX_PP} "
        f"{'ok' if diff <= MAX_PP else 'MISSED'}; peak {j.checked_peak:.0f} MB = "
        f"{j.ratio:.2f}x raw <= {TARGET_PEAK_RATIO:.0f}x "
        f"{'ok' if j.ratio <= TARGET_PEAK_RATIO else 'MISSED'}"
    )


@dataclass(frozen=True)
class _Judged:
    """The rounds' medians and bests, and the targets they meet."""

    p_s: float
    h_s: float
    p_best: float
    h_best: float
    p_cpu: float
    h_cpu: float
    peak: float
    checked_peak: float
    ratio: float
    missed: tuple[str, ...]

    @property
    def speedup(self) -> float:
        return self.h_s / self.p_s

    @property
    def speedup_best(self) -> float:
        return self.h_best / self.p_best

    @property
    def cpu_ratio(self) -> float:
        return self.h_cpu / self.p_cpu

    @property
    def judged(self) -> float:
        return min(self.speedup, self.cpu_ratio)

    @classmethod
    def of(
        cls,
        raw: int,
        profd_runs: list[dict[str, Any]],
        hta_runs: list[dict[str, Any]],
        pss_p: float | None,
        diff: float,
    ) -> _Judged:
        p_s = statistics.median(r["seconds"] for r in profd_runs)
        h_s = statistics.median(r["seconds"] for r in hta_runs)
        p_cpu = statistics.median(r["cpu_s"] for r in profd_runs)
        h_cpu = statistics.median(r["cpu_s"] for r in hta_runs)
        peak = max(r["peak_abs_mb"] for r in profd_runs)
        checked_peak = max(peak, pss_p or 0.0)
        ratio = checked_peak / (raw / 1e6)
        judged = min(h_s / p_s, h_cpu / p_cpu)
        missed = tuple(
            name
            for name, ok in (
                ("speedup", judged >= TARGET_SPEEDUP),
                ("agreement", diff <= MAX_PP),
                ("peak", ratio <= TARGET_PEAK_RATIO),
            )
            if not ok
        )
        return cls(
            p_s,
            h_s,
            min(r["seconds"] for r in profd_runs),
            min(r["seconds"] for r in hta_runs),
            p_cpu,
            h_cpu,
            peak,
            checked_peak,
            ratio,
            missed,
        )


def _print_figures(
    profd_runs: list[dict[str, Any]],
    hta_runs: list[dict[str, Any]],
    layout: dict[str, Any] | None,
) -> None:
    """Memory of both, then each rank's figures: profd's, HTA's, and the generator's."""
    first_p, first_h = profd_runs[0], hta_runs[0]
    print(
        f"profd: {first_p['mode']} x{first_p['workers']} ({first_p['start_method']}), parse "
        f"{first_p['parse']}; memory: summarising process {first_p['parent_abs_mb']:.0f} MB "
        f"absolute (+{first_p['parent_growth_mb']:.0f} MB in the call), workers "
        f"+{first_p['workers_mb']:.0f} MB above their start (largest worker "
        f"{first_p['largest_worker_mb']:.0f} MB absolute)"
    )
    h_self = max(r["self_mb"] for r in hta_runs)
    h_child = max(r["child_mb"] for r in hta_runs)
    print(f"HTA: peak {h_self:.0f} MB in its process, {h_child:.0f} MB in its largest worker")
    print("rank  figure        profd %     HTA %  expected %")
    want = {}
    if layout is not None:
        import gpu_trace_set

        want = {
            r: gpu_trace_set.expected(r, layout["steps"], layout["layers"]).pct()
            for r in range(layout["ranks"])
        }
    for rank in sorted(first_p["ranks"]):
        for k in FIGURES:
            pv, hv = first_p["ranks"][rank][k], first_h["ranks"].get(rank, {}).get(k)
            ev = want.get(rank, {}).get(k)
            cells = [f"{v:10.3f}" if v is not None else f"{'-':>10}" for v in (pv, hv, ev)]
            print(f"{rank:>4}  {k:<12}{''.join(cells)}")
