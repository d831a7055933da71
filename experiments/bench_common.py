"""What the benchmark scripts share: run ids and CSV output."""
import csv
import datetime
import os
import uuid


def new_run_id():
    """A UTC timestamp plus a random suffix, e.g. ``20261129T115548Z-b7ac13``."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ-")
    return stamp + uuid.uuid4().hex[:6]


def write_rows(path, fields, rows, digits=3):
    """Write ``rows`` (dicts) to CSV ``path``: only ``fields``, floats rounded
    to ``digits``; print where they went."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(v, digits) if isinstance(v, float) else v)
                        for k, v in r.items() if k in fields})
    print(f"wrote {len(rows)} rows to {path}")
