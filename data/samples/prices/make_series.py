"""Writes series.csv: 300 days of a made-up electricity series (load, temperature, price), deterministic.

    python data/samples/prices/make_series.py     # rewrites series.csv beside this file
"""
from __future__ import annotations

import datetime
import math
import random
from pathlib import Path

DAYS = 300
START = datetime.date(2023, 1, 1)


def rows() -> list[str]:
    rng = random.Random(0)
    out = ["date,load_mw,temp_c,price"]
    for t in range(DAYS):
        season = math.cos(2 * math.pi * t / 365)       # 1 in midwinter, -1 in midsummer
        week = 1.0 if (START.weekday() + t) % 7 < 5 else 0.85  # weekends use less
        temp = 4.0 - 12.0 * season + rng.gauss(0, 2)
        load = (900 + 250 * season + 0.3 * t) * week + rng.gauss(0, 25)
        price = 40 + 0.05 * load - 0.4 * temp + rng.gauss(0, 3)
        out.append(f"{START + datetime.timedelta(days=t)},{load:.1f},{temp:.1f},{price:.2f}")
    return out


if __name__ == "__main__":
    (Path(__file__).with_name("series.csv")).write_text("\n".join(rows()) + "\n")
