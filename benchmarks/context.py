"""The study context: device, sizes mode, time budget and the result rows a study writes
(`<out>/<study>.json`, rewritten after every row)."""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .common import DTYPES, cpu_median_ms, median_ms, rotating

__all__ = ["TOLERANCE", "Context"]

# Relative-error thresholds against a float64 product, by the value dtype of the inputs.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float64: 1e-9}


@dataclass
class Context:
    """What a study needs: device, sizes mode, timing settings, its time budget, its rows.

    `add(row)` completes a row (ratio, tolerance, check, roofline) and rewrites the study's
    JSON file at once, so that a run cut short still leaves every finished measurement.
    """

    study: str
    device: torch.device
    quick: bool
    smoke: bool
    data: Path
    out: Path
    roof: dict
    env: dict
    budget_s: float
    backend: str = "auto"
    copy_to: Path | None = None
    warmup_ms: int = 10
    rep_ms: int = 40
    started: float = field(default_factory=time.perf_counter)
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    status: str = "running"
    finished: float | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    def time_left(self) -> float:
        return self.budget_s - self.elapsed()

    def over_budget(self, what: str, slack: float = 0.0) -> bool:
        """True (and the skip counted under `what`) once the budget (plus `slack` s) is spent."""
        if self.time_left() + slack > 0:
            return False
        self.skipped[what] = self.skipped.get(what, 0) + 1
        return True

    def note(self, text: str) -> None:
        print(f"  note: {text}", flush=True)
        self.notes.append(text)

    def cuda_anchor(self, name: str, module: str, attr: str):
        """`module.attr`, an anchor that runs on CUDA only; None (noted) where the installed
        torch lacks it or the device is not CUDA."""
        anchor = None
        try:
            anchor = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            self.note(f"{name} unavailable: {e}")
        if not self.cuda:
            anchor = None
            self.note(f"{name} needs CUDA: only the dense anchor on this device")
        return anchor

    def bench(self, fn, inputs: list | None = None) -> float:
        """Median ms of fn (called with each input set in turn when `inputs` is given)."""
        step = rotating(fn, inputs) if inputs is not None else fn
        if self.cuda:
            return median_ms(step, warmup=self.warmup_ms, rep=self.rep_ms)
        return cpu_median_ms(step, reps=1 if self.smoke else 5)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def roofline(self, ms: float, nbytes: float, flops: float, dtype: torch.dtype) -> tuple[float, str]:
        """Fraction of the limit reached: max(bytes / bandwidth, flops / rate) over the time."""
        rate = self.roof["tf32_tflops"] if dtype == torch.float32 else self.roof["fp16_tflops"]
        t_mem = nbytes / (self.roof["bandwidth_GBs"] * 1e9)
        t_flop = flops / (rate * 1e12)
        floor = max(t_mem, t_flop)
        return (floor / (ms * 1e-3) if ms and ms > 0 else float("nan")), ("memory" if t_mem >= t_flop else "compute")

    def add(self, row: dict) -> dict:
        """Complete a row and record it; prints one line and flags a failed check loudly."""
        dtype = DTYPES.get(row.get("dtype", ""), torch.float32)
        row.setdefault("tol", TOLERANCE[dtype])
        anchor_ms, insum_ms = row.get("anchor_ms"), row.get("insum_ms")
        if row.get("ratio") is None:
            ok_times = anchor_ms and insum_ms and anchor_ms > 0 and insum_ms > 0
            row["ratio"] = anchor_ms / insum_ms if ok_times else None
        err = row.get("err")
        row["ok"] = err is not None and math.isfinite(err) and err <= row["tol"]
        anchor_err = row.get("anchor_err")
        if anchor_err is not None:
            row["anchor_ok"] = math.isfinite(anchor_err) and anchor_err <= row.get("anchor_tol", row["tol"])
        if row.get("bytes") is not None and insum_ms:
            row["roof_frac"], row["bound"] = self.roofline(insum_ms, row["bytes"], row.get("flops", 0), dtype)
        row = {"study": self.study, **row}
        self.rows.append(row)
        ratio = row["ratio"]
        flag = "" if row["ok"] else "   <<< CHECK FAILED"
        if anchor_err is not None and not row["anchor_ok"]:
            flag += "   (anchor check failed)"
        line = (
            f"  {row['set'][:46]:46s} {str(row.get('case', ''))[:36]:36s} insum {_fmt_ms(insum_ms)}"
            f" | {row['anchor'][:16]:>16s} {_fmt_ms(anchor_ms)} "
            + (f"x{ratio:5.2f}" if ratio else "  n/a ")
            + (f"  err {err:.1e}" if err is not None else "  err n/a")
        )
        print(line + flag, flush=True)
        self.save()
        return row

    def fail(self, row: dict, error: BaseException) -> None:
        """Record a configuration whose insum run raised: a failed check, loudly."""
        message = f"{type(error).__name__}: {str(error)[:300]}"
        print(f"  <<< FAILED {row.get('set')} {row.get('case')}: {message}", flush=True)
        self.rows.append({"study": self.study, "anchor": "-", "anchor_ms": None, "insum_ms": None, "ratio": None,
                          "err": None, "ok": False, "error": message, **row})
        self.save()

    def result(self) -> dict:
        return {
            "study": self.study,
            "status": self.status,
            "env": self.env,
            "ceilings": self.roof,
            "mode": "smoke" if self.smoke else "quick" if self.quick else "full",
            "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed(), 1),
            "notes": self.notes,
            "skipped": self.skipped,
            "rows": self.rows,
        }

    def save(self, status: str | None = None) -> None:
        """Rewrite <out>/<study>.json (and the copy); `status` once the study ends."""
        if status is not None:
            self.status = status
            self.finished = time.perf_counter()
        text = json.dumps(_finite(self.result()), indent=1, default=_json_default)
        for folder in filter(None, (self.out, self.copy_to)):
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{self.study}.json.tmp"
            tmp.write_text(text)
            os.replace(tmp, folder / f"{self.study}.json")


def _fmt_ms(ms) -> str:
    if ms is None:
        return "     n/a"
    return f"{ms * 1e3:7.1f}us" if ms < 1 else f"{ms:7.3f}ms"


def _finite(value):
    """NaN and infinities become None, so that the files are strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value):
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, torch.Size):
        return list(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")
