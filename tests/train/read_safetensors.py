"""Reads a safetensors file with Python's standard library only, as an independent check of the
format: prints one line per tensor, "name dtype sum", and fails on any inconsistency."""
import json
import struct
import sys

SIZES = {"F64": ("d", 8), "F32": ("f", 4), "F16": ("e", 2), "I64": ("q", 8), "I32": ("i", 4), "I16": ("h", 2),
         "I8": ("b", 1), "U8": ("B", 1), "BOOL": ("?", 1)}

def main(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    end = 0
    for name, e in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                          key=lambda kv: kv[1]["data_offsets"][0]):
        begin, stop = e["data_offsets"]
        assert begin == end, f"{name}: gap or overlap at {begin}"
        fmt, size = SIZES[e["dtype"]]
        count = 1
        for d in e["shape"]:
            count *= d
        assert stop - begin == count * size, f"{name}: size mismatch"
        values = struct.unpack(f"<{count}{fmt}", body[begin:stop])
        print(name, e["dtype"], repr(float(sum(values))))
        end = stop
    assert end == len(body), "trailing bytes"

main(sys.argv[1])
