"""Per-kernel table from Nsight Compute's CSV (scripts/profile_kernels.sh).

  ncu_table.py FILE.csv [PASSES]   kernels by total time: calls, total and mean µs, DRAM read
                                    GB/s; with PASSES, also the mean µs per pass (calls / PASSES)
  ncu_table.py --selftest          checks the parsing on a synthetic CSV

ncu writes one row per (kernel launch, metric), and its units vary with the value ("nsecond",
"usecond", "msecond"; "byte", "Kbyte", "Mbyte", "Gbyte"), so every value is brought to µs and
bytes first. A kernel's name is what precedes its argument list.
"""
import collections
import csv
import io
import sys

TIME = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
        "second": 1e6, "s": 1e6}
BYTES = {"byte": 1, "B": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9,
         "GB": 1e9, "Kibyte": 1024, "KiB": 1024, "Mibyte": 1 << 20, "MiB": 1 << 20}


def table(text):
    """{kernel: [calls, total µs, DRAM bytes read]} from ncu's CSV text."""
    out = collections.defaultdict(lambda: [0, 0.0, 0.0])
    header = None
    for row in csv.reader(io.StringIO(text)):
        if "Kernel Name" in row and "Metric Name" in row:
            header = row
            continue
        if header is None or len(row) != len(header):
            continue
        r = dict(zip(header, row))
        name = r["Kernel Name"].split("(")[0].strip()
        value = float(r["Metric Value"].replace(",", ""))
        unit = r["Metric Unit"]
        if r["Metric Name"] == "gpu__time_duration.sum":
            if unit not in TIME:
                raise ValueError(f"unknown time unit {unit!r}")
            out[name][0] += 1
            out[name][1] += value * TIME[unit]
        elif r["Metric Name"] == "dram__bytes_read.sum":
            if unit not in BYTES:
                raise ValueError(f"unknown byte unit {unit!r}")
            out[name][2] += value * BYTES[unit]
    return dict(out)


def render(t, passes=None):
    lines = [f"{'kernel':30} {'calls':>6} {'total us':>10} {'mean us':>9} {'GB/s':>8}"
             + (f" {'us/pass':>9}" if passes else "")]
    for name, (calls, us, read) in sorted(t.items(), key=lambda kv: -kv[1][1]):
        gbs = read / (us * 1e3) if us > 0 else 0.0
        line = f"{name:30} {calls:6d} {us:10.1f} {us / max(calls, 1):9.2f} {gbs:8.1f}"
        if passes:
            line += f" {us / passes:9.2f}"
        lines.append(line)
    total = sum(v[1] for v in t.values())
    lines.append(f"{'all kernels':30} {sum(v[0] for v in t.values()):6d} {total:10.1f}"
                 + (f" {'':9} {'':8} {total / passes:9.2f}" if passes else ""))
    return "\n".join(lines)


def selftest():
    csv_text = (
        "==PROF== Connected to process\n"
        '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
        '"0","gemv_bf16(const unsigned short*, int)","gpu__time_duration.sum","usecond","10.50"\n'
        '"0","gemv_bf16(const unsigned short*, int)","dram__bytes_read.sum","Mbyte","21.00"\n'
        '"1","gemv_bf16(const unsigned short*, int)","gpu__time_duration.sum","nsecond","9,500"\n'
        '"1","gemv_bf16(const unsigned short*, int)","dram__bytes_read.sum","Kbyte","1,000"\n'
        '"2","argmax(const float*, int, unsigned int*)","gpu__time_duration.sum","msecond","0.002"\n'
    )
    t = table(csv_text)
    assert t["gemv_bf16"][0] == 2, t
    assert abs(t["gemv_bf16"][1] - 20.0) < 1e-9, t
    assert abs(t["gemv_bf16"][2] - 22e6) < 1e-3, t
    assert t["argmax"][0] == 1 and abs(t["argmax"][1] - 2.0) < 1e-9, t
    text = render(t, passes=2)
    first = text.splitlines()[1]
    assert first.split()[0] == "gemv_bf16" and first.split()[-1] == "10.00", text
    try:
        table(csv_text.replace("usecond", "fortnight"))
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown unit was accepted")
    print("ncu_table selftest ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--selftest"]:
        selftest()
    elif len(sys.argv) in (2, 3):
        passes = int(sys.argv[2]) if len(sys.argv) == 3 else None
        print(render(table(open(sys.argv[1]).read()), passes))
    else:
        sys.exit(__doc__)
